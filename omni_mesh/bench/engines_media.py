"""`omni-mesh bench engines --inputs audio|image|video` (or several, `text,audio,image,video`): requests
with media through one checkpoint split across a mesh, with the encoder stage (encoder -> thinker ->
talker -> code2wav) and without it (the thinker encodes the media itself), every kind on the same two
meshes, in one run.

For each kind, each mesh answers `rounds` streamed requests one at a time with new media (every one a
cache miss), then `rounds` with the same media again (after the first, cache hits), through its REST
front door. Figures are medians: time to the first text and to the first audio, the whole request, and
the encoder stage's own handler time (its requests/s on one replica is the inverse: it does nothing
else). Text has no media: its "new" and "repeated" are the same request."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from omni_mesh import aio
from omni_mesh.bench.engines import _tiny, topology
from omni_mesh.bench.media_inputs import content
from omni_mesh.bench.mesh import running_mesh
from omni_mesh.bench.pipeline import _streamed

READY_TIMEOUT_S = 300.0  # four stages load a model each, on a machine perhaps busy with other work
SIDES = {"with_encoder": True, "without_encoder": False}


def run(
    *, inputs: list[str], model: str | None, prompt: str, max_tokens: int, max_audio_tokens: int, rounds: int,
    threads: int, device: str,
) -> dict[str, Any]:
    """`inputs`: the kinds measured, in order, on each mesh. The result has, per side, per kind, the
    medians of `new` and `repeated` requests, and per kind the encoder stage's requests/s."""
    params = {"temperature": 0, "seed": 0, "max_tokens": max_tokens, "max_audio_tokens": max_audio_tokens}
    result: dict[str, Any] = {
        "inputs": list(inputs), "model": model or "tiny random qwen2_5_omni", "params": params, "rounds": rounds,
        "threads": threads, "device": device,
    }
    with tempfile.TemporaryDirectory(prefix="omni-mesh-bench-engines-") as scratch:
        checkpoint = Path(model) if model else _tiny(Path(scratch) / "tiny")
        for side, encoder in SIDES.items():
            path = Path(scratch) / f"{side}.yaml"
            path.write_text(yaml.safe_dump(topology(checkpoint, threads, device, encoder=encoder), sort_keys=False))
            with running_mesh(path, ready_timeout_s=READY_TIMEOUT_S) as mesh:
                result[side] = {kind: aio.run(_measure(mesh.url, kind, prompt, params, rounds)) for kind in inputs}
    result["encoder_req_per_s"] = {
        kind: {which: 1.0 / figures[which]["encoder_s"] if figures[which]["encoder_s"] else None
               for which in ("new", "repeated")}
        for kind, figures in result["with_encoder"].items()
    }
    return result


async def _measure(url: str, kind: str, prompt: str, params: dict, rounds: int) -> dict[str, Any]:
    """Medians of `rounds` requests with new media (numbered from 1), and of `rounds` with media 0 again."""
    async with httpx.AsyncClient(base_url=url, timeout=300.0) as client:
        await _one(client, kind, rounds + 1, prompt, params)  # the mesh's first request (imports, pools): not timed
        new = [await _one(client, kind, n + 1, prompt, params) for n in range(rounds)]
        await _one(client, kind, 0, prompt, params)  # media 0 encoded once: the requests below find it cached
        repeated = [await _one(client, kind, 0, prompt, params) for _ in range(rounds)]
    return {"new": _medians(new), "repeated": _medians(repeated)}


async def _one(client: httpx.AsyncClient, kind: str, n: int, prompt: str, params: dict) -> dict[str, float | None]:
    body = {"inputs": {"messages": [{"role": "user", "content": content(kind, n, prompt)}]}, "params": params,
            "timeout_s": 240.0, "stream": True}
    marks: dict[str, float] = {}
    started = time.perf_counter()
    status, done = await _streamed(client, body, marks)
    if status != 200:
        raise RuntimeError(f"a request with {kind} failed: HTTP {status} {done[:300]!r}")
    timings = json.loads(done or b"{}").get("timings", {})
    return {
        "first_text_s": marks["chunk"] - started if "chunk" in marks else None,
        "first_audio_s": marks["audio"] - started if "audio" in marks else None,
        "latency_s": time.perf_counter() - started,
        "encoder_s": (timings.get("encoder") or {}).get("handler_s"),
    }


def _medians(samples: list[dict[str, float | None]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in samples[0]:
        known = [s[key] for s in samples if s[key] is not None]
        out[key] = statistics.median(known) if known else None
    return out


def report(result: dict[str, Any]) -> str:
    params = result["params"]
    lines = [
        f"inputs: {', '.join(result['inputs'])}; model: {result['model']} ({result['device']}, {result['threads']} "
        f"torch thread(s) per process); greedy, max_tokens={params['max_tokens']}, "
        f"max_audio_tokens={params['max_audio_tokens']}; medians of {result['rounds']} streamed requests one at a time",
    ]
    for kind in result["inputs"]:
        lines += ["", *_report_kind(kind, result)]
    return "\n".join(lines)


def _report_kind(kind: str, result: dict[str, Any]) -> list[str]:
    sides = [result["with_encoder"][kind], result["without_encoder"][kind]]

    def ms(value: float | None) -> str:
        return f"{value * 1000:>9.0f} ms" if value is not None else f"{'-':>12}"

    lines = [
        f"{kind:26}{'with the encoder stage':>26}{'thinker encodes itself':>26}",
        f"{'':26}{'new media':>12}{'repeated':>14}{'new media':>12}{'repeated':>14}",
    ]
    for title, key in (("time to first text", "first_text_s"), ("time to first audio", "first_audio_s"),
                       ("whole request", "latency_s")):
        lines.append(f"{title:26}" + "".join(f"{ms(side[which][key])}{'':2}" for side in sides for which in ("new", "repeated")))
    rates = result["encoder_req_per_s"][kind]
    lines.append(
        f"encoder stage: {rates['new'] or 0:.1f} requests/s with new {kind}, {rates['repeated'] or 0:.1f} with repeated "
        "(one replica: 1 / its median handler time)"
    )
    for name, side in zip(("with the encoder stage", "thinker encodes itself"), sides, strict=True):
        new, again = side["new"]["first_text_s"], side["repeated"]["first_text_s"]
        if kind != "text" and new and again:
            lines.append(f"the cache on a repeated {kind}, {name}: first text {again / new:.0%} of a new one's")
    return lines
