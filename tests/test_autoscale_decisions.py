"""The coordinator's autoscaling decisions, tick by tick on a given clock: the real Autoscaler reading
the real Registry and Dispatcher (work queued in the dispatcher's stage queues is the load).

- the target moves up only once every reading of `upscale_delay_s` asked for more, down only once
  every reading of `downscale_delay_s` asked for fewer; a spike or a lull alone moves nothing;
- the tail of a burst draining does not hold the way down for another delay (back at 1 within the
  delay plus the tail);
- a stage at zero with work waiting gets a replica at once;
- the host cap bounds the sum of every stage's target, and the stage held back says why;
- a coordinator that (re)starts adopts the replicas already running, and says it is settling.
"""

from __future__ import annotations

import logging
import os

import pytest

from omni_mesh.control import Register
from omni_mesh.coordinator.scheduling.autoscaler import Autoscaler
from omni_mesh.coordinator.scheduling.dispatch import Dispatcher
from omni_mesh.coordinator.scheduling.registry import Registry
from omni_mesh.topology import parse_topology

TICK = 0.25


def mesh(*scales: dict, cap: int | None = None) -> tuple[Autoscaler, Dispatcher]:
    stages = [
        {"stage_id": i, "name": f"s{i}", "handler": "m:f", "max_inflight": 1, "autoscale": scale,
         **({"engine_input_source": [i - 1]} if i else {})}
        for i, scale in enumerate(scales)
    ]
    topology = parse_topology({"name": "decide", "stages": stages})
    registry = Registry(topology)
    dispatcher = Dispatcher(topology, registry, lambda replica, message: None)
    return Autoscaler(topology, registry, dispatcher, host_cap=cap), dispatcher


def load(dispatcher: Dispatcher, stage: str, ongoing: int) -> None:
    queue = dispatcher.queues[stage]
    queue.clear()
    queue.extend((f"r{i}", None) for i in range(ongoing))  # type: ignore[misc]


def run(scaler: Autoscaler, dispatcher: Dispatcher, stage: str, plan: list[tuple[float, int]], start: float = 0.0) -> list[int]:
    """Tick every TICK s through `plan` ([(seconds, ongoing)]); the target after each tick."""
    targets, now = [], start
    for seconds, ongoing in plan:
        load(dispatcher, stage, ongoing)
        for _ in range(round(seconds / TICK)):
            now += TICK
            scaler.tick(now)
            targets.append(scaler.stages[stage].target)
    return targets


SCALE = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2, "upscale_delay_s": 1, "downscale_delay_s": 2}


def test_up_after_the_delay_and_down_after_its_own() -> None:
    scaler, dispatcher = mesh(SCALE)
    targets = run(scaler, dispatcher, "s0", [(2.0, 0), (2.0, 16), (3.0, 0)])
    assert targets[:8] == [1] * 8
    # 16 ongoing from the 9th tick: 4 ticks of readings (1 s) later, the target is 4.
    assert targets[8:12] == [1, 1, 1, 1] and targets[12] == 4
    # Idle from the 17th tick: 8 ticks (2 s) later, back to 1.
    assert targets[16:24] == [4] * 8 and targets[24] == 1
    assert scaler.stages["s0"].reason == "0 ongoing, target 2 per replica"


def test_a_spike_or_a_lull_alone_moves_nothing() -> None:
    scaler, dispatcher = mesh(SCALE)
    assert set(run(scaler, dispatcher, "s0", [(1.0, 0), (0.5, 16), (0.25, 0), (0.5, 16), (1.0, 0)])) == {1}
    up = run(scaler, dispatcher, "s0", [(1.5, 16)], start=3.25)
    assert up[-1] == 4
    held = run(scaler, dispatcher, "s0", [(1.5, 16), (1.0, 0), (0.25, 8), (1.5, 0)], start=4.75)
    assert set(held) == {4}, held  # every lull shorter than downscale_delay_s


def test_a_burst_draining_is_back_at_the_minimum_after_one_delay() -> None:
    scaler, dispatcher = mesh(SCALE)
    run(scaler, dispatcher, "s0", [(2.0, 16)])
    assert scaler.stages["s0"].target == 4
    targets = run(scaler, dispatcher, "s0", [(0.25, 6), (0.25, 3), (3.0, 0)], start=2.0)
    # Each step is the most asked for over the last 2 s: 3 while the tail's 6 ongoing is in the window,
    # then 2, then 1, a tick apart: back at 1 within the delay plus the tail, not twice the delay.
    first_down = next(i for i, target in enumerate(targets) if target < 4)
    assert first_down * TICK >= 2.0 - TICK
    assert targets.index(1) * TICK <= 2.0 + 0.5 + TICK and targets[-1] == 1, targets


def test_a_stage_at_zero_starts_one_replica_at_once(caplog: pytest.LogCaptureFixture) -> None:
    scaler, dispatcher = mesh({**SCALE, "min_replicas": 0})
    targets = run(scaler, dispatcher, "s0", [(2.5, 0)])
    assert targets[-1] == 0 and scaler.scaled_to_zero() == {"s0"}
    with caplog.at_level(logging.INFO, logger="omni_mesh.autoscaler"):
        targets = run(scaler, dispatcher, "s0", [(0.25, 1)], start=2.5)
    assert targets == [1]  # no upscale delay from zero: a request waits on it
    assert scaler.scaled_to_zero() == {"s0"}  # starting from zero: /ready stays 200 meanwhile
    assert "autoscale: s0 0 -> 1: 1 ongoing, target 2 per replica" in caplog.text


def test_the_host_cap_bounds_the_sum_of_targets() -> None:
    scaler, dispatcher = mesh(SCALE, SCALE, cap=5)
    load(dispatcher, "s0", 16)
    load(dispatcher, "s1", 16)
    for tick in range(1, 12):
        scaler.tick(tick * TICK)
        assert scaler.stages["s0"].target + scaler.stages["s1"].target <= 5
    assert (scaler.stages["s0"].target, scaler.stages["s1"].target) == (4, 1)
    limited = scaler.stages["s1"].limited
    assert limited is not None and "host cap of 5 replicas in all leaves 1" in limited
    assert scaler.describe(scaler.stages["s1"].stage)["autoscale"]["limited"] == limited
    # Once the other stage goes down, the one held back gets its replicas.
    load(dispatcher, "s0", 0)
    for tick in range(12, 40):
        scaler.tick(tick * TICK)
    assert (scaler.stages["s0"].target, scaler.stages["s1"].target) == (1, 4)
    assert scaler.stages["s1"].limited is None


def test_a_restarted_coordinator_adopts_the_replicas_running() -> None:
    """A coordinator that starts (again: `up`'s watchdog restarted it) while more replicas than the
    starting count run and register takes them as its target, and says it is settling, so `up` stops
    none of them; afterwards the load decides as usual."""
    scaler, dispatcher = mesh(SCALE)
    registry = scaler.registry
    for index in range(3):
        message = Register(stage="s0", replica=f"s0-{index}", pid=100 + index, host="h", max_inflight=1, edges={})
        registry.register(message, b"\x01" + os.urandom(16))
    targets = run(scaler, dispatcher, "s0", [(1.0, 0)])
    assert targets == [3] * 4 and scaler.stages["s0"].reason.startswith("adopted the 3 replicas running")
    assert scaler.settling(1.0) and not scaler.settling(10.5)
    # Idle: the target comes down after the downscale delay, and no adopting brings it back.
    targets = run(scaler, dispatcher, "s0", [(3.0, 0)], start=1.0)
    assert targets[-1] == 1 and targets.count(3) >= 4, targets


def test_a_load_oscillating_around_the_target_does_not_flap(caplog: pytest.LogCaptureFixture) -> None:
    """Ongoing 3 and 5 by turns, 3 s each (slower than both delays), around the 4 that 2 replicas carry:
    the stage goes up, down and up again once (a flap), then its downscale delay doubles past the lulls
    and it holds 3 replicas for the rest of the 2 minutes; a real lull later brings it down, and the
    configured delay is back once that move has held."""
    scaler, dispatcher = mesh(SCALE)
    with caplog.at_level(logging.INFO, logger="omni_mesh.autoscaler"):
        targets = run(scaler, dispatcher, "s0", [(3.0, 5), (3.0, 3)] * 20)
    moves = [(i, t) for i, t in enumerate(targets) if i and t != targets[i - 1]]
    assert len(moves) <= 3 and targets[-40:] == [3] * 40, moves
    assert scaler.stages["s0"].down_delay == 4.0
    assert "went back up" in caplog.text and "it now waits 4 s of lower load" in caplog.text
    assert scaler.describe(scaler.stages["s0"].stage)["autoscale"]["downscale_delay_now_s"] == 4.0
    targets = run(scaler, dispatcher, "s0", [(20.0, 0)], start=120.0)
    assert targets[-1] == 1 and targets.index(1) * TICK >= 4.0 - TICK, targets
    assert scaler.stages["s0"].down_delay == SCALE["downscale_delay_s"]  # the move down held
