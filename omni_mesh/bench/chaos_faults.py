"""The faults `omni-mesh bench chaos` injects into a running mesh, and which failures each explains.

Four kinds, each its own loop firing every ~N s (jittered 0.5-1.5x), all at once:

- **kill**: SIGKILL a healthy replica of a stage that has another healthy one (the launcher
  restarts it). Legitimately fails, with 502, the requests whose work the replica held after it had
  sent something downstream (docs/architecture.md, "Failure handling"): nothing can redo that work;
  and, with 502 naming the edge, those whose payload it had put but not yet served (its segments went with it)
  or had already taken from a ZmqConnector edge (served once: its retry finds it gone).
- **pause**: SIGSTOP the coordinator for `pause_s`, then SIGCONT. Legitimately fails nothing: the
  replicas' heartbeats wait in the socket, and a pause shorter than the requests' deadline leaves
  them time. A pause longer than the heartbeat timeout must evict nobody; until the coordinator
  holds that ("liveness"), failures it causes are reported, not excused.
- **stop**: SIGSTOP a healthy replica for `pause_s`, then SIGCONT: a replica that hangs a while
  (swapping, a debugger). Shorter than the heartbeat timeout, it is not taken out; its requests wait
  for it within their deadline. Legitimately fails nothing.
- **drop**: reset every established TCP connection of a replica (its control-plane DEALER and any
  data-plane socket), both ends, with `ss -K` (needs CAP_NET_ADMIN and a kernel with
  CONFIG_INET_DIAG_DESTROY). ZeroMQ reconnects; legitimately fails nothing.

Only the launcher's own children are ever signalled or cut. Putting a failure down to a fault is
by time (was the request in flight then?), so overlapping faults share the blame: `cause_of` picks
the most specific.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from omni_mesh.coordinator.scheduling.registry import HEARTBEAT_TIMEOUT_S
from omni_mesh.procinfo import children_of

KINDS = ("kill", "pause", "stop", "drop")
PAUSE_AFTERMATH_S = 1.0  # the coordinator catches up on what queued while it was stopped


@dataclass
class Fault:
    kind: str
    began: float  # time.monotonic()
    ended: float
    target: str  # a stage name, or "coordinator"
    detail: dict[str, Any] = field(default_factory=dict)

    def explains(self, began: float, ended: float, drop_aftermath_s: float) -> bool:
        """Whether a request in flight over [began, ended] may have failed because of this fault, at
        any stage (a killed or dropped producer fails its consumers too; the log knows no graph). A
        kill explains the requests in flight at its moment, a pause those in flight during it. A
        drop's effects last longer: a dropped replica may be sent work until the coordinator notices
        its silence, and a message lost in a reset connection leaves its request waiting up to its
        deadline: a drop explains requests in flight within `drop_aftermath_s` after it."""
        aftermath = {"kill": 0.0, "pause": PAUSE_AFTERMATH_S, "stop": PAUSE_AFTERMATH_S, "drop": drop_aftermath_s}[self.kind]
        return began <= self.ended + aftermath and ended >= self.began


@dataclass
class FaultLog:
    # The requests' deadline, or the heartbeat timeout if longer (Fault.explains).
    drop_aftermath_s: float = HEARTBEAT_TIMEOUT_S + 1.0
    started: float = field(default_factory=time.monotonic)
    faults: list[Fault] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # "kind: why" -> times a fault could not be made

    def add(self, kind: str, began: float, target: str, **detail: Any) -> None:
        self.faults.append(Fault(kind, began, time.monotonic(), target, detail))

    def cause_of(self, began: float, ended: float, status: str, reason: str) -> str:
        """Why a request failed: "backpressure" (429: a full queue, no fault), "kill" (a 502 naming a
        replica that died while the request was in flight: the work it held had gone downstream), "kill, payload gone" (a 502 reading a
        payload whose maker was killed: its segments went with it), both legitimate; or "drop",
        "pause" (faults that should fail nothing), "kill, other", or "none" (no fault explains it)."""
        if status == "429":
            return "backpressure"
        kinds = {f.kind for f in self.faults if f.explains(began, ended, self.drop_aftermath_s)}
        if "kill" in kinds and status == "502" and " died " in reason:  # the coordinator saw the pid gone
            return "kill"
        if "kill" in kinds and status == "502" and " on edge " in reason:  # a stage's input: `StageInputError`
            return "kill, payload gone"
        for kind in ("drop", "pause", "stop"):  # a drop's aftermath outlasts a short pause: the likelier cause
            if kind in kinds:
                return kind
        return "kill, other" if "kill" in kinds else "none"

    def as_list(self) -> list[dict[str, Any]]:
        return [
            {"kind": f.kind, "at_s": round(f.began - self.started, 1), "lasted_s": round(f.ended - f.began, 2),
             "target": f.target, **f.detail}
            for f in self.faults
        ]


LEGITIMATE_CAUSES = ("backpressure", "kill", "kill, payload gone")


# ---------------------------------------------------------------------- the injectors


async def every(every_s: float, rng: random.Random, stop_at: float, inject: Callable[[], Awaitable[None]]) -> None:
    """Call `inject` every ~every_s (jittered 0.5-1.5x) until stop_at."""
    while time.monotonic() + (wait := every_s * rng.uniform(0.5, 1.5)) < stop_at:
        await asyncio.sleep(wait)
        await inject()


async def healthy_replicas(client: httpx.AsyncClient, launcher_pid: int) -> dict[str, list[dict[str, Any]]] | None:
    """{stage: [healthy replicas the launcher runs]} from /v1/stages; None when it does not answer."""
    try:
        stages = (await client.get("/v1/stages")).json()["stages"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    ours = children_of(launcher_pid)
    return {
        stage["name"]: [r for r in stage["replicas"] if r["health"] == "healthy" and r["pid"] in ours]
        for stage in stages
    }


async def kill(client: httpx.AsyncClient, launcher_pid: int, rng: random.Random, log: FaultLog) -> None:
    """SIGKILL a random healthy replica of a stage that has another healthy one."""
    stages = await healthy_replicas(client, launcher_pid)
    candidates = [(name, r) for name, healthy in (stages or {}).items() if len(healthy) >= 2 for r in healthy]
    if not candidates:
        log.skipped["kill: /v1/stages did not answer" if stages is None else "kill: no stage had 2 healthy replicas"] += 1
        return
    stage, replica = rng.choice(candidates)
    began = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        os.kill(replica["pid"], signal.SIGKILL)
        log.add("kill", began, stage, replica=replica["id"], pid=replica["pid"])


def coordinator_pid(launcher_pid: int) -> int:
    """The launcher's child that runs `omni-mesh coordinator`."""
    for pid in children_of(launcher_pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"coordinator" in argv:
                return pid
    raise LookupError(f"omni-mesh up (pid {launcher_pid}) runs no coordinator process")


async def pause(launcher_pid: int, pause_s: float, log: FaultLog) -> None:
    """SIGSTOP the coordinator for pause_s; SIGCONT it whatever happens meanwhile."""
    try:
        pid = coordinator_pid(launcher_pid)
    except LookupError:
        log.skipped["pause: no coordinator process"] += 1
        return
    began = time.monotonic()
    try:
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(pause_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    log.add("pause", began, "coordinator", pid=pid)


async def any_replica(
    client: httpx.AsyncClient, launcher_pid: int, rng: random.Random, log: FaultLog, kind: str
) -> tuple[str, dict[str, Any]] | None:
    """(stage, replica) of a random healthy replica the launcher runs; None, noted as skipped, if none."""
    stages = await healthy_replicas(client, launcher_pid)
    candidates = [(name, r) for name, healthy in (stages or {}).items() for r in healthy]
    if not candidates:
        log.skipped[f"{kind}: /v1/stages did not answer" if stages is None else f"{kind}: no healthy replica"] += 1
        return None
    return rng.choice(candidates)


async def stop(client: httpx.AsyncClient, launcher_pid: int, pause_s: float, rng: random.Random, log: FaultLog) -> None:
    """SIGSTOP a random healthy replica for pause_s; SIGCONT it whatever happens meanwhile."""
    if (picked := await any_replica(client, launcher_pid, rng, log, "stop")) is None:
        return
    stage, replica = picked
    began = time.monotonic()
    try:
        os.kill(replica["pid"], signal.SIGSTOP)
        await asyncio.sleep(pause_s)
    except ProcessLookupError:
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(replica["pid"], signal.SIGCONT)
    log.add("stop", began, stage, replica=replica["id"], pid=replica["pid"])


def alive(pids: set[int]) -> list[int]:
    """Those of `pids` that still run (not zombies: a zombie holds nothing but its pid)."""
    left = []
    for pid in sorted(pids):
        with contextlib.suppress(OSError, IndexError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                left.append(pid)
    return left


def tcp_ports(pid: int) -> set[tuple[int, int]]:
    """(local port, remote port) of each established TCP connection (IPv4 and IPv6) process `pid` holds."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if (target := os.readlink(fd.path)).startswith("socket:["):
                    inodes.add(target[8:-1])
    pairs = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "01" and cols[9] in inodes:  # 01: ESTABLISHED
                    pairs.add((int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16)))
    return pairs


def reset_connections(pairs: set[tuple[int, int]]) -> int:
    """Reset the TCP connections between each (local port, remote port) of `pairs`, both ends (`ss -K`
    destroys one, which sends the other a RST); how many it reset. Both ports are matched: a port alone
    may also be another process's (an ephemeral port is reused towards other destinations: the soak's
    own clients). RuntimeError naming why when `ss` cannot."""
    if not pairs:
        return 0
    match = " or ".join(
        f"( sport = :{a} and dport = :{b} ) or ( sport = :{b} and dport = :{a} )" for a, b in sorted(pairs)
    )
    try:
        done = subprocess.run(["ss", "-K", "-t", "-n", "-H", "state", "established", f"( {match} )"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"connection drops: `ss -K` could not run: {exc}") from None
    if done.returncode != 0:
        raise RuntimeError(f"connection drops: `ss -K` failed (needs root and CONFIG_INET_DIAG_DESTROY): "
                           f"{done.stderr.strip()[:200]}")
    return len(done.stdout.splitlines())


async def drop(client: httpx.AsyncClient, launcher_pid: int, rng: random.Random, log: FaultLog) -> None:
    """Reset every TCP connection of a random healthy replica."""
    if (picked := await any_replica(client, launcher_pid, rng, log, "drop")) is None:
        return
    stage, replica = picked
    began = time.monotonic()
    ports = tcp_ports(replica["pid"])
    destroyed = await asyncio.to_thread(reset_connections, ports)
    if not destroyed:
        log.skipped[f"drop: replica {replica['id']} had no established TCP connection"] += 1
        return
    log.add("drop", began, stage, replica=replica["id"], pid=replica["pid"], connections=destroyed)


def check_drops_work() -> None:
    """RuntimeError naming why unless this machine can reset a connection: it resets a throwaway
    loopback one and checks that its peer sees the reset."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            accepted, _ = server.accept()
            with accepted:
                reset_connections({(client.getsockname()[1], port)})
                try:
                    client.send(b"x")  # a destroyed socket refuses
                    reset = False
                except OSError:
                    reset = True
    if not reset:
        raise RuntimeError("connection drops: `ss -K` destroyed nothing (it needs root, or CAP_NET_ADMIN, "
                           "and a kernel with CONFIG_INET_DIAG_DESTROY)")
