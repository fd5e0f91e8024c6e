"""The demo pipeline's stage handlers, driven directly in-process (no runtime, no connectors)."""

from __future__ import annotations

import asyncio
import base64
import inspect
import io
import wave
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from services import omni_demo
from services.omni_demo import stages
from services.omni_demo.audio import GROUP_SECONDS
from services.omni_demo.model import CODEBOOK_SIZE, CODES_PER_TOKEN, HIDDEN_SIZE

PROMPT = "Hello there, how is the weather?"


@dataclass
class Ctx:
    params: dict = field(default_factory=dict)
    request_id: str = "req-1"
    stage: str = "test"
    replica: str = "test-0"


async def stream(chunks: Iterable[dict]) -> AsyncIterator[dict]:
    """Feed a fixed list of chunks to code2wav the way the runtime would: one at a time, async."""
    for chunk in chunks:
        await asyncio.sleep(0)
        yield chunk


async def collect(agen: AsyncIterator[dict]) -> list[dict]:
    return [chunk async for chunk in agen]


async def run_pipeline(prompt: str, **params: Any) -> tuple[dict, list[dict], dict]:
    ctx = Ctx(params=params)
    thought = await stages.thinker({"prompt": prompt}, ctx)
    chunks = await collect(stages.talker(thought, ctx))
    result = await stages.code2wav(stream(chunks), ctx)
    return thought, chunks, result


def read_wav(result: dict) -> tuple[Any, np.ndarray]:
    with wave.open(io.BytesIO(base64.b64decode(result["audio_wav_base64"])), "rb") as wav:
        return wav.getparams(), np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")


async def test_thinker_output_shapes_and_text() -> None:
    out = await stages.thinker({"prompt": PROMPT}, Ctx())
    assert set(out) == {"text", "hidden_states", "prompt"}
    assert out["prompt"] == PROMPT
    assert PROMPT in out["text"]
    hidden = out["hidden_states"]
    assert hidden.dtype == torch.bfloat16
    assert not hidden.is_inference()  # downstream may modify it in place
    assert hidden.shape == (len(out["text"].encode()), HIDDEN_SIZE)
    assert torch.isfinite(hidden.float()).all() and hidden.float().std() > 0.1


async def test_thinker_is_deterministic_and_prompt_dependent() -> None:
    a = await stages.thinker({"prompt": PROMPT}, Ctx())
    b = await stages.thinker({"prompt": PROMPT}, Ctx())
    c = await stages.thinker({"prompt": PROMPT + "!"}, Ctx())
    assert a["text"] == b["text"]
    assert torch.equal(a["hidden_states"], b["hidden_states"])
    assert not torch.equal(a["hidden_states"][:8], c["hidden_states"][:8])  # same reply prefix, other context


async def test_thinker_max_tokens_caps_reply() -> None:
    long_prompt = "word " * 100
    default = await stages.thinker({"prompt": long_prompt}, Ctx())
    assert default["hidden_states"].shape[0] == stages.DEFAULT_MAX_TOKENS
    capped = await stages.thinker({"prompt": long_prompt}, Ctx(params={"max_tokens": 5}))
    assert capped["hidden_states"].shape[0] == 5
    assert capped["text"] == "You s"


async def test_thinker_cap_inside_multibyte_character_keeps_text_and_tokens_aligned() -> None:
    out = await stages.thinker({"prompt": "héllo"}, Ctx(params={"max_tokens": 13}))  # cap splits 'é'
    assert out["text"] == 'You said: "h'
    assert out["hidden_states"].shape[0] == len(out["text"].encode())


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        ({}, "prompt"),
        ({"text": "hi"}, "prompt"),
        ({"prompt": ""}, "empty"),
        ({"prompt": "   "}, "empty"),
        ({"prompt": 42}, "must be a string, got int"),
        ({"prompt": None}, "must be a string, got NoneType"),
        ("just a string", "prompt"),
    ],
)
async def test_thinker_rejects_bad_prompt(inputs: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        await stages.thinker(inputs, Ctx())


@pytest.mark.parametrize("value", [0, -3, "8", 2.5, True])
async def test_bad_params_are_rejected(value: Any) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        await stages.thinker({"prompt": PROMPT}, Ctx(params={"max_tokens": value}))
    thought = await stages.thinker({"prompt": PROMPT}, Ctx())
    with pytest.raises(ValueError, match="chunk_tokens"):
        await collect(stages.talker(thought, Ctx(params={"chunk_tokens": value})))


async def test_talker_streams_ordered_chunks() -> None:
    thought = await stages.thinker({"prompt": PROMPT}, Ctx())
    tokens = thought["hidden_states"].shape[0]
    chunks = await collect(stages.talker(thought, Ctx(params={"chunk_tokens": 5})))
    assert [c["seq"] for c in chunks] == list(range(-(-tokens // 5)))
    assert [c["final"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[0]["text"] == thought["text"]
    assert all("text" not in c for c in chunks[1:])
    for chunk in chunks:
        assert chunk["codes"].dtype == torch.int64
        assert not chunk["codes"].is_inference()  # downstream may modify it in place
        assert chunk["codes"].dim() == 2 and chunk["codes"].shape[1] == CODES_PER_TOKEN
        assert 1 <= chunk["codes"].shape[0] <= 5
    codes = torch.cat([c["codes"] for c in chunks])
    assert codes.shape == (tokens, CODES_PER_TOKEN)
    assert codes.min() >= 0 and codes.max() < CODEBOOK_SIZE
    assert len(codes.unique()) > CODEBOOK_SIZE // 2  # codes actually vary with the hidden states


async def test_talker_is_deterministic_and_chunking_independent() -> None:
    thought = await stages.thinker({"prompt": PROMPT}, Ctx())
    a = torch.cat([c["codes"] for c in await collect(stages.talker(thought, Ctx()))])
    small_chunks = await collect(stages.talker(thought, Ctx(params={"chunk_tokens": 3})))
    b = torch.cat([c["codes"] for c in small_chunks])
    assert torch.equal(a, b)


async def test_talker_yields_control_between_chunks() -> None:
    thought = await stages.thinker({"prompt": PROMPT}, Ctx())
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = ticks
    chunks = await collect(stages.talker(thought, Ctx(params={"chunk_tokens": 2})))
    done.set()
    await task
    assert ticks - start >= len(chunks) - 1


async def test_talker_with_empty_hidden_states_sends_one_final_chunk() -> None:
    thought = {"text": "", "hidden_states": torch.zeros(0, HIDDEN_SIZE, dtype=torch.bfloat16)}
    chunks = await collect(stages.talker(thought, Ctx()))
    assert len(chunks) == 1 and chunks[0]["final"] and chunks[0]["codes"].shape == (0, CODES_PER_TOKEN)
    result = await stages.code2wav(stream(chunks), Ctx())
    assert result["duration_s"] == 0.0 and result["codes"] == 0
    params, _ = read_wav(result)
    assert params.nframes == 0


async def test_talker_rejects_bad_hidden_states() -> None:
    with pytest.raises(ValueError, match="hidden_states"):
        await collect(stages.talker({"text": "x"}, Ctx()))
    with pytest.raises(ValueError, match=r"\[tokens, 3584\], got \(4, 16\)"):
        await collect(stages.talker({"hidden_states": torch.zeros(4, 16)}, Ctx()))


async def test_pipeline_produces_playable_wav() -> None:
    thought, chunks, result = await run_pipeline(PROMPT)
    tokens = thought["hidden_states"].shape[0]
    assert set(result) == {"text", "sample_rate", "audio_wav_base64", "duration_s", "codes"}
    assert result["text"] == thought["text"]
    assert result["sample_rate"] == 24000
    assert result["codes"] == tokens * CODES_PER_TOKEN
    assert result["duration_s"] == pytest.approx(tokens * GROUP_SECONDS)
    params, pcm = read_wav(result)
    assert (params.nchannels, params.sampwidth, params.framerate) == (1, 2, 24000)
    assert params.nframes / params.framerate == pytest.approx(result["duration_s"])
    assert np.abs(pcm).max() > 8000  # clearly audible
    assert np.abs(pcm).max() < 32767  # and never clipped
    rms = np.sqrt(np.mean(pcm.astype(np.float64) ** 2))
    assert rms > 2000


async def test_pipeline_is_deterministic() -> None:
    _, _, a = await run_pipeline(PROMPT, chunk_tokens=4)
    _, _, b = await run_pipeline(PROMPT, chunk_tokens=16)
    assert a == b


async def test_code2wav_consumes_talker_stream_directly() -> None:
    ctx = Ctx(params={"chunk_tokens": 3})
    thought = await stages.thinker({"prompt": PROMPT}, ctx)
    streamed = await stages.code2wav(stages.talker(thought, ctx), ctx)
    _, _, buffered = await run_pipeline(PROMPT, chunk_tokens=3)
    assert streamed == buffered


async def test_code2wav_accepts_single_unstreamed_chunk() -> None:
    _, chunks, _ = await run_pipeline(PROMPT, chunk_tokens=1000)
    assert len(chunks) == 1
    result = await stages.code2wav(chunks[0], Ctx())
    assert result["codes"] == chunks[0]["codes"].numel()


async def test_code2wav_raises_on_gap() -> None:
    _, chunks, _ = await run_pipeline(PROMPT, chunk_tokens=4)
    assert len(chunks) >= 3
    with pytest.raises(ValueError, match="expected seq=1, got seq=2"):
        await stages.code2wav(stream([chunks[0], *chunks[2:]]), Ctx())


async def test_code2wav_raises_on_reorder_missing_final_and_extra_chunk() -> None:
    _, chunks, _ = await run_pipeline(PROMPT, chunk_tokens=4)
    with pytest.raises(ValueError, match="expected seq=0, got seq=1"):
        await stages.code2wav(stream([chunks[1], chunks[0], *chunks[2:]]), Ctx())
    with pytest.raises(ValueError, match="without a final chunk"):
        await stages.code2wav(stream(chunks[:-1]), Ctx())
    extra = {"seq": len(chunks), "codes": chunks[0]["codes"], "final": True}
    with pytest.raises(ValueError, match="after the final chunk"):
        await stages.code2wav(stream([*chunks, extra]), Ctx())


async def test_code2wav_rejects_bad_codes() -> None:
    bad = {"seq": 0, "codes": torch.full((2, CODES_PER_TOKEN), CODEBOOK_SIZE), "final": True}
    with pytest.raises(ValueError, match="seq=0: codes must lie in"):
        await stages.code2wav(stream([bad]), Ctx())
    floats = {"seq": 0, "codes": torch.zeros(2, CODES_PER_TOKEN), "final": True}
    with pytest.raises(ValueError, match="integer tensor"):
        await stages.code2wav(stream([floats]), Ctx())


def test_handlers_exported_under_topology_names() -> None:
    assert omni_demo.thinker is stages.thinker
    assert omni_demo.talker is stages.talker
    assert omni_demo.code2wav is stages.code2wav
    assert inspect.iscoroutinefunction(stages.thinker)
    assert inspect.isasyncgenfunction(stages.talker)
    assert inspect.iscoroutinefunction(stages.code2wav)
