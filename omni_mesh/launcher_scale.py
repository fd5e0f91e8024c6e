"""`omni-mesh up` acting on the coordinator's autoscaling: the coordinator decides each stage's target
replicas (omni_mesh.coordinator.scheduling.autoscaler: from the load, or `omni-mesh scale` for a stage without
autoscale:), the launcher reads them from /v1/stages and starts replica processes, or drains and stops them.

A replica asked to go gets SIGTERM, the signal it already drains on: it takes no new work, finishes
what it holds, deregisters and exits; what it leaves is reclaimed by its connector types
(the launcher's `reclaim`) and it is not restarted. The replicas the launcher runs, draining ones included,
never exceed the host cap: autoscaling one stage cannot take every core from the others; nor does a
new one start where the host's memory has no room for it (`launcher_memory`).
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from omni_mesh.launcher_memory import MemoryRoom
from omni_mesh.topology import StageSpec, Topology

if TYPE_CHECKING:
    from omni_mesh.children import Child

log = logging.getLogger("omni_mesh.launcher")

#: How often the launcher reads the targets: a fraction of any sensible upscale delay.
POLL_S = 0.5


def default_host_cap() -> int:
    """The CPUs this process may run on: one busy replica per core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def host_cap(topology: Topology, given: int | None) -> int:
    """The replicas `up` may run in all: `given`, or the CPU count, never below the starting replicas
    (which `up` starts whatever the load); a `given` below them is an error naming both."""
    starting = sum(stage.replicas for stage in topology.stages)
    if given is None:
        return max(default_host_cap(), starting)
    if given < starting:
        raise ValueError(
            f"--max-replicas-total {given} is below the {starting} replicas the topology starts with "
            f"({', '.join(f'{s.name}: {s.replicas}' for s in topology.stages)}); raise it or lower replicas:"
        )
    return given


class Scaler:
    """Brings each stage's replica processes to the coordinator's target."""

    def __init__(
        self,
        topology: Topology,
        replicas: list[Child],
        make_replica: Callable[[StageSpec], Child],
        reclaim: Callable[[int], list[str]],
        *,
        url: str,
        cap: int,
        api_key: str | None,
        verify: ssl.SSLContext | bool,
        min_free_memory: int | None = None,
    ) -> None:
        self.stages = list(topology.stages)  # autoscaled, or set by `omni-mesh scale`
        self.replicas = replicas  # the launcher's list: children are added to it and removed from it
        self.make_replica = make_replica
        self.reclaim = reclaim  # what an exited replica held, looked for where this mesh keeps it
        self.url = url
        self.cap = cap
        self.memory = MemoryRoom(min_free_memory)  # nor past the memory the host has
        # Its own User-Agent: the coordinator's access log leaves these polls out (coordinator/http/access.py).
        headers = {"user-agent": "omni-mesh-autoscale", **({"authorization": f"Bearer {api_key}"} if api_key else {})}
        # A short timeout: a hung coordinator must not hold up the supervision loop (restarts) for long.
        self.client = httpx.Client(timeout=1.0, headers=headers, verify=verify) if self.stages else None
        self.next_poll = 0.0
        self.short_of: dict[str, int] = {}  # stage -> replicas the cap kept it from starting (logged once)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def step(self) -> None:
        """Called by the launcher's supervision loop: reap retired replicas, and every POLL_S read the
        targets and act on them."""
        self._reap_retired()
        if self.client is None or time.monotonic() < self.next_poll:
            return
        self.next_poll = time.monotonic() + POLL_S
        try:
            answer = self.client.get(f"{self.url}/v1/stages").json()
            stages = {entry["name"]: entry for entry in answer["stages"]}
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return  # the coordinator restarts, or is busy: the targets stay as they were
        for stage in self.stages:
            entry = stages.get(stage.name)
            if isinstance(entry, dict) and isinstance(entry.get("target_replicas"), int):
                # A coordinator that just (re)started adopts the replicas it finds: none is stopped meanwhile.
                settling = (entry.get("autoscale") or {}).get("settling", False)
                self._act(stage, entry["target_replicas"], entry.get("replicas") or [], settling)

    def _active(self, stage: StageSpec) -> list[Child]:
        return [c for c in self.replicas if c.stage == stage.name and not c.retiring and not c.given_up]

    def _act(self, stage: StageSpec, target: int, registered: list[dict[str, Any]], settling: bool) -> None:
        active = self._active(stage)
        if len(active) < target and any(c.stage == stage.name and c.given_up for c in self.replicas):
            return  # its replicas crash-loop (the launcher gave up on one, and said why): more would too
        if len(active) < target:
            running = sum(1 for c in self.replicas if not c.given_up)
            room = max(0, self.cap - running)
            fits, memory = self.memory.replicas(stage.name, self.replicas)
            start = min(target - len(active), room, fits)
            for _ in range(start):
                child = self.make_replica(stage)
                self.replicas.append(child)
                child.start()
                log.info("autoscale: started %s (%s: %d -> %d of target %d)", child.name, stage.name,
                         len(active), len(active) + 1, target)
                active.append(child)
            short = target - len(active)
            if short > 0 and self.short_of.get(stage.name) != short:
                why = (f"the host cap of {self.cap} replicas in all is reached (--max-replicas-total)" if fits > room
                       else f"the host's memory has no room for more: {memory}")
                log.warning("autoscale: %s runs %d of its target %d replicas: %s", stage.name, len(active), target, why)
            self.short_of[stage.name] = short
        elif len(active) > target and not settling:
            load = {r.get("id"): int(r.get("inflight") or 0) for r in registered if isinstance(r, dict)}
            # Not yet registered first (they serve nothing), then the least busy, then the newest.
            order = sorted(active, key=lambda c: (c.name in load, load.get(c.name, 0), -c.started_at))
            for child in order[: len(active) - target]:
                self.retire(child, f"{stage.name}: {len(active)} -> {target}")

    def retire(self, child: Child, why: str) -> None:
        child.retiring = True
        if child.running():
            child.process.send_signal(signal.SIGTERM)
        log.info("autoscale: draining %s (%s)", child.name, why)

    def _reap_retired(self) -> None:
        for child in [c for c in self.replicas if c.retiring and not c.running()]:
            self.replicas.remove(child)
            reaped = self.reclaim(child.process.pid) if child.process else []
            log.info("autoscale: %s %s%s", child.name, "drained and stopped" if child.process and
                     child.process.returncode == 0 else child.describe_exit(),
                     f", reclaimed {len(reaped)} connector resource(s)" if reaped else "")
