"""`omni-mesh bench pipeline`: N concurrent clients against a mesh for T seconds, over HTTP.

Reports requests per second, p50/p99 latency, errors by status, and the per-stage breakdown the
coordinator returns with each response (time queued for a replica, time in connectors, time in the
handler). With --topology it starts the mesh with `omni-mesh up` for the run and stops it after.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import httpx

from omni_mesh import aio
from omni_mesh.launcher import free_port


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Connection:
    """A minimal HTTP/1.1 keep-alive client for the load loop.

    A general client (httpx) spends about 5 ms of CPU per request here, more than the mesh it
    measures, so on a 2-core machine it would benchmark itself. This one only POSTs JSON and reads a
    Content-Length response, which is all the coordinator sends for non-streaming requests.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the coordinator closed the connection")
        status = int(status_line.split()[1])
        length = None
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if length is None:
            raise ConnectionError("response without Content-Length")
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _drive(url: str, concurrency: int, duration_s: float, body: dict) -> dict[str, Any]:
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    stage_times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    target = httpx.URL(url)
    payload = json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=url, timeout=body["timeout_s"] + 5.0) as client:
        await client.post("/v1/requests", json=body)  # warm-up: first-request costs are not the mesh's
    stop_at = time.perf_counter() + duration_s

    async def client_loop() -> None:
        connection = _Connection(target.host, target.port or 80)
        try:
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                try:
                    status, raw = await asyncio.wait_for(connection.post("/v1/requests", payload), body["timeout_s"] + 5)
                except (OSError, ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
                    statuses[type(exc).__name__] += 1
                    connection.close()
                    connection = _Connection(target.host, target.port or 80)
                    continue
                latencies.append(time.perf_counter() - started)
                statuses[str(status)] += 1
                if status == 200:
                    for stage, times in json.loads(raw).get("timings", {}).items():
                        for name, value in times.items():
                            stage_times[stage][name].append(value)
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    ok = statuses.get("200", 0)
    return {
        "url": url,
        "concurrency": concurrency,
        "duration_s": elapsed,
        "requests": sum(statuses.values()),
        "ok": ok,
        "errors": {status: n for status, n in statuses.items() if status != "200"},
        "req_per_s": ok / elapsed if elapsed else 0.0,
        "p50_s": percentile(latencies, 0.50),
        "p99_s": percentile(latencies, 0.99),
        "stages": {
            stage: {name: statistics.median(values) for name, values in times.items()}
            for stage, times in stage_times.items()
        },
    }


@contextlib.contextmanager
def _mesh(topology: str) -> Iterator[str]:
    """Run `omni-mesh up TOPOLOGY` for the duration of the block; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "omni_mesh", "up", topology, "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"omni-mesh up {topology} exited with status {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready", timeout=1.0).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"omni-mesh up {topology} was not ready within 60 s")
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run(
    *,
    url: str | None,
    topology: str | None,
    concurrency: int,
    duration_s: float,
    inputs: dict,
    params: dict,
    timeout_s: float,
) -> dict[str, Any]:
    body = {"inputs": inputs, "params": params, "timeout_s": timeout_s}
    if url:
        return aio.run(_drive(url, concurrency, duration_s, body))
    assert topology is not None
    with _mesh(topology) as started_url:
        result = aio.run(_drive(started_url, concurrency, duration_s, body))
    result["topology"] = topology
    return result


def report(result: dict[str, Any]) -> str:
    errors = ", ".join(f"{status}: {n}" for status, n in result["errors"].items()) or "none"
    lines = [
        f"{result['url']}  {result['concurrency']} concurrent clients for {result['duration_s']:.1f} s",
        f"  {result['req_per_s']:.1f} req/s   p50 {result['p50_s'] * 1e3:.1f} ms   p99 {result['p99_s'] * 1e3:.1f} ms"
        f"   {result['ok']} ok, errors: {errors}",
        "  per stage (medians, ms):   queued  transfer   handler     total",
    ]
    for stage, times in result["stages"].items():
        cells = [times.get(name, float("nan")) * 1e3 for name in ("queued_s", "transfer_s", "handler_s", "total_s")]
        lines.append(f"    {stage:<22}" + "".join(f"{value:10.2f}" for value in cells))
    return "\n".join(lines)
