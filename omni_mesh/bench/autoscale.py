"""`omni-mesh bench autoscale`: the whole autoscaling cycle under `omni-mesh up`, timed.

A one-stage mesh whose handler waits `delay_s` per request, one request per replica at a time
(omni_mesh.bench.autoscale_handlers:wait), with `autoscale:` as the flags say, gets a step load: idle,
then a burst of `concurrency` closed-loop clients, then idle again until the stage is back at its
minimum. The report is the timeline (replicas and target each second, answers per second), and per
phase the throughput, p50/p99 latency and failed requests; the time from the burst's start until the
stage ran its peak target, and from the burst's end until it was back at its minimum.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from omni_mesh.bench.http_client import Connection
from omni_mesh.bench.mesh import running_mesh
from omni_mesh.bench.pipeline import percentile

HANDLER = "omni_mesh.bench.autoscale_handlers:wait"
STAGE = "slow"


@dataclass(frozen=True)
class Plan:
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 5.0
    delay_s: float = 0.1  # the stage's work per request
    concurrency: int = 16
    idle_s: float = 3.0  # before the burst
    burst_s: float = 20.0
    tail_s: float = 60.0  # the longest wait, after the burst, for the stage to be back at its minimum
    timeout_s: float = 30.0

    def topology(self) -> dict[str, Any]:
        scale = {key: getattr(self, key) for key in (
            "min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s")}
        return {"name": "bench-autoscale",
                "stages": [{"stage_id": 0, "name": STAGE, "handler": HANDLER, "max_inflight": 1, "autoscale": scale}]}


@dataclass
class _Run:
    answers: list[tuple[float, int, float]] = field(default_factory=list)  # (end, status, latency)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (time, current, target)


def run(plan: Plan) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="omni-mesh-bench-autoscale-") as directory:
        path = Path(directory) / "topology.yaml"
        path.write_text(yaml.safe_dump(plan.topology(), sort_keys=False))
        cap = str(max(plan.max_replicas, 1))
        with running_mesh(path, extra=["--max-replicas-total", cap]) as mesh:
            record = _Run()
            stop = threading.Event()
            sampler = threading.Thread(target=_sample, args=(mesh.url, record, stop), daemon=True)
            sampler.start()
            t0 = time.monotonic()
            time.sleep(plan.idle_s)
            burst = time.monotonic()
            calm = burst + plan.burst_s  # the step down: no client sends after it (the last answers drain)
            asyncio.run(_burst(mesh.url, plan, record, calm))
            deadline = calm + plan.tail_s
            while time.monotonic() < deadline and not _at_minimum(record, plan, calm):
                time.sleep(0.25)
            end = time.monotonic()
            stop.set()
            sampler.join(5)
    return _result(plan, record, t0, burst, calm, end)


def _sample(url: str, record: _Run, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=5) as client:
        while not stop.wait(0.25):
            try:
                stage = next(s for s in client.get("/v1/stages").json()["stages"] if s["name"] == STAGE)
            except (httpx.HTTPError, ValueError, KeyError, StopIteration):
                continue
            record.samples.append((time.monotonic(), len(stage["replicas"]), stage["target_replicas"]))


async def _burst(url: str, plan: Plan, record: _Run, until: float) -> None:
    body = json.dumps({"inputs": {}, "params": {"delay_s": plan.delay_s}, "timeout_s": plan.timeout_s}).encode()

    async def client() -> None:
        connection = Connection(url)
        try:
            while time.monotonic() < until:
                start = time.monotonic()
                try:
                    status, _, _ = await connection.post("/v1/requests", body)
                except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError):
                    status = 0
                    connection.close()
                now = time.monotonic()
                record.answers.append((now, status, now - start))
        finally:
            connection.close()

    await asyncio.gather(*(client() for _ in range(plan.concurrency)))


def _at_minimum(record: _Run, plan: Plan, since: float) -> bool:
    return any(at >= since and current == plan.min_replicas == target for at, current, target in record.samples)


def _phase(record: _Run, start: float, end: float) -> dict[str, Any]:
    mine = [(status, latency) for at, status, latency in record.answers if start <= at < end]
    ok = [latency for status, latency in mine if status == 200]
    return {
        "seconds": round(end - start, 2),
        "requests": len(mine),
        "failed": len(mine) - len(ok),
        "per_s": round(len(ok) / (end - start), 2) if end > start else 0.0,
        "p50_ms": round(percentile(ok, 0.5) * 1000, 1) if ok else None,
        "p99_ms": round(percentile(ok, 0.99) * 1000, 1) if ok else None,
        "replicas": sorted({current for at, current, _ in record.samples if start <= at < end}),
    }


def _result(plan: Plan, record: _Run, t0: float, burst: float, calm: float, end: float) -> dict[str, Any]:
    peak = max((target for at, _, target in record.samples if burst <= at < calm), default=plan.min_replicas)
    reached = next((at for at, current, _ in record.samples if at >= burst and current >= peak), None)
    back = next((at for at, current, target in record.samples if at >= calm and current == plan.min_replicas == target), None)
    timeline = []
    for second in range(int(end - t0) + 1):
        start = t0 + second
        inside = [(current, target) for at, current, target in record.samples if start <= at < start + 1]
        answered = sum(1 for at, status, _ in record.answers if start <= at < start + 1 and status == 200)
        middle = start + 0.5  # a second is in the phase its middle is in
        phase = "idle" if middle < burst else "burst" if middle < calm else "calm"
        if inside:
            timeline.append({"t": second, "phase": phase, "replicas": inside[-1][0], "target": inside[-1][1], "ok": answered})
    return {
        "plan": vars(plan),
        "phases": {"idle": _phase(record, t0, burst), "burst": _phase(record, burst, calm), "calm": _phase(record, calm, end)},
        "peak_target": peak,
        "reach_target_s": None if reached is None else round(reached - burst, 2),
        "back_to_min_s": None if back is None else round(back - calm, 2),
        "failed": sum(1 for _, status, _ in record.answers if status != 200),
        "requests": len(record.answers),
        "timeline": timeline,
    }


def report(result: dict[str, Any]) -> str:
    plan = result["plan"]
    lines = [
        f"autoscale: a {plan['delay_s'] * 1000:.0f} ms stage, one request per replica, min {plan['min_replicas']} "
        f"max {plan['max_replicas']} target {plan['target_ongoing_requests']:g} ongoing per replica, delays "
        f"up {plan['upscale_delay_s']:g} s down {plan['downscale_delay_s']:g} s; burst of {plan['concurrency']} "
        f"clients for {plan['burst_s']:g} s",
        "",
        f"{'t (s)':>6}  {'phase':<6}{'replicas':>9}{'target':>8}{'ok/s':>7}  ",
    ]
    for row in result["timeline"]:
        bar = "#" * row["replicas"]
        lines.append(f"{row['t']:>6}  {row['phase']:<6}{row['replicas']:>9}{row['target']:>8}{row['ok']:>7}  {bar}")
    lines += ["", f"{'phase':<7}{'seconds':>8}{'requests':>10}{'ok/s':>8}{'p50':>10}{'p99':>10}{'failed':>8}  replicas"]
    for name, phase in result["phases"].items():
        p50 = "-" if phase["p50_ms"] is None else f"{phase['p50_ms']:.0f} ms"
        p99 = "-" if phase["p99_ms"] is None else f"{phase['p99_ms']:.0f} ms"
        lines.append(f"{name:<7}{phase['seconds']:>8.1f}{phase['requests']:>10}{phase['per_s']:>8.1f}{p50:>10}{p99:>10}"
                     f"{phase['failed']:>8}  {phase['replicas']}")
    reach = "never" if result["reach_target_s"] is None else f"{result['reach_target_s']:.1f} s"
    back = "not within the tail" if result["back_to_min_s"] is None else f"{result['back_to_min_s']:.1f} s"
    lines += [
        "",
        f"peak target {result['peak_target']} replicas, reached {reach} after the burst began; back to "
        f"{plan['min_replicas']} {back} after it ended; {result['failed']} of {result['requests']} requests failed",
    ]
    return "\n".join(lines)
