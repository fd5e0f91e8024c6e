"""Stage handlers of the demo omni pipeline: Thinker -> Talker -> Code2Wav, shaped like Qwen-Omni.

The payloads have the real pipeline's shapes and dtypes (bfloat16 hidden states of width 3584,
int64 codec codes streamed in chunks, a 24 kHz waveform) but the networks are a tiny seeded toy
(see ``model.py``): the reply text is a template that echoes the prompt, and the "speech" is a
sequence of pentatonic tones chosen by the codec codes (see ``audio.py``). Everything is
deterministic: the same prompt and params give the same text, tensors and WAV bytes.

Request params read here: ``max_tokens`` (reply token cap, Thinker) and ``chunk_tokens`` (tokens per
streamed chunk, Talker).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

import numpy as np
import torch

from services.omni_demo.audio import SAMPLE_RATE, synthesize, wav_base64
from services.omni_demo.model import CODES_PER_TOKEN, HIDDEN_SIZE, encode_text, get_model, reply_text

DEFAULT_MAX_TOKENS = 64
DEFAULT_CHUNK_TOKENS = 8
CONTEXT_TOKENS = 2048  # the toy's context window: longer prompts contribute only their tail


def _param_int(ctx: Any, name: str, default: int) -> int:
    """A positive int request param, or ``default`` when the request does not set it."""
    value = (getattr(ctx, "params", None) or {}).get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"param {name!r} must be a positive integer, got {value!r}")
    return value


def _prompt(inputs: Any) -> str:
    if not isinstance(inputs, dict) or "prompt" not in inputs:
        raise ValueError('thinker inputs need a "prompt" string, e.g. {"prompt": "Hello"}')
    prompt = inputs["prompt"]
    if not isinstance(prompt, str):
        raise ValueError(f'thinker input "prompt" must be a string, got {type(prompt).__name__}')
    if not prompt.strip():
        raise ValueError('thinker input "prompt" is empty; send some text to reply to')
    return prompt


def _run_thinker(prompt: str, max_tokens: int) -> tuple[str, torch.Tensor]:
    """Reply text and the bfloat16 hidden states of its tokens, conditioned on the prompt."""
    text, reply_tokens = reply_text(prompt, max_tokens)
    context = encode_text(prompt)[-CONTEXT_TOKENS:]
    hidden = get_model().hidden_states(context + reply_tokens)[len(context) :]
    return text, hidden.to(torch.bfloat16)


async def thinker(inputs: dict, ctx: Any) -> dict:
    """``{"prompt": str}`` -> ``{"text": str, "hidden_states": bf16 [tokens, 3584], "prompt": str}``."""
    prompt = _prompt(inputs)
    max_tokens = _param_int(ctx, "max_tokens", DEFAULT_MAX_TOKENS)
    # A worker thread keeps the event loop free for the replica's other in-flight requests.
    text, hidden = await asyncio.to_thread(_run_thinker, prompt, max_tokens)
    return {"text": text, "hidden_states": hidden, "prompt": prompt}


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
    """Thinker output -> stream of ``{"seq", "codes", "text" (seq 0 only), "final"}`` chunks.

    ``codes`` is int64 ``[<= chunk_tokens, 4]``: one code-group per reply token.

    Codes are computed chunk by chunk, so Code2Wav starts synthesising before the Talker is done.
    """
    hidden = _hidden_states(inputs)
    text = inputs.get("text", "")
    chunk_tokens = _param_int(ctx, "chunk_tokens", DEFAULT_CHUNK_TOKENS)
    starts = range(0, hidden.shape[0], chunk_tokens) or range(1)  # an empty reply still ends the stream
    model = get_model()
    for seq, start in enumerate(starts):
        if seq:
            await asyncio.sleep(0)  # let the runtime ship the previous chunk before computing the next
        chunk: dict[str, Any] = {"seq": seq, "codes": model.codec_codes(hidden[start : start + chunk_tokens])}
        if seq == 0:
            chunk["text"] = text
        chunk["final"] = seq == len(starts) - 1
        yield chunk


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


async def code2wav(inputs: Any, ctx: Any) -> dict:
    """Talker chunk stream -> ``{"text", "sample_rate", "audio_wav_base64", "duration_s", "codes"}``.

    Each chunk is turned into samples as it arrives; chunks must come in seq order 0, 1, 2, ...
    and the stream must end with exactly one ``final`` chunk.
    """
    text, pieces, n_codes, expected, finished = "", [], 0, 0, False
    async for chunk in _chunks(inputs):
        seq = chunk.get("seq") if isinstance(chunk, dict) else None
        if finished:
            raise ValueError(f"talker chunk seq={seq} arrived after the final chunk seq={expected - 1}")
        if isinstance(seq, bool) or seq != expected:
            raise ValueError(f"talker chunk gap or reorder: expected seq={expected}, got seq={seq!r}")
        if seq == 0:
            text = chunk.get("text", "")
        codes = _chunk_codes(chunk, seq)
        try:
            pieces.append(synthesize(codes))
        except ValueError as exc:
            raise ValueError(f"talker chunk seq={seq}: {exc}") from None
        n_codes += int(codes.size)
        finished, expected = bool(chunk.get("final")), expected + 1
    if not finished:
        raise ValueError(f"talker stream ended after {expected} chunk(s) without a final chunk")
    samples = np.concatenate(pieces)
    return {
        "text": text,
        "sample_rate": SAMPLE_RATE,
        "audio_wav_base64": wav_base64(samples),
        "duration_s": len(samples) / SAMPLE_RATE,
        "codes": n_codes,
    }
