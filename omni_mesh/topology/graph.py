"""The stage graph's checks: an order for the stages, no cycle, every stage's output reaching a final
stage, and the note for stages no edge connects."""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from omni_mesh.topology.model import Edges, StageSpec, TopologyError, describe_stage


def check_graph(
    stages: dict[int, StageSpec], edges: Edges, *, stranded: list[str] | None = None
) -> list[int]:
    """Topological order (ties by stage id); a cycle or a stage that reaches no final stage is an error.
    With `stranded` (vllm-omni's files: its loader checks no reachability) the latter is appended there instead."""
    successors: dict[int, list[int]] = {sid: [] for sid in stages}
    indegree = dict.fromkeys(stages, 0)
    for src, dst in edges:
        successors[src].append(dst)
        indegree[dst] += 1
    ready = [sid for sid, degree in indegree.items() if degree == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        sid = heapq.heappop(ready)
        order.append(sid)
        for dst in sorted(successors[sid]):
            indegree[dst] -= 1
            if indegree[dst] == 0:
                heapq.heappush(ready, dst)
    if len(order) < len(stages):
        _raise_cycle(stages, successors, entries=[sid for sid in stages if not _has_input(sid, edges)])
    problem = _stranded_message(stages, edges)
    if problem is not None and stranded is None:
        raise TopologyError(problem)
    if problem is not None and stranded is not None:
        stranded.append(
            f"{problem}; vllm-omni's loader checks no such thing and accepts the file, so here it is a warning"
        )
    return order


def unconnected_warning(stages: dict[int, StageSpec], edges: Edges) -> str | None:
    """Stages without any edge each run alone; vllm-omni files mean that only with `modes:`, so the
    parser gives this warning for their files without one."""
    if edges or len(stages) < 2:
        return None
    who = ", ".join(describe_stage(stage) for stage in stages.values())
    return (
        f"no edge connects the stages ({who}): each is an entry and a final stage and runs alone; if they "
        "form a pipeline, give each downstream stage engine_input_source: [<upstream stage id>]"
    )


def _raise_cycle(stages: dict[int, StageSpec], successors: dict[int, list[int]], entries: list[int]) -> None:
    cycle = _find_cycle(successors)
    members = ", ".join(describe_stage(stages[sid]) for sid in dict.fromkeys(cycle))
    message = f"the stages form a cycle {'->'.join(map(str, cycle))} ({members})"
    unreached = sorted(set(stages) - _reachable(entries, successors))
    if unreached:
        who = ", ".join(describe_stage(stages[sid]) for sid in unreached)
        message += f"; no entry stage reaches {who}"
    raise TopologyError(message + "; the stage graph must be acyclic: remove one of these edges")


def _stranded_message(stages: dict[int, StageSpec], edges: Edges) -> str | None:
    """What is wrong when a stage reaches no final stage (its output would be lost), else None."""
    finals = [sid for sid, stage in stages.items() if stage.final_output]
    if not finals:
        return None  # every stage then reaches a sink, and sinks are the final stages
    predecessors: dict[int, list[int]] = {sid: [] for sid in stages}
    for src, dst in edges:
        predecessors[dst].append(src)
    stranded = sorted(set(stages) - _reachable(finals, predecessors))
    if stranded:
        who = ", ".join(describe_stage(stages[sid]) for sid in stranded)
        final_list = ", ".join(describe_stage(stages[sid]) for sid in finals)
        return (
            f"{who} {'reaches' if len(stranded) == 1 else 'reach'} no final stage (final: {final_list}), "
            f"so {'its' if len(stranded) == 1 else 'their'} output would be lost; connect "
            f"{'it' if len(stranded) == 1 else 'each'} to a stage that leads to a final one, or mark "
            f"{'it' if len(stranded) == 1 else 'each'} final_output: true"
        )
    return None


def _has_input(sid: int, edges: Edges) -> bool:
    return any(dst == sid for _, dst in edges)


def _reachable(starts: Iterable[int], neighbours: dict[int, list[int]]) -> set[int]:
    seen: set[int] = set()
    stack = list(starts)
    while stack:
        sid = stack.pop()
        if sid not in seen:
            seen.add(sid)
            stack.extend(neighbours[sid])
    return seen


def _find_cycle(successors: dict[int, list[int]]) -> list[int]:
    """One cycle as a closed walk, e.g. [1, 2, 1]; only called when a cycle exists."""
    state: dict[int, int] = {}  # 1 = on the current path, 2 = done
    path: list[int] = []

    def visit(sid: int) -> list[int] | None:
        state[sid] = 1
        path.append(sid)
        for nxt in sorted(successors[sid]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[sid] = 2
        path.pop()
        return None

    for sid in sorted(successors):
        if sid not in state:
            found = visit(sid)
            if found:
                return found
    raise AssertionError("no cycle found")  # pragma: no cover - callers check first
