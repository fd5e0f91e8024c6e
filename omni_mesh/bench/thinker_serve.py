"""`omni-mesh bench thinker`: the thinker stage alone (a mesh whose only stage is the thinker, batching,
text out) against `transformers serve --continuous-batching` on the same weights, in one run.

The server gets a plain Qwen2ForCausalLM with the thinker's language model copied in
(omni_mesh.bench.causal_twin); before any figure, the thinker's one-request path and the twin's
generate() must give the same greedy ids for the prompt, and both servers the same reply text. Both
then answer the same OpenAI chat requests (`/v1/chat/completions`, streamed, usage included) from N
closed-loop clients, in alternating rounds (a shared machine's load drifts: both sides see it), each
with its KV cache bounded: the mesh's `engine.kv_cache_tokens`, the server's paged cache of
`cb_num_blocks` x `cb_block_size` tokens, the same number by default. Figures are medians over rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from omni_mesh import aio
from omni_mesh.bench.http_client import Connection
from omni_mesh.bench.mesh import running_mesh
from omni_mesh.bench.pipeline import WARMUP_S, percentile
from omni_mesh.ports import free_port

READY_TIMEOUT_S = 600.0  # a model loading on a loaded 2-core host
SIDES = ("mesh", "transformers")


def topology(model: Path, threads: int, max_batch: int, kv_tokens: int, clients: int,
             stream_interval: int = 1) -> dict[str, Any]:
    """One stage, the thinker, batching up to `max_batch` within `kv_tokens` of KV cache; final."""
    engine = {"part": "thinker", "model": str(model), "threads": threads, "max_batch": max_batch,
              "kv_cache_tokens": kv_tokens, "stream_interval": stream_interval}
    return {"name": "bench-thinker", "stages": [
        {"stage_id": 0, "name": "thinker", "engine": engine, "final_output": True,
         "max_inflight": max(clients, 2 * max_batch)},
    ]}


@contextlib.contextmanager
def transformers_serve(model: Path, *, threads: int, device: str, num_blocks: int, block_size: int,
                       log: Path) -> Iterator[str]:
    """`transformers serve MODEL --continuous-batching` for the block (its own process group, stopped
    with SIGINT then SIGKILL); its URL. OMP_NUM_THREADS: serve leaves torch at its default thread count."""
    port = free_port()
    command = [sys.executable, "-m", "omni_mesh.bench.hf_serve", str(model), "--continuous-batching",
               "--cb-num-blocks", str(num_blocks), "--cb-block-size", str(block_size), "--device", device,
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                raise RuntimeError(f"transformers serve {model} did not come up (status {process.poll()}):\n{tail}")
            time.sleep(0.3)
        yield url
    finally:
        _stop_group(process)


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    return False


def _stop_group(process: subprocess.Popen) -> None:
    """SIGINT to the server's process group (serve and the engine process it spawned), SIGKILL if it hangs."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def chat(model: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def reply_text(url: str, body: dict) -> str:
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


async def load(url: str, clients: int, duration_s: float, body: dict) -> dict[str, Any]:
    """`clients` closed loops of streamed chat requests for WARMUP_S + duration_s; the figures of the
    requests that end in the last duration_s: tokens (usage.completion_tokens) and requests per second,
    latency and first-token percentiles, errors by status."""
    payload = json.dumps(body).encode()
    latencies: list[float] = []
    first: list[float] = []
    tokens = 0
    errors: dict[str, int] = {}
    measure_from = time.perf_counter() + WARMUP_S
    stop_at = measure_from + duration_s

    async def client() -> None:
        nonlocal tokens
        connection = Connection(url)
        try:
            while (started := time.perf_counter()) < stop_at:
                seen: dict[str, Any] = {}

                def on_data(data: bytes, seen: dict[str, Any] = seen) -> None:
                    if "first" not in seen and b'"content"' in data and _content(data):
                        seen["first"] = time.perf_counter()
                    if b'"usage"' in data and data != b"[DONE]" and (usage := json.loads(data).get("usage")):
                        seen["tokens"] = usage["completion_tokens"]

                try:
                    status, _ = await connection.events("/v1/chat/completions", payload, on_data)
                    outcome = str(status) if status != 200 or "tokens" in seen else "no usage"
                except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
                    outcome = type(exc).__name__
                    connection.close()
                finished = time.perf_counter()
                if not measure_from <= finished <= stop_at:
                    continue
                if outcome != "200":
                    errors[outcome] = errors.get(outcome, 0) + 1
                    continue
                latencies.append(finished - started)
                tokens += seen["tokens"]
                if "first" in seen:
                    first.append(seen["first"] - started)
        finally:
            connection.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return {"tokens_per_s": tokens / duration_s, "req_per_s": len(latencies) / duration_s,
            "p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99),
            "first_token_p50_s": percentile(first, 0.5), "first_token_p99_s": percentile(first, 0.99),
            "errors": errors}


def _content(data: bytes) -> str:
    """A stream chunk's text (parsed only until the first text came: the client's cost stays small)."""
    choices = json.loads(data).get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


def run(
    *, model: str | None, prompt: str, max_tokens: int, clients: list[int], rounds: int, duration_s: float,
    threads: int, device: str, max_batch: int, cb_num_blocks: int, cb_block_size: int, stream_interval: int = 1,
) -> dict[str, Any]:
    from omni_mesh.bench.causal_twin import build_twin, same_greedy_ids

    kv_tokens = cb_num_blocks * cb_block_size  # the same KV budget on both sides
    load_average = [os.getloadavg()]
    runs: dict[str, dict[str, list[dict]]] = {side: {str(n): [] for n in clients} for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="omni-mesh-bench-thinker-") as scratch:
        if model:
            checkpoint = Path(model)
        else:
            from omni_mesh.engines.tiny import build_tiny

            checkpoint = build_tiny("qwen2_5_omni", Path(scratch) / "tiny")
        twin = build_twin(checkpoint, Path(scratch) / "twin")
        greedy = same_greedy_ids(checkpoint, twin, prompt, max_tokens)
        if not greedy["equal"]:
            raise RuntimeError(f"the thinker and its causal twin differ on greedy ids ({greedy}): not the same model")
        path = Path(scratch) / "topology.yaml"
        path.write_text(yaml.safe_dump(topology(checkpoint, threads, max_batch, kv_tokens, max(clients), stream_interval), sort_keys=False))
        with running_mesh(path, ready_timeout_s=READY_TIMEOUT_S) as mesh, transformers_serve(
            twin, threads=threads, device=device, num_blocks=cb_num_blocks, block_size=cb_block_size,
            log=Path(scratch) / "serve.log",
        ) as serve:
            urls = {"mesh": mesh.url, "transformers": serve}
            bodies = {side: chat(served_model(url), prompt, max_tokens, False) for side, url in urls.items()}
            texts = {side: reply_text(urls[side], bodies[side]) for side in SIDES}
            if texts["mesh"] != texts["transformers"]:
                raise RuntimeError(f"the two servers' greedy replies differ: {texts}")
            for index in range(rounds):
                for n in clients:
                    for side in SIDES if index % 2 == 0 else SIDES[::-1]:
                        body = {**bodies[side], "stream": True, "stream_options": {"include_usage": True}}
                        runs[side][str(n)].append(aio.run(load(urls[side], n, duration_s, body)))
                load_average.append(os.getloadavg())
    figures = {side: {n: _medians(loads) for n, loads in per.items()} for side, per in runs.items()}
    return {
        "model": model or "tiny random qwen2_5_omni", "threads": threads, "device": device, "clients": clients,
        "rounds": rounds, "duration_s": duration_s, "max_tokens": max_tokens, "max_batch": max_batch,
        "kv_cache_tokens": kv_tokens, "stream_interval": stream_interval, "cb_num_blocks": cb_num_blocks, "cb_block_size": cb_block_size,
        "greedy_ids_equal": True, "prompt_tokens": greedy["prompt_tokens"], "reply_tokens": len(greedy["thinker"]),
        "load_average": [round(sample[0], 2) for sample in load_average],
        "sides": figures,
        "ratios": {str(n): _ratios(figures["mesh"][str(n)], figures["transformers"][str(n)]) for n in clients},
    }


def _medians(loads: list[dict]) -> dict[str, Any]:
    keys = [key for key in loads[0] if key != "errors"]
    errors: dict[str, int] = {}
    for one in loads:
        for status, count in one["errors"].items():
            errors[status] = errors.get(status, 0) + count
    return {**{key: statistics.median(one[key] for one in loads) for key in keys}, "errors": errors,
            "per_round_tokens_per_s": [round(one["tokens_per_s"]) for one in loads]}


def _ratios(mesh: dict, serve: dict) -> dict[str, float | None]:
    def ratio(a: float, b: float) -> float | None:
        return a / b if b and a == a and b == b else None  # NaN: nothing measured

    return {"tokens_per_s": ratio(mesh["tokens_per_s"], serve["tokens_per_s"]),
            "p99": ratio(mesh["p99_s"], serve["p99_s"]),
            "first_token_p50": ratio(mesh["first_token_p50_s"], serve["first_token_p50_s"])}


def report(result: dict[str, Any]) -> str:
    lines = [
        f"model: {result['model']} ({result['device']}, {result['threads']} torch thread(s) per server); greedy, "
        f"a {result['prompt_tokens']}-token prompt, replies of {result['reply_tokens']} tokens (greedy ids equal)",
        f"mesh: the thinker stage alone, max_batch {result['max_batch']}, kv_cache_tokens {result['kv_cache_tokens']}, "
        f"stream_interval {result['stream_interval']}; "
        f"transformers serve --continuous-batching, {result['cb_num_blocks']} blocks of {result['cb_block_size']}",
        f"{result['rounds']} alternating round(s) of {result['duration_s']:.0f} s per side and client count, streamed "
        f"chat completions; medians; load average (1 min) over the run: {result['load_average']}",
        f"{'clients':>8}  {'server':<13}{'tok/s':>8}{'req/s':>8}{'p50 ms':>8}{'p99 ms':>8}{'first p50':>10}"
        f"{'first p99':>10}",
    ]
    for n in result["clients"]:
        for side in SIDES:
            f = result["sides"][side][str(n)]
            lines.append(f"{n:>8}  {side:<13}{f['tokens_per_s']:>8.0f}{f['req_per_s']:>8.1f}{f['p50_s'] * 1000:>8.0f}"
                         f"{f['p99_s'] * 1000:>8.0f}{f['first_token_p50_s'] * 1000:>8.0f}ms"
                         f"{f['first_token_p99_s'] * 1000:>8.0f}ms"
                         + (f"  errors {f['errors']}" if f["errors"] else ""))
        r = result["ratios"][str(n)]
        shown = ", ".join(f"{key} {value:.2f}x" if value is not None else f"{key} -" for key, value in r.items())
        lines.append(f"{'':>10}mesh / transformers serve: {shown}")
    return "\n".join(lines)
