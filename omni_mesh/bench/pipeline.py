"""`omni-mesh bench pipeline`: N concurrent clients against a mesh for T seconds, over HTTP.

Reports requests per second, p50/p99 latency, errors by status, and the per-stage breakdown the
coordinator returns with each response (time queued for a replica, time in connectors, time in the
handler). With --url it measures the running mesh once. With --topology it starts the mesh with
`omni-mesh up` for every round and stops it after; `--security both` (the default) alternates rounds
with the control plane on CURVE and with it off (OMNI_MESH_INSECURE=1), so the two are measured in
the same run under the same noise, and reports each mode's medians and the ratio on/off.
`--coordinators 1,2` alternates rounds with `up --coordinators N` instead (CURVE on, or as --security
says), and reports each count's medians and the ratio of the last count to the first.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import httpx

from omni_mesh import aio
from omni_mesh.bench.http_client import Connection
from omni_mesh.bench.mesh import running_mesh
from omni_mesh.procinfo import cpu_seconds

#: --security: which control planes to measure, in the order rounds alternate.
SECURITY_MODES = {"both": ("on", "off"), "on": ("on",), "off": ("off",)}
EXPECTED_CONTROL_PLANE = {"on": "CURVE", "off": "insecure"}
WARMUP_S = 1.0  # full load before the measured window: connections, first-touch costs, caches


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def drive(url: str, concurrency: int, duration_s: float, body: dict, pids: set[int] | None = None) -> dict[str, Any]:
    """Load for WARMUP_S + duration_s; figures count what completes inside the last duration_s, and
    the first chunks (and first audio) of successful streamed replies that arrive inside it.
    With `pids` (the mesh's processes), also the CPU time they spend in that window per request:
    a cost the other loads on a shared machine disturb far less than throughput."""
    latencies: list[float] = []
    first_chunk: list[float] = []  # streaming: request start to the first chunk event
    first_audio: list[float] = []  # streaming: request start to the first chunk that carries audio
    statuses: Counter[str] = Counter()
    stage_times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    payload = json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=url, timeout=body["timeout_s"] + 5.0) as client:
        await client.post("/v1/requests", json=body)  # the mesh's first request (imports, pools) is not timed
    measure_from = time.perf_counter() + WARMUP_S
    stop_at = measure_from + duration_s

    async def client_loop() -> None:
        connection = Connection(url)
        streaming = httpx.AsyncClient(base_url=url, timeout=body["timeout_s"] + 5.0) if body.get("stream") else None
        try:
            while (started := time.perf_counter()) < stop_at:
                marks: dict[str, float] = {}
                try:
                    if streaming is not None:
                        status, raw = await _streamed(streaming, body, marks)
                    else:
                        status, _, raw = await asyncio.wait_for(connection.post("/v1/requests", payload), body["timeout_s"] + 5)
                    outcome = str(status)
                except (OSError, ConnectionError, asyncio.IncompleteReadError, TimeoutError, httpx.HTTPError) as exc:
                    outcome, raw = type(exc).__name__, b""
                    connection.close()
                finished = time.perf_counter()
                if outcome == "200":
                    # A first chunk counts when it arrives inside the window, whenever its request ends:
                    # under load a streamed reply may outlast the window while its first audio came early.
                    for mark, found in (("chunk", first_chunk), ("audio", first_audio)):
                        if measure_from <= marks.get(mark, -1.0) <= stop_at:
                            found.append(marks[mark] - started)
                if not measure_from <= finished <= stop_at:
                    continue
                statuses[outcome] += 1
                if outcome == "200":
                    latencies.append(finished - started)
                    for stage, times in json.loads(raw).get("timings", {}).items():
                        for name, value in times.items():
                            if isinstance(value, (int, float)):  # not the per-edge detail ("edges")
                                stage_times[stage][name].append(value)
        finally:
            connection.close()
            if streaming is not None:
                await streaming.aclose()

    async def cpu_in_window() -> float | None:
        if pids is None:
            return None
        await asyncio.sleep(measure_from - time.perf_counter())
        before = cpu_seconds(pids)
        await asyncio.sleep(stop_at - time.perf_counter())
        return cpu_seconds(pids) - before

    mesh_cpu_s, *_ = await asyncio.gather(cpu_in_window(), *(client_loop() for _ in range(concurrency)))
    ok = statuses.get("200", 0)
    return {
        "duration_s": duration_s,
        "requests": sum(statuses.values()),
        "ok": ok,
        "errors": {status: n for status, n in statuses.items() if status != "200"},
        "req_per_s": ok / duration_s,
        "p50_s": percentile(latencies, 0.50),
        "p99_s": percentile(latencies, 0.99),
        **({
            "first_chunk_p50_s": percentile(first_chunk, 0.50), "first_chunk_p99_s": percentile(first_chunk, 0.99),
            "first_audio_p50_s": percentile(first_audio, 0.50), "first_audio_p99_s": percentile(first_audio, 0.99),
        } if body.get("stream") else {}),
        "mesh_cpu_s": mesh_cpu_s,
        "cpu_s_per_request": mesh_cpu_s / ok if mesh_cpu_s is not None and ok else None,
        "stages": {
            stage: {name: statistics.median(values) for name, values in times.items()}
            for stage, times in stage_times.items()
        },
    }


async def _streamed(client: httpx.AsyncClient, body: dict, marks: dict[str, float]) -> tuple[int, bytes]:
    """One `stream: true` request, read as server-sent events; `marks` gets when the first chunk and the
    first chunk carrying audio (a non-empty output field with "audio" in its name) arrived. (status, the done
    event's data)."""
    async with client.stream("POST", "/v1/requests", json=body) as response:
        if response.status_code != 200:
            return response.status_code, await response.aread()
        event, done = "", b""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "chunk":
                now = time.perf_counter()
                marks.setdefault("chunk", now)
                output = json.loads(line[6:]).get("output")
                if isinstance(output, dict) and any("audio" in key and value for key, value in output.items()):
                    marks.setdefault("audio", now)
            elif line.startswith("data: ") and event == "done":
                done = line[6:].encode()
            elif line.startswith("data: ") and event == "error":
                return int(json.loads(line[6:]).get("status", 500)), b""
        return 200, done


def _round_on_new_mesh(
    topology: str, mode: str, concurrency: int, duration_s: float, body: dict, coordinators: int | None = None
) -> dict[str, Any]:
    extra = ["--coordinators", str(coordinators)] if coordinators else []
    with running_mesh(topology, insecure=mode == "off", extra=extra) as mesh:
        result = aio.run(drive(mesh.url, concurrency, duration_s, body, mesh.processes()))
        seen = mesh.control_plane()
    if seen != "unknown" and seen != EXPECTED_CONTROL_PLANE[mode]:
        raise RuntimeError(f"asked for CURVE {mode}, but the coordinator runs its control plane {seen}")
    return {"mode": f"coordinators={coordinators}" if coordinators else mode, "control_plane": seen, **result}


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's rounds: medians of the per-round figures, sums of the counts."""
    errors: Counter[str] = Counter()
    for r in rounds:
        errors.update(r["errors"])
    stages: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rounds:
        for stage, times in r["stages"].items():
            for name, value in times.items():
                stages[stage][name].append(value)
    return {
        "rounds": len(rounds),
        "req_per_s": statistics.median(r["req_per_s"] for r in rounds),
        "req_per_s_rounds": [r["req_per_s"] for r in rounds],
        "p50_s": statistics.median(r["p50_s"] for r in rounds),
        "p99_s": statistics.median(r["p99_s"] for r in rounds),
        **{name: statistics.median(r[name] for r in rounds) for name in _STREAM_FIGURES if name in rounds[0]},
        "cpu_s_per_request": _median_known(r["cpu_s_per_request"] for r in rounds),
        "requests": sum(r["requests"] for r in rounds),
        "ok": sum(r["ok"] for r in rounds),
        "errors": dict(errors),
        "stages": {s: {n: statistics.median(v) for n, v in t.items()} for s, t in stages.items()},
    }


def _median_known(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratios(rounds: list[dict[str, Any]], modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """CURVE on / off: of the medians, and of each on round to the off round beside it."""
    on = [r["req_per_s"] for r in rounds if r["mode"] == "on"]
    off = [r["req_per_s"] for r in rounds if r["mode"] == "off"]
    return {
        "req_per_s": modes["on"]["req_per_s"] / modes["off"]["req_per_s"],
        "p50_s": modes["on"]["p50_s"] / modes["off"]["p50_s"],
        "p99_s": modes["on"]["p99_s"] / modes["off"]["p99_s"],
        "req_per_s_pairs": [a / b for a, b in zip(on, off, strict=True)],
        "cpu_s_per_request": modes["on"]["cpu_s_per_request"] / modes["off"]["cpu_s_per_request"],
    }


def run(
    *,
    url: str | None,
    topology: str | None,
    concurrency: int,
    duration_s: float,
    inputs: dict,
    params: dict,
    timeout_s: float,
    security: str = "both",
    rounds: int = 3,
    stream: bool = False,
    coordinators: list[int] | None = None,
) -> dict[str, Any]:
    """With `url`: one measurement of the running mesh (security "running"). With `topology`:
    `rounds` rounds per mode of `security`, alternating modes, each on a freshly started mesh."""
    body = {"inputs": inputs, "params": params, "timeout_s": timeout_s, **({"stream": True} if stream else {})}
    common = {"url": url, "topology": topology, "concurrency": concurrency, "duration_s": duration_s}
    if url:
        measured = [{"mode": "running", "control_plane": "unknown", **aio.run(drive(url, concurrency, duration_s, body))}]
        return {**common, "security": "running", "rounds": measured, "modes": {"running": summarise(measured)}}
    assert topology is not None
    if coordinators:  # one security mode, rounds alternating over the coordinator counts
        mode = SECURITY_MODES[security][0]
        measured = [
            _round_on_new_mesh(topology, mode, concurrency, duration_s, body, count)
            for _ in range(rounds) for count in coordinators
        ]
        modes = {f"coordinators={n}": summarise([r for r in measured if r["mode"] == f"coordinators={n}"])
                 for n in coordinators}
        first, last = modes[f"coordinators={coordinators[0]}"], modes[f"coordinators={coordinators[-1]}"]
        ratio = {"counts": [coordinators[-1], coordinators[0]], "req_per_s": last["req_per_s"] / first["req_per_s"],
                 "p99_s": last["p99_s"] / first["p99_s"]}
        return {**common, "security": mode, "rounds": measured, "modes": modes, "ratio_coordinators": ratio}
    order = SECURITY_MODES[security]
    measured = [
        _round_on_new_mesh(topology, mode, concurrency, duration_s, body) for _ in range(rounds) for mode in order
    ]
    modes = {mode: summarise([r for r in measured if r["mode"] == mode]) for mode in order}
    result = {**common, "security": security, "rounds": measured, "modes": modes}
    if len(order) == 2:
        result["ratio_on_off"] = _ratios(measured, modes)
    return result


_MODE_TITLES = {"on": "CURVE on", "off": "CURVE off", "running": "as running"}
_STREAM_FIGURES = ("first_chunk_p50_s", "first_chunk_p99_s", "first_audio_p50_s", "first_audio_p99_s")


def _title(mode: str) -> str:
    return _MODE_TITLES.get(mode) or mode.replace("coordinators=", "coord. ")


def _cpu(figures: dict[str, Any]) -> str:
    cpu = figures.get("cpu_s_per_request")
    return "mesh CPU    -    " if cpu is None else f"mesh CPU {cpu * 1e3:5.2f} ms/req"


def report(result: dict[str, Any]) -> str:
    target = result["url"] or result["topology"]
    lines = [f"{target}  {result['concurrency']} concurrent clients, {result['duration_s']:.1f} s per round"]
    for r in result["rounds"]:
        errors = ", ".join(f"{status}: {n}" for status, n in r["errors"].items()) or "none"
        lines.append(
            f"  round  {_title(r['mode']):<10} {r['req_per_s']:8.1f} req/s   p50 {r['p50_s'] * 1e3:6.1f} ms"
            f"   p99 {r['p99_s'] * 1e3:6.1f} ms   {_cpu(r)}   {r['ok']} ok, errors: {errors}"
        )
    for mode, summary in result["modes"].items():
        lines.append(
            f"  median {_title(mode):<10} {summary['req_per_s']:8.1f} req/s   p50 {summary['p50_s'] * 1e3:6.1f} ms"
            f"   p99 {summary['p99_s'] * 1e3:6.1f} ms   {_cpu(summary)}   ({summary['rounds']} rounds)"
        )
    for mode, summary in result["modes"].items():
        if "first_chunk_p50_s" in summary:
            ms = {name: summary[name] * 1e3 for name in _STREAM_FIGURES}
            lines.append(
                f"  streaming {_title(mode):<10} first chunk p50 {ms['first_chunk_p50_s']:.1f} ms, p99 "
                f"{ms['first_chunk_p99_s']:.1f} ms; first audio p50 {ms['first_audio_p50_s']:.1f} ms, p99 "
                f"{ms['first_audio_p99_s']:.1f} ms; whole request p50 {summary['p50_s'] * 1e3:.1f} ms"
            )
    if ratio := result.get("ratio_on_off"):
        pairs = ", ".join(f"{x:.2f}" for x in ratio["req_per_s_pairs"])
        lines.append(
            f"  CURVE on / off: throughput {ratio['req_per_s']:.3f}x (round pairs: {pairs}), "
            f"p50 {ratio['p50_s']:.2f}x, p99 {ratio['p99_s']:.2f}x, mesh CPU per request {ratio['cpu_s_per_request']:.3f}x"
        )
    if ratio := result.get("ratio_coordinators"):
        lines.append(f"  {ratio['counts'][0]} / {ratio['counts'][1]} coordinators: throughput {ratio['req_per_s']:.3f}x, "
                     f"p99 {ratio['p99_s']:.2f}x")
    columns = ("queued_s", "transfer_s", "handler_s", "total_s")
    lines.append(f"  {'per stage (medians, ms)':<28}" + "".join(f"{name[:-2]:>10}" for name in columns))
    for mode, summary in result["modes"].items():
        for stage, times in summary["stages"].items():
            cells = [times.get(name, float("nan")) * 1e3 for name in columns]
            lines.append(f"    {stage:<14}{_title(mode):<12}" + "".join(f"{value:10.2f}" for value in cells))
    return "\n".join(lines)
