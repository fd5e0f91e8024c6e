"""`omni-mesh bench chaos`: a soak that SIGKILLs stage replicas under checked load.

It starts a chain topology with `omni-mesh up` (by default 3 stages x 2 replicas of
`chaos_handlers.step`, shared memory between them), drives N clients whose every answer is checked
(the affine chain of `chaos_handlers` proves each stage ran once, in order, on that request's data),
and every few seconds SIGKILLs a random replica, which the launcher restarts. A replica is killed
only while its stage has another healthy one: the soak tests recovery and correctness, not an
outage. At the end it stops the mesh with SIGINT and looks in /dev/shm for segments of any process
the mesh ran.

Invariants (a broken one makes the exit status non-zero): no wrong output, no answer later than
the request's deadline + 1 s, no segment left behind, the launcher stops cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from omni_mesh import aio
from omni_mesh.bench.http_client import Connection
from omni_mesh.bench.mesh import running_mesh
from omni_mesh.bench.pipeline import percentile
from omni_mesh.connectors import held_by
from omni_mesh.procinfo import children_of
from omni_mesh.topology import Topology, load_topology

HANDLER = "omni_mesh.bench.chaos_handlers:step"
SIZES = (16, 4096)  # float64 elements: 128 B rides inline in the metadata, 32 KiB goes through the pool
LATE_MARGIN_S = 1.0


def default_topology(directory: Path, replicas: int = 2) -> Path:
    """A 3-stage chain of HANDLER, `replicas` each, small shared-memory pools."""
    names = ("first", "second", "third")
    stages = []
    for i, name in enumerate(names):
        stage: dict[str, Any] = {"stage_id": i, "name": name, "handler": HANDLER, "replicas": replicas, "max_inflight": 8}
        if i:
            stage.update(engine_input_source=[i - 1], input_connectors={f"from_stage_{i - 1}": "shm"})
        if i < len(names) - 1:
            stage["output_connectors"] = {f"to_stage_{i + 1}": "shm"}
        stages.append(stage)
    topology = {
        "name": "chaos-chain",
        "connectors": {"shm": {"name": "SharedMemoryConnector", "extra": {"memory_pool_size": 32 * 1024 * 1024}}},
        "stages": stages,
    }
    path = directory / "chaos-chain.yaml"
    path.write_text(yaml.safe_dump(topology, sort_keys=False))
    return path


def chain_of(topology: Topology) -> list[str]:
    """The stage names in order; ValueError unless the topology is a chain of HANDLER stages."""
    for stage in topology.stages:
        if stage.handler != HANDLER:
            raise ValueError(f"stage {stage.stage_id} {stage.name!r}: the chaos soak checks outputs of {HANDLER}, "
                             f"not of {stage.handler}")
        if len(topology.inputs_of(stage.stage_id)) > 1 or len(topology.outputs_of(stage.stage_id)) > 1:
            raise ValueError(f"stage {stage.stage_id} {stage.name!r}: the chaos soak needs a chain (no fan-in or fan-out)")
    return [stage.name for stage in topology.stages]


def expected_output(start: int, n: int, chain: list[str], k: dict[str, int]) -> dict[str, Any]:
    """What the chain answers for `s + arange(n)`: every map x -> 2x + k composed, in order."""
    scale, offset = 1, 0
    for name in chain:
        scale, offset = 2 * scale, 2 * offset + k[name]
    values = [scale * (start + j) + offset for j in range(n)]
    return {"trail": chain, "n": n, "head": [float(v) for v in values[:3]], "tail": [float(v) for v in values[-2:]],
            "sum": float(sum(values))}


# ---------------------------------------------------------------------- the mesh's processes


class ProcessWatch:
    """Every pid the launcher has had as a child, seen by polling /proc in a thread: replicas come
    and go, and the leftover check must know all of them, not only those alive at the end. It also
    keeps the most segments those processes held at once, which shows the check is not vacuous."""

    def __init__(self, launcher_pid: int, interval_s: float = 0.25) -> None:
        self.launcher_pid = launcher_pid
        self.seen: set[int] = set()
        self.most_segments = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(interval_s,), daemon=True)
        self._thread.start()

    def _poll(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.seen |= children_of(self.launcher_pid)
            self.most_segments = max(self.most_segments, len(leftover_segments(self.seen)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def leftover_segments(pids: set[int]) -> list[str]:
    """What any of `pids` holds in a connector beyond its own memory (shared-memory segments)."""
    return held_by(pids)


# ---------------------------------------------------------------------- load and kills


@dataclass
class Tally:
    sent: int = 0
    succeeded: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    failure_examples: dict[str, str] = field(default_factory=dict)
    wrong: list[str] = field(default_factory=list)
    late: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    kills_skipped: int = 0


async def _client(url: str, first: int, stride: int, plan: dict[str, Any], stop_at: float, tally: Tally) -> None:
    """One client: requests one after the other until stop_at, every answer checked."""
    connection = Connection(url)
    timeout_s = plan["timeout_s"]
    params = {"k": plan["k"], "last": plan["chain"][-1], "work_s": plan["work_s"]}
    seq = first
    try:
        while time.monotonic() < stop_at:
            start, n = seq * 10, SIZES[seq % len(SIZES)]
            seq += stride
            body = json.dumps({"inputs": {"start": start, "n": n}, "params": params, "timeout_s": timeout_s}).encode()
            tally.sent += 1
            began = time.monotonic()
            try:
                status, headers, raw = await asyncio.wait_for(
                    connection.post("/v1/requests", body), timeout_s + LATE_MARGIN_S + 5
                )
                outcome = str(status)
            except (OSError, ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
                outcome, headers, raw = type(exc).__name__, {}, b""
                connection.close()
            took = time.monotonic() - began
            tally.latencies.append(took)
            if took > timeout_s + LATE_MARGIN_S:
                tally.late.append(took)
            if outcome != "200":
                tally.failed[outcome] += 1
                tally.failure_examples.setdefault(outcome, _reason(raw))
                if outcome == "429":  # the queue is full: back off as told
                    await asyncio.sleep(min(1.0, float(headers.get("retry-after", "1"))))
                continue
            got = json.loads(raw).get("outputs")
            want = expected_output(start, n, plan["chain"], plan["k"])
            if got == want:
                tally.succeeded += 1
            else:
                tally.wrong.append(f"start={start} n={n}: got {str(got)[:200]}, want {str(want)[:200]}")
    finally:
        connection.close()


def _reason(raw: bytes) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        return str(json.loads(raw).get("error", ""))[:200]
    return raw[:200].decode(errors="replace")


async def _killer(url: str, watch: ProcessWatch, every_s: float, rng: random.Random, stop_at: float, tally: Tally) -> None:
    """Every ~every_s (jittered 0.5-1.5x), SIGKILL a random healthy replica of a stage that has
    another healthy one. Only the launcher's own children are ever signalled."""
    began = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
        while time.monotonic() + (wait := every_s * rng.uniform(0.5, 1.5)) < stop_at:
            await asyncio.sleep(wait)
            try:
                stages = (await client.get("/v1/stages")).json()["stages"]
            except (httpx.HTTPError, ValueError, KeyError):
                tally.kills_skipped += 1
                continue
            ours = children_of(watch.launcher_pid)
            candidates = [
                (stage["name"], replica)
                for stage in stages
                if len(healthy := [r for r in stage["replicas"] if r["health"] == "healthy" and r["pid"] in ours]) >= 2
                for replica in healthy
            ]
            if not candidates:
                tally.kills_skipped += 1
                continue
            stage, replica = rng.choice(candidates)
            with contextlib.suppress(ProcessLookupError):
                os.kill(replica["pid"], signal.SIGKILL)
                tally.kills.append({"at_s": round(time.monotonic() - began, 1), "stage": stage,
                                    "replica": replica["id"], "pid": replica["pid"]})


async def _soak(url: str, plan: dict[str, Any], watch: ProcessWatch, rng: random.Random, tally: Tally) -> float:
    began = time.monotonic()
    stop_at = began + plan["duration_s"]
    clients = [_client(url, i, plan["concurrency"], plan, stop_at, tally) for i in range(plan["concurrency"])]
    await asyncio.gather(_killer(url, watch, plan["kill_every_s"], rng, stop_at, tally), *clients)
    return time.monotonic() - began


# ---------------------------------------------------------------------- run and report


def run(
    *,
    topology: str | None,
    duration_s: float,
    concurrency: int,
    kill_every_s: float,
    timeout_s: float,
    seed: int | None = None,
    replicas: int = 2,
    work_s: float = 0.02,
) -> dict[str, Any]:
    seed = random.randrange(2**32) if seed is None else seed
    with tempfile.TemporaryDirectory(prefix="omni-mesh-chaos-") as directory:
        path = Path(topology) if topology else default_topology(Path(directory), replicas)
        loaded = load_topology(path)
        chain = chain_of(loaded)
        plan = {
            "topology": str(topology or loaded.name), "chain": chain, "k": {name: i + 1 for i, name in enumerate(chain)},
            "replicas": {s.name: s.replicas for s in loaded.stages}, "duration_s": duration_s,
            "concurrency": concurrency, "kill_every_s": kill_every_s, "timeout_s": timeout_s, "work_s": work_s,
            "seed": seed,
        }
        tally = Tally()
        with running_mesh(path, insecure=None) as mesh:
            watch = ProcessWatch(mesh.process.pid)
            try:
                elapsed = aio.run(_soak(mesh.url, plan, watch, random.Random(seed), tally))
            finally:
                watch.seen |= children_of(mesh.process.pid)
        watch.stop()  # after the launcher has stopped: it saw the replicas it started while stopping
        mesh_pids = watch.seen | {mesh.process.pid}
        leftovers = leftover_segments(mesh_pids)
    return {
        **plan,
        "elapsed_s": elapsed,
        "sent": tally.sent,
        "succeeded": tally.succeeded,
        "failed": dict(tally.failed),
        "failure_examples": tally.failure_examples,
        "wrong": len(tally.wrong),
        "wrong_examples": tally.wrong[:5],
        "late": len(tally.late),
        "late_s": sorted(tally.late, reverse=True)[:5],
        "p50_s": percentile(tally.latencies, 0.50),
        "p99_s": percentile(tally.latencies, 0.99),
        "max_s": max(tally.latencies, default=float("nan")),
        "kills": len(tally.kills),
        "kills_by_stage": dict(Counter(k["stage"] for k in tally.kills)),
        "kills_skipped": tally.kills_skipped,
        "kill_log": tally.kills,
        "mesh_processes": len(mesh_pids),
        "most_segments_held": watch.most_segments,
        "leftover_segments": leftovers,
        "launcher_exit_status": mesh.exit_status,
    }


def broken(result: dict[str, Any]) -> list[str]:
    """The invariants the result breaks (empty: all hold)."""
    problems = []
    if result["wrong"]:
        problems.append(f"{result['wrong']} wrong output(s)")
    if result["late"]:
        problems.append(f"{result['late']} answer(s) later than the deadline + {LATE_MARGIN_S:g} s")
    if result["leftover_segments"]:
        problems.append(f"{len(result['leftover_segments'])} shared-memory segment(s) left in /dev/shm")
    if result["launcher_exit_status"] != 0:
        problems.append(f"omni-mesh up exited with status {result['launcher_exit_status']} on SIGINT")
    return problems


def report(result: dict[str, Any]) -> str:
    sent = result["sent"]
    failed = sum(result["failed"].values())
    shape = ", ".join(f"{name} x{n}" for name, n in result["replicas"].items())
    lines = [
        f"chaos soak of {result['topology']} ({shape}): {result['concurrency']} clients for "
        f"{result['elapsed_s']:.0f} s, timeout_s {result['timeout_s']:g}, a SIGKILL every ~{result['kill_every_s']:g} s "
        f"(seed {result['seed']})",
        f"  sent               {sent}   ({sent / result['elapsed_s']:.1f} req/s; latency p50 {result['p50_s'] * 1e3:.0f} ms, "
        f"p99 {result['p99_s'] * 1e3:.0f} ms, max {result['max_s']:.2f} s)",
        f"  succeeded          {result['succeeded']}   ({100 * result['succeeded'] / sent if sent else 0:.2f}%)",
        f"  failed             {failed}" + ("   by status: " + ", ".join(
            f"{status}: {n}" for status, n in sorted(result["failed"].items())) if failed else ""),
    ]
    lines += [f"      {status}: e.g. {reason}" for status, reason in sorted(result["failure_examples"].items())]
    lines += [
        f"  wrong outputs      {result['wrong']}",
        *(f"      {example}" for example in result["wrong_examples"]),
        f"  late (> deadline + {LATE_MARGIN_S:g} s) {result['late']}"
        + (f"   slowest: {', '.join(f'{s:.2f} s' for s in result['late_s'])}" if result["late"] else ""),
        f"  kills              {result['kills']}   ("
        + ", ".join(f"{stage}: {n}" for stage, n in sorted(result["kills_by_stage"].items()))
        + f"; {result['kills_skipped']} times none was eligible: no stage had two healthy replicas)",
        f"  leftover segments  {len(result['leftover_segments'])}   ({result['mesh_processes']} mesh processes held up to "
        f"{result['most_segments_held']} at once)",
        *(f"      {name}" for name in result["leftover_segments"][:10]),
        f"  launcher exit      {result['launcher_exit_status']}",
    ]
    problems = broken(result)
    lines.append("BROKEN: " + "; ".join(problems) if problems else "OK: every invariant holds")
    return "\n".join(lines)
