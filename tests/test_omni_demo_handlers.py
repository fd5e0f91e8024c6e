"""The demo pipeline's stage handlers, driven directly in-process (no runtime, no connectors).

Besides what each handler computes: the Talker streams the transcript first and then the codes,
paced by `decode_delay_s`; Code2Wav answers once, or, when the client reads a stream, passes the
transcript on at once and turns each Talker chunk into audio as it arrives.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import io
import time
import wave
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from omni_mesh.errors import InvalidInput
from services import omni_demo
from services.omni_demo import stages
from services.omni_demo.audio import GROUP_SAMPLES, GROUP_SECONDS, SAMPLE_RATE
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
    assert set(out) == {"text", "hidden_states", "prompt", "usage", "finish_reason"}
    assert out["prompt"] == PROMPT
    assert out["usage"] == {"prompt_tokens": len(PROMPT.encode()), "completion_tokens": len(out["text"].encode())}
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
    assert (default["finish_reason"], capped["finish_reason"]) == ("length", "length")  # max_tokens cut both
    whole = await stages.thinker({"prompt": "hi"}, Ctx())
    assert whole["finish_reason"] == "stop" and whole["text"] == 'You said: "hi".'


async def test_thinker_cap_inside_multibyte_character_keeps_text_and_tokens_aligned() -> None:
    out = await stages.thinker({"prompt": "héllo"}, Ctx(params={"max_tokens": 13}))  # cap splits 'é'
    assert out["text"] == 'You said: "h'
    assert out["hidden_states"].shape[0] == len(out["text"].encode())
    assert out["finish_reason"] == "length"  # the cap fell inside a character: cut all the same


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
    with pytest.raises(InvalidInput, match=match):
        await stages.thinker(inputs, Ctx())


@pytest.mark.parametrize("value", [0, -3, "8", 2.5, True])
async def test_bad_params_are_rejected(value: Any) -> None:
    with pytest.raises(InvalidInput, match="max_tokens"):
        await stages.thinker({"prompt": PROMPT}, Ctx(params={"max_tokens": value}))
    thought = await stages.thinker({"prompt": PROMPT}, Ctx())
    with pytest.raises(InvalidInput, match="chunk_tokens"):
        await collect(stages.talker(thought, Ctx(params={"chunk_tokens": value})))


async def test_talker_streams_the_transcript_then_ordered_code_chunks() -> None:
    thought = await stages.thinker({"prompt": PROMPT}, Ctx())
    tokens = thought["hidden_states"].shape[0]
    chunks = await collect(stages.talker(thought, Ctx(params={"chunk_tokens": 5})))
    assert [c["seq"] for c in chunks] == list(range(1 + -(-tokens // 5)))
    assert [c["final"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[0]["text"] == thought["text"] and chunks[0]["usage"] == thought["usage"]
    assert chunks[0]["codes"].shape == (0, CODES_PER_TOKEN)  # the transcript goes out before any code
    assert all("text" not in c for c in chunks[1:])
    for chunk in chunks[1:]:
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
    assert result["duration_s"] == 0.0 and result["codes"] == 0 and result["text"] == ""
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
    assert set(result) == {"text", "sample_rate", "audio_wav_base64", "duration_s", "codes", "usage", "finish_reason"}
    assert result["text"] == thought["text"] and result["usage"] == thought["usage"]
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


async def test_code2wav_accepts_single_unstreamed_chunk_with_text_and_codes() -> None:
    _, chunks, whole = await run_pipeline(PROMPT, chunk_tokens=1000)
    assert len(chunks) == 2
    single = {**chunks[0], "codes": chunks[1]["codes"], "final": True}
    result = await stages.code2wav(single, Ctx())
    assert result == whole


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


async def test_handlers_exported_under_topology_names() -> None:
    assert omni_demo.thinker is stages.thinker
    assert omni_demo.talker is stages.talker
    assert omni_demo.code2wav is stages.code2wav
    assert inspect.iscoroutinefunction(stages.thinker)
    assert inspect.isasyncgenfunction(stages.talker)
    # code2wav answers once or streams, as the client reads: the runtime looks at what the call returns.
    whole, streamed = stages.code2wav([], Ctx()), stages.code2wav([], Ctx(params={"stream": True}))
    assert inspect.iscoroutine(whole) and inspect.isasyncgen(streamed)
    whole.close()
    await streamed.aclose()


# ------------------------------------------------------------------ streaming to the client


@dataclass
class RuntimeCtx(Ctx):
    """A context from a runtime that says itself whether the client reads a stream."""

    stream: bool = False


def pcm_of(chunks: list[dict]) -> np.ndarray:
    return np.frombuffer(b"".join(c["audio_pcm16"] for c in chunks), dtype="<i2")


async def test_code2wav_streams_the_transcript_first_then_audio_per_talker_chunk() -> None:
    ctx = Ctx(params={"stream": True, "chunk_tokens": 4})
    thought, talked, whole = await run_pipeline(PROMPT, chunk_tokens=4)
    chunks = await collect(stages.code2wav(stream(talked), ctx))
    assert len(chunks) == len(talked)  # the transcript, then one audio chunk per code chunk
    first, rest = chunks[0], chunks[1:]
    assert first == {
        "text": thought["text"], "audio_pcm16": b"", "sample_rate": SAMPLE_RATE, "usage": thought["usage"],
        "finish_reason": thought["finish_reason"],
    }
    for chunk, codes in zip(rest, [c["codes"] for c in talked[1:]], strict=True):
        assert chunk["text"] == "" and chunk["sample_rate"] == SAMPLE_RATE
        assert len(chunk["audio_pcm16"]) == 2 * GROUP_SAMPLES * codes.shape[0]
    _, wav_pcm = read_wav(whole)
    assert np.array_equal(pcm_of(chunks), wav_pcm)  # the same audio as the one-piece answer


async def test_runtime_stream_flag_overrides_the_param() -> None:
    _, talked, _ = await run_pipeline(PROMPT)
    streamed = stages.code2wav(stream(talked), RuntimeCtx(stream=True))
    assert inspect.isasyncgen(streamed)
    assert len(await collect(streamed)) == len(talked)
    whole = stages.code2wav(stream(talked), RuntimeCtx(params={"stream": True}, stream=False))
    assert inspect.iscoroutine(whole)
    assert (await whole)["text"]


async def test_code2wav_passes_each_piece_on_before_the_next_talker_chunk_exists() -> None:
    """Progressive for real: each output chunk leaves Code2Wav while the Talker still holds the next."""
    _, talked, _ = await run_pipeline(PROMPT, chunk_tokens=4)
    released = 0
    more = asyncio.Event()

    async def gated() -> AsyncIterator[dict]:
        nonlocal released
        for chunk in talked:
            released += 1
            yield chunk
            await more.wait()  # the next chunk comes only once the test has seen this one's output
            more.clear()

    out = stages.code2wav(gated(), Ctx(params={"stream": True}))
    for index in range(len(talked)):
        chunk = await anext(out)
        assert released == index + 1, f"output chunk {index} needed talker chunk {released}"
        assert bool(chunk["text"]) == (index == 0) and bool(chunk["audio_pcm16"]) == (index > 0)
        more.set()
    with pytest.raises(StopAsyncIteration):
        await anext(out)


async def test_decode_delay_paces_the_talker_after_the_transcript() -> None:
    thought = await stages.thinker({"prompt": PROMPT}, Ctx())
    tokens = thought["hidden_states"].shape[0]
    # The transcript waits for no decoding, not even a token's (0.5 s here). It comes in about 0.1 ms; a
    # 5 ms bound failed 2 runs in 200 beside two busy loops on 2 cores (15 ms at worst), a quarter second holds.
    talk = stages.talker(thought, Ctx(params={"chunk_tokens": 8, "decode_delay_s": 0.5}))
    started = time.perf_counter()
    first = await anext(talk)
    took = time.perf_counter() - started
    await talk.aclose()
    assert first["seq"] == 0 and first["text"] and took < 0.25, took
    delay = 0.01
    started, arrivals = time.perf_counter(), []
    async for _ in stages.talker(thought, Ctx(params={"chunk_tokens": 8, "decode_delay_s": delay})):
        arrivals.append(time.perf_counter() - started)
    assert arrivals[-1] >= tokens * delay * 0.9
    assert arrivals[1] < arrivals[-1] / 2  # the first codes come long before the last


@pytest.mark.parametrize("value", [-0.1, 5, "0.1", True, float("nan")])
async def test_bad_decode_delay_is_rejected(value: Any) -> None:
    thought = await stages.thinker({"prompt": PROMPT}, Ctx())
    with pytest.raises(InvalidInput, match="decode_delay_s"):
        await collect(stages.talker(thought, Ctx(params={"decode_delay_s": value})))


def test_invalid_input_is_a_value_error() -> None:
    assert issubclass(InvalidInput, ValueError)  # callers that catch ValueError keep working
