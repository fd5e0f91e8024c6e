"""`omni-mesh bench engines --clients 1,4,16`: the same 3-stage mesh with its stages batching
(`max_batch: N`: the thinker's and the talker's running batch, code2wav's decodes gathered) and
with `max_batch: 1` (one request at a time), in one run.

For each client count: requests/s (whole requests through the REST front door, closed loop) and the
thinker's generated tokens/s (its `generated_tokens_total` counter over the load, warm-up included);
time to first audio (streamed) at the fewest and the most clients (code2wav gathers whole decodes and
streamed chunks alike); `--text-only` (`modalities: ["text"]`) measures the thinker's side alone.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from omni_mesh import aio
from omni_mesh.bench.engines import topology
from omni_mesh.bench.mesh import running_mesh
from omni_mesh.bench.pipeline import drive

READY_TIMEOUT_S = 600.0  # as `up` waits for engines: a loaded machine takes minutes to load three parts


def batching_topology(model: Path, threads: int, device: str, max_batch: int) -> dict[str, Any]:
    """bench engines' mesh with every stage's `max_batch` (max_inflight follows from it)."""
    spec = topology(model, threads, device)
    for stage in spec["stages"]:
        stage["max_inflight"] = max(8, 2 * max_batch)
        stage["engine"]["max_batch"] = max_batch
    return spec


def run(
    *, model: str | None, params: dict, prompt: str, threads: int, device: str, clients: list[int], max_batch: int,
    duration_s: float, text_only: bool,
) -> dict[str, Any]:
    params = {**params, **({"modalities": ["text"]} if text_only else {})}
    body = {"inputs": {"prompt": prompt}, "params": params, "timeout_s": 120.0}
    sides: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="omni-mesh-bench-batching-") as scratch:
        if model:
            checkpoint = Path(model)
        else:
            from omni_mesh.engines.tiny import build_tiny

            checkpoint = build_tiny("qwen2_5_omni", Path(scratch) / "tiny")
        for batch in (1, max_batch):
            path = Path(scratch) / f"topology-{batch}.yaml"
            path.write_text(yaml.safe_dump(batching_topology(checkpoint, threads, device, batch), sort_keys=False))
            with running_mesh(path, ready_timeout_s=READY_TIMEOUT_S) as mesh:
                loads = {str(n): _load(mesh.url, n, duration_s, body) for n in clients}
                first_audio = {} if text_only else {
                    str(n): _finite(aio.run(drive(mesh.url, n, duration_s, {**body, "stream": True})).get("first_audio_p50_s"))
                    for n in (min(clients), max(clients))
                }
            sides[f"max_batch_{batch}"] = {"max_batch": batch, "clients": loads, "first_audio_s": first_audio}
    return {"model": model or "tiny random qwen2_5_omni", "threads": threads, "device": device,
            "clients": clients, "max_batch": max_batch, "text_only": text_only, "params": params, "sides": sides}


def _load(url: str, clients: int, duration_s: float, body: dict) -> dict[str, Any]:
    before, started = _thinker_tokens(url), time.monotonic()
    figures = aio.run(drive(url, clients, duration_s, body))
    # the counter arrives with the next heartbeat (0.5 s)
    time.sleep(1.0)
    tokens = _thinker_tokens(url) - before
    return {"req_per_s": figures["req_per_s"], "p50_s": figures["p50_s"], "p99_s": figures["p99_s"],
            "tokens_per_s": tokens / (time.monotonic() - 1.0 - started), "errors": figures["errors"]}


def _thinker_tokens(url: str) -> int:
    stages = httpx.get(f"{url}/v1/stages", timeout=10).json()["stages"]
    replicas = next(stage["replicas"] for stage in stages if stage["name"] == "thinker")
    return sum(int(replica.get("counters", {}).get("generated_tokens_total", 0)) for replica in replicas)


def _finite(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def report(result: dict[str, Any]) -> str:
    one, many = result["sides"]["max_batch_1"], result["sides"][f"max_batch_{result['max_batch']}"]
    n = result["max_batch"]
    lines = [
        f"model: {result['model']} ({result['device']}, {result['threads']} torch thread(s) per process); greedy, "
        f"max_tokens={result['params']['max_tokens']}, max_audio_tokens={result['params']['max_audio_tokens']}",
        f"batching: thinker, talker and code2wav with max_batch {n} against max_batch 1 (the same mesh otherwise)"
        + ("; text only (modalities: [text])" if result["text_only"] else ""),
        f"{'clients':>8}{'req/s (1)':>12}{f'req/s ({n})':>12}{'x':>7}{'tok/s (1)':>12}{f'tok/s ({n})':>12}"
        f"{'p99 s (1)':>11}{f'p99 s ({n})':>11}",
    ]
    for clients in result["clients"]:
        a, b = one["clients"][str(clients)], many["clients"][str(clients)]
        ratio = b["req_per_s"] / a["req_per_s"] if a["req_per_s"] else float("nan")
        lines.append(f"{clients:>8}{a['req_per_s']:>12.2f}{b['req_per_s']:>12.2f}{ratio:>6.2f}x{a['tokens_per_s']:>12.0f}"
                     f"{b['tokens_per_s']:>12.0f}{a['p99_s']:>11.2f}{b['p99_s']:>11.2f}")
    for side in (one, many):
        for clients, value in side["first_audio_s"].items():
            shown = f"{value * 1000:.0f} ms" if value is not None else "none measured"
            lines.append(f"time to first audio, {clients} client(s), max_batch {side['max_batch']}: {shown}")
    errors = {f"{key}, {c} clients": load["errors"] for key, side in result["sides"].items()
              for c, load in side["clients"].items() if load["errors"]}
    if errors:
        lines.append(f"errors: {errors}")
    return "\n".join(lines)
