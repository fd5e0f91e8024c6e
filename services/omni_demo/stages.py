"""Stage handlers of the demo omni pipeline: Thinker -> Talker -> Code2Wav, shaped like Qwen-Omni.

The payloads have the real pipeline's shapes and dtypes (bfloat16 hidden states of width 3584,
int64 codec codes streamed in chunks, a 24 kHz waveform) but the networks are a tiny seeded toy
(see ``model.py``): the reply text is a template that echoes the prompt, and the "speech" is a
sequence of pentatonic tones chosen by the codec codes (see ``audio.py``). Everything is
deterministic: the same prompt and params give the same text, tensors and WAV bytes.

How the reply streams. The Talker streams: first the transcript (the Thinker's text, with its token
counts), then the codec codes chunk by chunk. Code2Wav turns each chunk into audio as it arrives.
When the client reads a stream, Code2Wav streams too: a chunk with the transcript as soon as it
arrives, then one chunk of 16-bit PCM per Talker chunk. So the text reaches the client first, riding
the same one-way path as the audio (no stage output goes to the client except the final stage's).
Otherwise Code2Wav answers once, with the text and the whole WAV.

Request params read here: ``max_tokens`` (reply token cap, Thinker), ``chunk_tokens`` (tokens per
streamed chunk, Talker), ``decode_delay_s`` (seconds the Talker spends per token, standing in for a
real talker's decode time so the streaming can be watched; 0 by default) and ``stream`` (true: the
client reads a stream; the runtime's ``ctx.stream`` overrides it where the runtime sets one).
Bad inputs or params raise ``InvalidInput`` (a ValueError), which names the field.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_mesh.errors import InvalidInput
from services.omni_demo.audio import SAMPLE_RATE, pcm16_bytes, synthesize, wav_base64
from services.omni_demo.model import CODES_PER_TOKEN, HIDDEN_SIZE, encode_text, get_model, reply_text

DEFAULT_MAX_TOKENS = 64
DEFAULT_CHUNK_TOKENS = 8
CONTEXT_TOKENS = 2048  # the toy's context window: longer prompts contribute only their tail
MAX_DECODE_DELAY_S = 1.0  # per token: more would make a demo reply take minutes


def _params(ctx: Any) -> dict:
    return getattr(ctx, "params", None) or {}


def _param_int(ctx: Any, name: str, default: int) -> int:
    """A positive int request param, or ``default`` when the request does not set it."""
    value = _params(ctx).get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInput(f"param {name!r} must be a positive integer, got {value!r}")
    return value


def _decode_delay_s(ctx: Any) -> float:
    value = _params(ctx).get("decode_delay_s", 0.0)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not 0 <= value <= MAX_DECODE_DELAY_S:
        raise InvalidInput(f"param 'decode_delay_s' must be a number of seconds in [0, {MAX_DECODE_DELAY_S}], got {value!r}")
    return float(value)


def _client_streams(ctx: Any) -> bool:
    """Whether the client reads a stream: the runtime's ``ctx.stream`` where it has one, else ``params.stream``."""
    stream = getattr(ctx, "stream", None)
    return (_params(ctx).get("stream") if stream is None else stream) is True


def _prompt(inputs: Any) -> str:
    if not isinstance(inputs, dict) or "prompt" not in inputs:
        raise InvalidInput('inputs.prompt: missing; the demo needs a "prompt" string, e.g. {"prompt": "Hello"}')
    prompt = inputs["prompt"]
    if not isinstance(prompt, str):
        raise InvalidInput(f"inputs.prompt: must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise InvalidInput("inputs.prompt: is empty; send some text to reply to")
    return prompt


def _run_thinker(
    prompt: str, max_tokens: int, empty: Callable[..., torch.Tensor]
) -> tuple[str, torch.Tensor, dict, str]:
    """Reply text, the bfloat16 hidden states of its tokens (conditioned on the prompt), token counts.

    The hidden states are converted straight into `empty(shape, dtype)`: with the runtime's
    `ctx.empty` that is the outgoing edge's memory, so sending them copies nothing more.
    """
    text, reply_tokens = reply_text(prompt, max_tokens)
    context = encode_text(prompt)[-CONTEXT_TOKENS:]
    hidden = get_model().hidden_states(context + reply_tokens)[len(context) :]
    usage = {"prompt_tokens": len(context), "completion_tokens": len(reply_tokens)}
    output = empty(tuple(hidden.shape), torch.bfloat16)
    output.copy_(hidden)  # the float32 -> bfloat16 conversion writes into it; nothing writes after
    # "length" when max_tokens cut the reply (OpenAI's finish_reason), else "stop"
    finish_reason = "stop" if reply_tokens == reply_text(prompt, sys.maxsize)[1] else "length"
    return text, output, usage, finish_reason


def _output_allocator(ctx: Any) -> Callable[..., torch.Tensor]:
    """`ctx.empty` where the runtime offers it (omni-mesh does), else ordinary tensors."""
    empty = getattr(ctx, "empty", None)
    return empty if callable(empty) else lambda shape, dtype: torch.empty(shape, dtype=dtype)


async def thinker(inputs: dict, ctx: Any) -> dict:
    """``{"prompt": str}`` -> ``{"text", "hidden_states": bf16 [tokens, 3584], "prompt", "usage", "finish_reason"}``."""
    prompt = _prompt(inputs)
    max_tokens = _param_int(ctx, "max_tokens", DEFAULT_MAX_TOKENS)
    # A worker thread keeps the event loop free for the replica's other in-flight requests; ctx.empty
    # runs there too (the pool may grow, which takes a moment).
    text, hidden, usage, finish = await asyncio.to_thread(_run_thinker, prompt, max_tokens, _output_allocator(ctx))
    return {"text": text, "hidden_states": hidden, "prompt": prompt, "usage": usage, "finish_reason": finish}


def _hidden_states(inputs: Any) -> torch.Tensor:
    if not isinstance(inputs, dict) or "hidden_states" not in inputs:
        raise ValueError('talker inputs need the thinker output dict with "hidden_states"')
    hidden = inputs["hidden_states"]
    if isinstance(hidden, np.ndarray):
        hidden = torch.from_numpy(hidden)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != HIDDEN_SIZE:
        shape = tuple(hidden.shape) if hasattr(hidden, "shape") else type(hidden).__name__
        raise ValueError(f"talker hidden_states must be a tensor [tokens, {HIDDEN_SIZE}], got {shape}")
    return hidden


async def talker(inputs: dict, ctx: Any) -> AsyncIterator[dict]:
    """Thinker output -> the transcript, then the codec codes, as a stream of chunks.

    Chunk 0 is ``{"seq": 0, "text", "usage", "finish_reason", "codes": [0, 4], "final"}``: the transcript goes first, so
    the client can show it while the audio is being made. Then ``{"seq": n, "codes", "final"}`` with
    int64 codes ``[<= chunk_tokens, 4]``, one code-group per reply token; exactly one chunk is final.
    """
    hidden = _hidden_states(inputs)
    chunk_tokens = _param_int(ctx, "chunk_tokens", DEFAULT_CHUNK_TOKENS)
    delay_s = _decode_delay_s(ctx)
    starts = range(0, hidden.shape[0], chunk_tokens)
    transcript: dict[str, Any] = {"seq": 0, "text": inputs.get("text", "")}
    for name in ("usage", "finish_reason"):
        if name in inputs:
            transcript[name] = inputs[name]
    yield {**transcript, "codes": torch.zeros(0, CODES_PER_TOKEN, dtype=torch.int64), "final": not starts}
    model = get_model()
    for seq, start in enumerate(starts, 1):
        rows = hidden[start : start + chunk_tokens]
        # Also lets the runtime ship the previous chunk before this one is computed.
        await asyncio.sleep(delay_s * rows.shape[0])
        yield {"seq": seq, "codes": model.codec_codes(rows), "final": seq == len(starts)}


async def _chunks(inputs: Any) -> AsyncIterator[dict]:
    """The Talker's chunks whichever way they come: a stream, a list, or one non-streamed dict."""
    if isinstance(inputs, dict):
        yield inputs
    elif isinstance(inputs, AsyncIterable):
        async for chunk in inputs:
            yield chunk
    elif isinstance(inputs, Iterable):
        for chunk in inputs:
            yield chunk
    else:
        kind = type(inputs).__name__
        raise TypeError(f"code2wav inputs must be an async iterator of talker chunks, got {kind}")


def _chunk_codes(chunk: dict, seq: int) -> np.ndarray:
    codes = chunk.get("codes")
    if isinstance(codes, torch.Tensor):
        codes = codes.cpu().numpy()
    if not isinstance(codes, np.ndarray) or not np.issubdtype(codes.dtype, np.integer):
        kind = getattr(codes, "dtype", type(codes).__name__)
        raise ValueError(f"talker chunk seq={seq}: 'codes' must be an integer tensor, got {kind}")
    if codes.ndim == 1 and codes.size % CODES_PER_TOKEN == 0:
        codes = codes.reshape(-1, CODES_PER_TOKEN)  # tolerate flattened code-groups
    return codes.astype(np.int64, copy=False)


@dataclass
class _Transcript:
    text: str
    usage: dict | None
    finish_reason: str | None = None


@dataclass
class _Sound:
    samples: np.ndarray  # float32 in [-1, 1]
    codes: int  # how many codes made them


async def _pieces(inputs: Any) -> AsyncIterator[_Transcript | _Sound]:
    """The Talker's stream, checked, as what the client reads and hears: a chunk's transcript as soon
    as it arrives (before its codes are synthesised), then each chunk's audio.

    Chunks must come in seq order 0, 1, 2, ... and the stream must end with exactly one ``final`` chunk.
    """
    expected, finished = 0, False
    async for chunk in _chunks(inputs):
        seq = chunk.get("seq") if isinstance(chunk, dict) else None
        if finished:
            raise ValueError(f"talker chunk seq={seq} arrived after the final chunk seq={expected - 1}")
        if isinstance(seq, bool) or seq != expected:
            raise ValueError(f"talker chunk gap or reorder: expected seq={expected}, got seq={seq!r}")
        if "text" in chunk:
            yield _Transcript(chunk["text"], chunk.get("usage"), chunk.get("finish_reason"))
        codes = _chunk_codes(chunk, seq)
        if codes.size:
            try:
                yield _Sound(synthesize(codes), int(codes.size))
            except ValueError as exc:
                raise ValueError(f"talker chunk seq={seq}: {exc}") from None
        finished, expected = bool(chunk.get("final")), expected + 1
    if not finished:
        raise ValueError(f"talker stream ended after {expected} chunk(s) without a final chunk")


async def _audio_stream(inputs: Any) -> AsyncIterator[dict]:
    """``{"text", "audio_pcm16", "sample_rate"}`` chunks (plus ``usage`` beside the transcript):
    the transcript in the first, then each Talker chunk's audio as 16-bit little-endian mono PCM."""
    async for piece in _pieces(inputs):
        if isinstance(piece, _Transcript):
            chunk = {"text": piece.text, "audio_pcm16": b"", "sample_rate": SAMPLE_RATE}
            if piece.usage is not None:
                chunk["usage"] = piece.usage
            if piece.finish_reason is not None:
                chunk["finish_reason"] = piece.finish_reason
            yield chunk
        else:
            yield {"text": "", "audio_pcm16": pcm16_bytes(piece.samples), "sample_rate": SAMPLE_RATE}


async def _whole_audio(inputs: Any) -> dict:
    """``{"text", "sample_rate", "audio_wav_base64", "duration_s", "codes", "usage", "finish_reason"}`` once
    the stream ends."""
    text, usage, finish, sounds, codes = "", None, "stop", [np.zeros(0, np.float32)], 0
    async for piece in _pieces(inputs):
        if isinstance(piece, _Transcript):
            text, usage, finish = piece.text, piece.usage, piece.finish_reason or "stop"
        else:
            sounds.append(piece.samples)
            codes += piece.codes
    samples = np.concatenate(sounds)
    return {
        "text": text,
        "sample_rate": SAMPLE_RATE,
        "audio_wav_base64": wav_base64(samples),
        "duration_s": len(samples) / SAMPLE_RATE,
        "codes": codes,
        "usage": usage,
        "finish_reason": finish,
    }


def code2wav(inputs: Any, ctx: Any) -> AsyncIterator[dict] | Coroutine[Any, Any, dict]:
    """Talker chunk stream -> audio, synthesised chunk by chunk as the codes arrive.

    A client reading a stream gets chunks (an async generator: see ``_audio_stream``); any other
    gets one output (a coroutine: see ``_whole_audio``). The runtime tells them apart by what this
    call returns.
    """
    return _audio_stream(inputs) if _client_streams(ctx) else _whole_audio(inputs)
