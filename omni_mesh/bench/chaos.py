"""`omni-mesh bench chaos`: a soak that injects faults into a mesh under checked load.

It starts a chain topology with `omni-mesh up` (by default 3 stages x 2 replicas of
`chaos_handlers.step`, shared memory between them), drives N clients whose every answer is checked
(the affine chain of `chaos_handlers` proves each stage ran once, in order, on that request's data),
and mixes in faults at random times (`chaos_faults`): replica SIGKILLs (the launcher restarts them;
only while the stage has another healthy replica: the soak tests recovery and correctness, not an
outage), coordinator pauses and replica stops (SIGSTOP/SIGCONT) and connection drops (TCP resets of a replica's
sockets). Each failed request is put down to the fault that explains it, if any. At the end it stops
the mesh with SIGINT and looks in /dev/shm for segments of any process the mesh ran.

Invariants (a broken one makes the exit status non-zero): no wrong output, no answer later than
the request's deadline + 1 s (hung), no segment and no process left behind, the launcher stops cleanly, and no request
failed without a fault that legitimately fails it (`chaos_faults.LEGITIMATE_CAUSES`), unless the run
tolerates pause and drop failures (`tolerate`: until the coordinator rides out those faults).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from omni_mesh import aio
from omni_mesh.bench import chaos_faults
from omni_mesh.bench.chaos_faults import FaultLog
from omni_mesh.bench.chaos_report import LATE_MARGIN_S, broken, report
from omni_mesh.bench.http_client import Connection
from omni_mesh.bench.mesh import running_mesh
from omni_mesh.bench.pipeline import percentile
from omni_mesh.connectors import held_by, mesh_places
from omni_mesh.coordinator.scheduling.registry import HEARTBEAT_TIMEOUT_S
from omni_mesh.procinfo import children_of
from omni_mesh.topology import Topology, load_topology

__all__ = ["broken", "expected_output", "leftover_segments", "report", "run"]

HANDLER = "omni_mesh.bench.chaos_handlers:step"
SIZES = (16, 4096)  # float64 elements: 128 B rides inline in the metadata, 32 KiB goes through the pool


EDGES = {  # --edges: the connector of each edge of the default chain (first->second, second->third)
    "shm": ("shm", "shm"),
    "zmq": ("zmq", "zmq"),
    "mixed": ("shm", "zmq"),  # segments to leak on one edge, data-plane TCP connections to drop on the other
}


def default_topology(directory: Path, replicas: int = 2, edges: str = "shm") -> Path:
    """A 3-stage chain of HANDLER, `replicas` each, its edges' connectors as EDGES[edges] says:
    shared memory with small pools, or ZeroMQ (TCP on loopback)."""
    names = ("first", "second", "third")
    stages = []
    for i, name in enumerate(names):
        stage: dict[str, Any] = {"stage_id": i, "name": name, "handler": HANDLER, "replicas": replicas, "max_inflight": 8}
        if i:
            stage.update(engine_input_source=[i - 1], input_connectors={f"from_stage_{i - 1}": EDGES[edges][i - 1]})
        if i < len(names) - 1:
            stage["output_connectors"] = {f"to_stage_{i + 1}": EDGES[edges][i]}
        stages.append(stage)
    topology = {
        "name": "chaos-chain",
        "connectors": {
            "shm": {"name": "SharedMemoryConnector", "extra": {"memory_pool_size": 32 * 1024 * 1024}},
            "zmq": {"name": "ZmqConnector", "extra": {"host": "127.0.0.1"}},
        },
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


@contextlib.contextmanager
def segment_dir() -> Iterator[None]:
    """Where the mesh keeps its segments, named in this process's environment for the block, so the
    leftover check looks there: the one already named, else a private one of the bench's own (left
    to itself, `up` would make one and remove it, with any leak in it, as it stops)."""
    env = dict(os.environ)
    places = mesh_places("chaos-soak", env)
    if not places.own:
        yield
        return
    places.create()
    named = {key: value for key, value in env.items() if os.environ.get(key) != value}
    os.environ.update(named)
    try:
        yield
    finally:
        for key in named:
            del os.environ[key]
        places.remove()  # after the check: what is left was counted


def leftover_segments(pids: set[int]) -> list[str]:
    """What any of `pids` holds in a connector beyond its own memory (shared-memory segments)."""
    return held_by(pids)


# ---------------------------------------------------------------------- load and faults


@dataclass
class Failure:
    began: float  # time.monotonic()
    ended: float
    status: str  # the HTTP status, or the exception's name when no answer came
    stage: str | None  # the stage the error envelope names
    reason: str


@dataclass
class Tally:
    sent: int = 0
    succeeded: int = 0
    failures: list[Failure] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    late: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


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
            ended = time.monotonic()
            tally.latencies.append(ended - began)
            if ended - began > timeout_s + LATE_MARGIN_S:
                tally.late.append(ended - began)
            if outcome != "200":
                tally.failures.append(Failure(began, ended, outcome, *_envelope(raw)))
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


def _envelope(raw: bytes) -> tuple[str | None, str]:
    """(stage, error) of an error envelope; (None, the start of the body) when it is not one."""
    with contextlib.suppress(ValueError, AttributeError):
        body = json.loads(raw)
        return body.get("stage"), str(body.get("error", ""))[:200]
    return None, raw[:200].decode(errors="replace")


async def _soak(url: str, plan: dict[str, Any], launcher_pid: int, rng: random.Random, tally: Tally,
                faults: FaultLog) -> float:
    began = faults.started = time.monotonic()
    stop_at = began + plan["duration_s"]
    clients = [_client(url, i, plan["concurrency"], plan, stop_at, tally) for i in range(plan["concurrency"])]
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as http:
        injectors = {
            "kill": lambda: chaos_faults.kill(http, launcher_pid, rng, faults),
            "pause": lambda: chaos_faults.pause(launcher_pid, plan["pause_s"], faults),
            "stop": lambda: chaos_faults.stop(http, launcher_pid, plan["pause_s"], rng, faults),
            "drop": lambda: chaos_faults.drop(http, launcher_pid, rng, faults),
        }
        loops = [chaos_faults.every(plan[f"{kind}_every_s"], rng, stop_at, inject)
                 for kind, inject in injectors.items() if plan[f"{kind}_every_s"]]
        await asyncio.gather(*loops, *clients)
    return time.monotonic() - began


# ---------------------------------------------------------------------- run


def run(
    *,
    topology: str | None,
    duration_s: float,
    concurrency: int,
    timeout_s: float,
    kill_every_s: float = 0.0,
    pause_every_s: float = 0.0,
    pause_s: float = 2.0,
    drop_every_s: float = 0.0,
    stop_every_s: float = 0.0,
    tolerate: tuple[str, ...] = (),
    seed: int | None = None,
    replicas: int = 2,
    edges: str = "shm",
    work_s: float = 0.02,
) -> dict[str, Any]:
    """Soak the mesh; a fault kind whose every_s is 0 is not injected. ValueError on a bad plan,
    RuntimeError when drops are asked for and this machine cannot make them."""
    if (pause_every_s or stop_every_s) and not 0 < pause_s < timeout_s:
        raise ValueError(f"--pause-s {pause_s:g}: a pause must be > 0 and shorter than --timeout-s {timeout_s:g}, "
                         "or requests sent during it could not be answered in time")
    if unknown := set(tolerate) - {"pause", "drop"}:
        raise ValueError(f"--tolerate {','.join(sorted(unknown))}: only pause and drop failures can be tolerated")
    if edges not in EDGES:
        raise ValueError(f"--edges {edges}: one of {', '.join(EDGES)}")
    if topology and edges != "shm":
        raise ValueError("--edges picks the connectors of the default topology: it needs no --topology")
    if drop_every_s:
        chaos_faults.check_drops_work()
    seed = random.randrange(2**32) if seed is None else seed
    with tempfile.TemporaryDirectory(prefix="omni-mesh-chaos-") as directory, segment_dir():
        path = Path(topology) if topology else default_topology(Path(directory), replicas, edges)
        loaded = load_topology(path)
        chain = chain_of(loaded)
        plan = {
            "topology": str(topology or f"{loaded.name} ({edges} edges)"), "chain": chain, "k": {name: i + 1 for i, name in enumerate(chain)},
            "replicas": {s.name: s.replicas for s in loaded.stages}, "duration_s": duration_s,
            "concurrency": concurrency, "kill_every_s": kill_every_s, "pause_every_s": pause_every_s,
            "pause_s": pause_s, "drop_every_s": drop_every_s, "stop_every_s": stop_every_s, "tolerate": sorted(tolerate), "timeout_s": timeout_s,
            "work_s": work_s, "seed": seed,
        }
        tally, faults = Tally(), FaultLog(drop_aftermath_s=max(timeout_s, HEARTBEAT_TIMEOUT_S + 1.0))
        with running_mesh(path, insecure=None) as mesh:
            watch = ProcessWatch(mesh.process.pid)
            try:
                elapsed = aio.run(_soak(mesh.url, plan, mesh.process.pid, random.Random(seed), tally, faults))
            finally:
                watch.seen |= children_of(mesh.process.pid)
        watch.stop()  # after the launcher has stopped: it saw the replicas it started while stopping
        mesh_pids = watch.seen | {mesh.process.pid}
        leftovers = leftover_segments(mesh_pids)
        left_running = chaos_faults.alive(mesh_pids)
    causes = [faults.cause_of(f.began, f.ended, f.status, f.reason) for f in tally.failures]
    examples: dict[str, str] = {}
    failure_log = []
    for failure, cause in zip(tally.failures, causes, strict=True):
        examples.setdefault(f"{cause}: {failure.status}", f"{failure.stage}: {failure.reason}")
        failure_log.append({"at_s": round(failure.began - faults.started, 2), "took_s": round(failure.ended - failure.began, 2),
                            "status": failure.status, "stage": failure.stage, "cause": cause})
    return {
        **plan,
        "elapsed_s": elapsed,
        "sent": tally.sent,
        "succeeded": tally.succeeded,
        "failed": dict(Counter(f.status for f in tally.failures)),
        "failed_by_cause": dict(Counter(causes)),
        "failure_examples": examples,
        "failure_log": failure_log[:200],
        "wrong": len(tally.wrong),
        "wrong_examples": tally.wrong[:5],
        "late": len(tally.late),
        "late_s": sorted(tally.late, reverse=True)[:5],
        "p50_s": percentile(tally.latencies, 0.50),
        "p99_s": percentile(tally.latencies, 0.99),
        "max_s": max(tally.latencies, default=float("nan")),
        "faults": dict(Counter(f.kind for f in faults.faults)),
        "faults_by_target": dict(Counter(f"{f.kind} {f.target}" for f in faults.faults)),
        "faults_skipped": faults.skipped,
        "fault_log": faults.as_list(),
        "mesh_processes": len(mesh_pids),
        "most_segments_held": watch.most_segments,
        "leftover_segments": leftovers,
        "leftover_processes": left_running,
        "launcher_exit_status": mesh.exit_status,
    }
