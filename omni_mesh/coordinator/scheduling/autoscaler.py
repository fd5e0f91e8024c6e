"""Each autoscaled stage's target replicas, from what the coordinator measures: the coordinator decides,
whoever runs the processes (`omni-mesh up`'s launcher, reading /v1/stages) acts.

A stage's load is its ongoing requests: in flight on its replicas plus queued for one (and large
inputs still arriving). It wants ceil(ongoing / target_ongoing_requests) replicas, within min and max.
The target follows only once the stage has wanted more for `upscale_delay_s`, or fewer for
`downscale_delay_s`, so one burst or one lull moves nothing; a stage at zero replicas with work
waiting gets one at once (a cold start, timed and logged). The host cap (OMNI_MESH_HOST_REPLICA_CAP,
set by `up`) bounds the sum of every stage's target; a stage it holds back says so.

A load that oscillates around what N replicas carry, slower than the delays, would take the stage
down and up again each period, a process start and a drain every time: a stage that goes back up
within a flap window (twice its upscale delay plus its downscale delay) of going down has flapped, and its
downscale delay doubles (up to FLAP_CAP times the configured one); once a move down holds for the
window, it is the configured one again.

`omni-mesh scale STAGE N` (POST /v1/stages/{name}/replicas) sets the target of a stage without
`autoscale:` the same way: `up`'s launcher starts or drains replicas to it. An autoscaled stage is
refused (409): its target follows the load, within its `autoscale:` bounds, and a count set by hand
would be undone at the next decision.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omni_mesh.defaults import HOST_CAP_ENV
from omni_mesh.topology import StageSpec, Topology

if TYPE_CHECKING:
    from omni_mesh.coordinator.scheduling.dispatch import Dispatcher
    from omni_mesh.coordinator.scheduling.registry import Registry
    from omni_mesh.topology.autoscale import AutoscaleSpec

log = logging.getLogger("omni_mesh.autoscaler")

#: How often targets are recomputed: often enough that a delay of 1 s means about 1 s.
TICK_S = 0.25
#: A coordinator that (re)starts finds replicas already running, registering again within seconds:
#: for this long it adopts them (the target is never below the replicas registered), and says it is
#: settling, so `up` stops none of them because a fresh coordinator only knows the starting count.
SETTLE_S = 10.0
#: A flapping stage's downscale delay doubles up to this many times the configured one (at least
#: FLAP_FLOOR_S, so that a delay of 0 grows too).
FLAP_CAP = 8
#: A stage that goes back up within this many times its upscale plus downscale delay of going down
#: has flapped: a square wave of half-period H comes back H + up - down after the move down.
FLAP_WINDOW = 2
FLAP_FLOOR_S = 1.0


class ScaleRefused(ValueError):
    """A replica count `omni-mesh scale` asked for that cannot be: `status` is the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class StageScaling:
    """One autoscaled stage's state: the target, and since when the load asked for another."""

    stage: StageSpec
    spec: AutoscaleSpec
    target: int
    wanted: int
    ongoing: int = 0
    history: deque[tuple[float, int]] = field(default_factory=deque)  # (time, wanted) over the longest delay
    reason: str = "the starting count (replicas:)"
    limited: str | None = None  # why the target is below what the load asks for (the host cap)
    cold_since: float | None = None  # a cold start under way (0 -> 1) since then
    cold_start_s: float | None = None  # how long the last one took, to a registered replica
    decided: bool = False  # the load has moved the target once (no adopting after that)
    down_delay: float = -1.0  # the downscale delay in force: the configured one, longer after flaps
    last_down_at: float | None = None  # when the target last moved down, while a flap may follow

    def __post_init__(self) -> None:
        self.down_delay = self.spec.downscale_delay_s

    @property
    def horizon(self) -> float:
        return max(self.spec.upscale_delay_s, self.down_delay)

    def flap_window(self) -> float:
        return FLAP_WINDOW * (self.spec.upscale_delay_s + self.down_delay)


class Autoscaler:
    def __init__(
        self, topology: Topology, registry: Registry, dispatcher: Dispatcher, *, host_cap: int | None = None
    ) -> None:
        self.topology = topology
        self.registry = registry
        self.dispatcher = dispatcher
        self.host_cap = host_cap if host_cap is not None else _cap_from_env()
        self.stages = {
            s.name: StageScaling(s, s.autoscale, s.replicas, s.replicas) for s in topology.stages if s.autoscale
        }
        self.settle_until: float | None = None  # set at the first tick
        self.fixed: dict[str, int] = {}  # stage without autoscale: -> replicas set by `omni-mesh scale`

    # ------------------------------------------------------------------ what it reads

    def current(self, stage: str) -> int:
        """Replicas of `stage` registered and not draining (the ones that take new work)."""
        return sum(1 for r in self.registry.of_stage(stage) if not r.draining)

    def ongoing(self, stage: str) -> int:
        """Requests in flight on the stage's replicas (with several coordinators, the others' too, as the
        replicas' heartbeats tell: `foreign`), queued for one, or arriving (large inputs)."""
        inflight = sum(len(r.inflight) + r.foreign for r in self.registry.of_stage(stage))
        return inflight + len(self.dispatcher.queues[stage]) + max(0, self.dispatcher.arriving.get(stage, 0))

    def target(self, stage: StageSpec) -> int:
        scaling = self.stages.get(stage.name)
        return scaling.target if scaling is not None else self.fixed.get(stage.name, stage.replicas)

    def set_replicas(self, name: str, replicas: int) -> int:
        """`omni-mesh scale`: the target of stage `name` (without autoscale:) from now on; returns the
        previous one. ScaleRefused names the stage and why not."""
        stage = next((s for s in self.topology.stages if s.name == name), None)
        if stage is None:
            names = ", ".join(s.name for s in self.topology.stages)
            raise ScaleRefused(404, f"no stage {name!r} in mesh {self.topology.name!r}; its stages: {names}")
        if stage.autoscale is not None:
            spec = stage.autoscale
            raise ScaleRefused(409, f"stage {name!r} is autoscaled (min_replicas {spec.min_replicas}, max_replicas "
                                    f"{spec.max_replicas}): its target follows the load; change its autoscale: "
                                    "section to change its bounds")
        if self.host_cap is None:
            raise ScaleRefused(409, "no launcher acts on this coordinator's targets (only `omni-mesh up` starts "
                                    "and stops replicas); scale the deployment that runs them instead")
        if replicas < 1:
            raise ScaleRefused(422, f"stage {name!r}: replicas must be at least 1, got {replicas}")
        others = sum(self.target(s) for s in self.topology.stages if s.name != name)
        if others + replicas > self.host_cap:
            raise ScaleRefused(422, f"stage {name!r}: {replicas} replicas is past the host cap of {self.host_cap} "
                                    f"replicas in all (the other stages run {others}, leaving {self.host_cap - others}); "
                                    "raise it with `omni-mesh up --max-replicas-total N`")
        before = self.target(stage)
        self.fixed[name] = replicas
        log.info("scale: %s %d -> %d (omni-mesh scale)", name, before, replicas)
        return before

    def scaled_to_zero(self) -> set[str]:
        """Stages with no replica because the autoscaler took them to zero (or is starting one from
        zero): idle by choice, not broken; a request for one waits for its replica."""
        return {
            name for name, s in self.stages.items()
            if (s.target == 0 or s.cold_since is not None) and not self.registry.of_stage(name)
        }

    def describe(self, stage: StageSpec) -> dict[str, Any]:
        """The stage's current and target replicas, and why (for /v1/stages)."""
        out: dict[str, Any] = {"current_replicas": self.current(stage.name), "target_replicas": self.target(stage)}
        scaling = self.stages.get(stage.name)
        if scaling is None:
            return {**out, "autoscale": None}
        return {
            **out,
            "autoscale": {
                **scaling.spec.to_dict(),
                "ongoing": scaling.ongoing,
                "wanted": scaling.wanted,
                "reason": scaling.reason,
                "limited": scaling.limited,
                "scaled_to_zero": stage.name in self.scaled_to_zero(),
                "cold_start_s": None if scaling.cold_start_s is None else round(scaling.cold_start_s, 3),
                "host_cap": self.host_cap,
                "settling": self.settling(time.monotonic()),
                "downscale_delay_now_s": scaling.down_delay,
            },
        }

    # ------------------------------------------------------------------ deciding

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick(time.monotonic())
            except Exception:  # a bug here must not stop the coordinator; the next tick tries again
                log.exception("autoscaler tick failed")

    def settling(self, now: float) -> bool:
        return self.settle_until is None or now < self.settle_until

    def tick(self, now: float) -> None:
        if self.settle_until is None:
            self.settle_until = now + SETTLE_S
        for scaling in self.stages.values():
            self._step(scaling, now)

    def _step(self, s: StageScaling, now: float) -> None:
        name, spec = s.stage.name, s.spec
        s.ongoing = self.ongoing(name)
        s.wanted = min(spec.max_replicas, max(spec.min_replicas, math.ceil(s.ongoing / spec.target_ongoing_requests)))
        self._cold_start_done(s, now)
        s.history.append((now, s.wanted))
        while len(s.history) > 1 and s.history[1][0] <= now - s.horizon:
            s.history.popleft()  # keep one reading at or before the longest delay: it says the window is covered
        new = s.target
        running = self.current(name)
        if self.settling(now) and not s.decided and s.target < running:  # a previous coordinator's replicas
            new = min(spec.max_replicas, running)
            s.reason = f"adopted the {running} replicas running (the coordinator started)"
            log.info("autoscale: %s %d -> %d: %s", name, s.target, new, s.reason)
            s.target = new
        elif s.target == 0 and s.ongoing > 0:
            new = max(1, s.wanted)  # work waits on no replica at all: no delay
            s.cold_since = now
        else:
            # Up only when every reading of the last upscale_delay_s asked for more, to the least of
            # them (a peak alone starts nothing); down likewise, to the most of them (a lull alone, or
            # the tail of a burst draining, stops nothing more than it should).
            more = _settled(s.history, now, spec.upscale_delay_s, lambda w: w > s.target)
            fewer = _settled(s.history, now, s.down_delay, lambda w: w < s.target)
            if more:
                new = min(more)
            elif fewer:
                new = max(fewer)
        if new > s.target:
            new = self._within_cap(s, new)
        elif s.wanted <= s.target:
            s.limited = None
        self._damp(s, now, new)
        if new != s.target:
            per = f"{spec.target_ongoing_requests:g}"
            s.reason = f"{s.ongoing} ongoing, target {per} per replica"
            if new == 0:
                s.reason += f" (idle for {s.down_delay:g} s: scaled to zero)"
            log.info("autoscale: %s %d -> %d: %s", name, s.target, new, s.reason)
            s.target, s.decided = new, True

    def _damp(self, s: StageScaling, now: float, new: int) -> None:
        """Lengthen the downscale delay of a stage going back up soon after it went down (a flap);
        give it back its configured delay once a move down has held for the flap window."""
        if new < s.target:
            s.last_down_at = now
        elif s.last_down_at is not None and now - s.last_down_at > s.flap_window():
            s.last_down_at = None  # the move down held
            if s.down_delay != s.spec.downscale_delay_s:
                s.down_delay = s.spec.downscale_delay_s
                log.info("autoscale: %s held its move down: downscale delay back to %g s", s.stage.name, s.down_delay)
        elif new > s.target and s.last_down_at is not None:
            back_s, s.last_down_at = now - s.last_down_at, None
            cap = max(FLAP_CAP * s.spec.downscale_delay_s, FLAP_FLOOR_S)
            longer = min(cap, max(2 * s.down_delay, FLAP_FLOOR_S))
            if longer > s.down_delay:
                s.down_delay = longer
                log.info("autoscale: %s went back up %.1f s after going down (the load oscillates): it now "
                         "waits %g s of lower load before scaling down", s.stage.name, back_s, longer)

    def _within_cap(self, s: StageScaling, new: int) -> int:
        """`new`, or as much of it as the host cap leaves (never below the present target)."""
        if self.host_cap is None:
            return new
        others = sum(self.target(stage) for stage in self.topology.stages if stage.name != s.stage.name)
        allowed = max(s.target, min(new, self.host_cap - others))
        limited = None
        if allowed < new:
            limited = (
                f"wants {new} replicas, the host cap of {self.host_cap} replicas in all leaves {allowed} "
                f"(the other stages run {others}); raise it with `omni-mesh up --max-replicas-total N`"
            )
        if limited != s.limited and limited is not None:
            log.warning("autoscale: %s cannot reach its target: %s", s.stage.name, limited)
        s.limited = limited
        return allowed

    def _cold_start_done(self, s: StageScaling, now: float) -> None:
        if s.cold_since is not None and self.current(s.stage.name) > 0:
            s.cold_start_s = now - s.cold_since
            s.cold_since = None
            log.info("autoscale: %s cold start: a replica took work %.2f s after the first request waited", s.stage.name, s.cold_start_s)


def _settled(history: deque[tuple[float, int]], now: float, delay_s: float, asks: Callable[[int], bool]) -> list[int]:
    """The readings of the last `delay_s` if they cover it and every one `asks`; else []."""
    if not history or history[0][0] > now - delay_s:
        return []  # not watched that long yet
    window = [wanted for at, wanted in history if at >= now - delay_s] or [history[-1][1]]
    return window if all(asks(wanted) for wanted in window) else []


def _cap_from_env() -> int | None:
    raw = os.environ.get(HOST_CAP_ENV)
    if not raw:
        return None
    try:
        cap = int(raw)
    except ValueError:
        raise ValueError(f"{HOST_CAP_ENV} must be an integer >= 1, got {raw!r}") from None
    if cap < 1:
        raise ValueError(f"{HOST_CAP_ENV} must be an integer >= 1, got {raw!r}")
    return cap
