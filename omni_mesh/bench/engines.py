"""`omni-mesh bench engines`: the library's one-call generate() in one process against the same
checkpoint split across a mesh (thinker -> talker -> code2wav over shared memory), in one run.

The monolithic reference answers requests one after another (a one-process model serves one request
at a time, so its requests/s is the same for 1 and 4 clients); its time to first audio is its whole
latency (generate() returns the audio at the end). The mesh is measured through its REST front door,
the whole path: time to first audio of streamed requests, whole-request latency, and requests/s with 1
and 4 concurrent clients. Medians; a tiny random checkpoint by default (--model for any other)."""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from omni_mesh import aio
from omni_mesh.bench.mesh import running_mesh
from omni_mesh.bench.pipeline import drive


def topology(model: Path, threads: int, device: str, *, encoder: bool = False) -> dict[str, Any]:
    """compose/qwen2_5_omni.yaml's graph on `model`, every stage with `threads` torch threads; without
    `encoder`, the thinker is the entry stage (it encodes any media itself)."""
    parts = ["encoder", "thinker", "talker", "code2wav"] if encoder else ["thinker", "talker", "code2wav"]
    stages: list[dict[str, Any]] = []
    for index, part in enumerate(parts):
        stage = {"stage_id": index, "name": part, "engine": {"part": part, "model": str(model), "device": device,
                                                             "threads": threads}, "max_inflight": 4}
        if index:
            stage["engine_input_source"] = [index - 1]
        stages.append(stage)
    stages[-1]["final_output"] = True
    return {"name": "bench-engines", "stages": stages}


def monolithic(model: Path, prompt: str, params: dict, threads: int, device: str) -> Any:
    """generate() in this process: a function that runs one request and returns its latency."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    from omni_mesh.engines.qwen2_5_omni import Talker

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    reference = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(model)).to(device).eval()
    talker = Talker(reference.talker, reference.config)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"].to(device)

    def once() -> float:
        started = time.perf_counter()
        torch.manual_seed(params["seed"])
        reference.generate(
            ids, thinker_max_new_tokens=params["max_tokens"], thinker_do_sample=False, talker_do_sample=False,
            talker_max_new_tokens=params["max_audio_tokens"], talker_eos_token_id=talker.stop_ids,
            talker_logits_processor=talker.logits_processor(),
        )
        return time.perf_counter() - started

    once()  # first call: lazy initialisation, not timed
    return once


def run(
    *, model: str | None, prompt: str, max_tokens: int, max_audio_tokens: int, rounds: int, duration_s: float,
    threads: int, device: str,
) -> dict[str, Any]:
    params = {"temperature": 0, "seed": 0, "max_tokens": max_tokens, "max_audio_tokens": max_audio_tokens}
    with tempfile.TemporaryDirectory(prefix="omni-mesh-bench-engines-") as scratch:
        checkpoint = Path(model) if model else _tiny(Path(scratch) / "tiny")
        once = monolithic(checkpoint, prompt, params, threads, device)
        # Half the monolithic requests before the mesh runs and half after: a shared machine's load
        # changes over a run, and both sides should see the same.
        latencies = [once() for _ in range((rounds + 1) // 2)]
        path = Path(scratch) / "topology.yaml"
        path.write_text(yaml.safe_dump(topology(checkpoint, threads, device), sort_keys=False))
        body = {"inputs": {"prompt": prompt}, "params": params, "timeout_s": 120.0}
        with running_mesh(path) as mesh:
            streamed = aio.run(drive(mesh.url, 1, duration_s, {**body, "stream": True}))
            one = aio.run(drive(mesh.url, 1, duration_s, body))
            four = aio.run(drive(mesh.url, 4, duration_s, body))
        latencies += [once() for _ in range(rounds // 2)]
    latency = statistics.median(latencies)
    reference = {"latency_s": latency, "req_per_s": 1.0 / latency, "rounds": len(latencies)}
    mesh_figures = {
        "first_audio_s": _measured(streamed.get("first_audio_p50_s")),
        "latency_s": one["p50_s"],
        "req_per_s_1": one["req_per_s"],
        "req_per_s_4": four["req_per_s"],
        "latency_s_4": four["p50_s"],
        "errors": {**streamed["errors"], **one["errors"], **four["errors"]},
    }
    first_audio = mesh_figures["first_audio_s"]
    return {
        "model": model or "tiny random qwen2_5_omni",
        "params": params,
        "threads": threads,
        "device": device,
        "monolithic": reference,
        "mesh": mesh_figures,
        "first_audio_vs_monolithic_latency": first_audio / reference["latency_s"] if first_audio else None,
        "req_per_s_4_vs_monolithic": mesh_figures["req_per_s_4"] / reference["req_per_s"],
    }


def _tiny(directory: Path) -> Path:
    from omni_mesh.engines.tiny import build_tiny

    return build_tiny("qwen2_5_omni", directory)


def report(result: dict[str, Any]) -> str:
    mono, mesh = result["monolithic"], result["mesh"]
    params = result["params"]
    first = mesh["first_audio_s"]
    lines = [
        f"model: {result['model']} ({result['device']}, {result['threads']} torch thread(s) per process); "
        f"greedy, max_tokens={params['max_tokens']}, max_audio_tokens={params['max_audio_tokens']}",
        f"{'':34}{'monolithic generate()':>22}{'mesh (3 stages, REST)':>24}",
        f"{'time to first audio (median)':34}{mono['latency_s'] * 1000:>19.0f} ms"
        + (f"{first * 1000:>21.0f} ms" if first else f"{'-':>24}"),
        f"{'whole-request latency (median)':34}{mono['latency_s'] * 1000:>19.0f} ms{mesh['latency_s'] * 1000:>21.0f} ms",
        f"{'requests/s, 1 client':34}{mono['req_per_s']:>22.2f}{mesh['req_per_s_1']:>24.2f}",
        f"{'requests/s, 4 clients':34}{mono['req_per_s']:>22.2f}{mesh['req_per_s_4']:>24.2f}",
        "",
        f"mesh first audio / monolithic latency: {result['first_audio_vs_monolithic_latency']:.0%}"
        if result["first_audio_vs_monolithic_latency"] is not None else "mesh first audio: none measured",
        f"mesh requests/s at 4 clients / monolithic: {result['req_per_s_4_vs_monolithic']:.2f}x",
        "(monolithic: one process, requests one after another, so 4 clients wait their turn; its first audio "
        "is its whole latency. mesh: the whole path through its REST front door, streamed for first audio)",
    ]
    if mesh["errors"]:
        lines.append(f"mesh errors: {mesh['errors']}")
    return "\n".join(lines)


def _measured(value: float | None) -> float | None:
    """A figure, or None where nothing was measured (no streamed request ended inside the window gives a
    NaN median, which would read as a figure)."""
    return None if value is None or math.isnan(value) else value
