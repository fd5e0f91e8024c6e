"""A tiny, seeded stand-in for the Qwen-Omni Thinker and Talker networks.

Nothing here is trained: the weights are drawn once from a fixed seed, so the model produces
deterministic tensors of the right shapes and dtypes (hidden size 3584, like Qwen2.5-Omni-7B) at a
cost of a few milliseconds on a CPU. It exercises the pipeline's data paths; it does not model
language. The reply text is therefore produced by a template in ``reply_text``, not by the model.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

HIDDEN_SIZE = 3584  # Qwen2.5-Omni-7B thinker hidden size: the payload shape the pipeline must carry
VOCAB_SIZE = 256  # byte-level tokens
MODEL_DIM = 64  # everything except the output projection stays tiny to keep CPU cost low
NUM_LAYERS = 2
CODES_PER_TOKEN = 4  # codec codebooks per token (one code-group per token)
CODEBOOK_SIZE = 16
DEFAULT_SEED = 20240611


def encode_text(text: str) -> list[int]:
    """Byte-level tokenizer: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def decode_tokens(tokens: list[int]) -> str:
    """Inverse of ``encode_text``; drops a multi-byte character cut in half by truncation."""
    return bytes(tokens).decode("utf-8", errors="ignore")


def reply_text(prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    """The Thinker's reply: a fixed template echoing the prompt, capped at ``max_tokens`` tokens.

    Returns the text and its tokens; they always agree, even when the cap falls inside a
    multi-byte character.
    """
    text = decode_tokens(encode_text(f'You said: "{prompt}".')[:max_tokens])
    return text, encode_text(text)


def _sinusoidal_positions(length: int, dim: int) -> torch.Tensor:
    """Fixed position signal so the same byte at different places gets different hidden states."""
    pos = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


class ToyOmniModel:
    """Embedding, two residual MLP layers with causal context mixing, and two output heads.

    Weights come from a private ``torch.Generator`` so building the model never disturbs the
    process-wide RNG and always yields the same weights for the same seed.
    """

    def __init__(self, seed: int = DEFAULT_SEED) -> None:
        gen = torch.Generator().manual_seed(seed)

        def init(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) / math.sqrt(shape[0])

        self.seed = seed
        self.embedding = torch.randn(VOCAB_SIZE, MODEL_DIM, generator=gen)
        self.layers = [
            (init(2 * MODEL_DIM, 4 * MODEL_DIM), init(4 * MODEL_DIM, MODEL_DIM)) for _ in range(NUM_LAYERS)
        ]
        self.to_hidden = init(MODEL_DIM, HIDDEN_SIZE)
        self.to_codes = init(HIDDEN_SIZE, CODES_PER_TOKEN * CODEBOOK_SIZE)

    def hidden_states(self, tokens: list[int]) -> torch.Tensor:
        """float32 ``[len(tokens), HIDDEN_SIZE]``; row i depends on tokens[: i + 1] only (causal)."""
        with torch.inference_mode():
            ids = torch.tensor(tokens, dtype=torch.long)
            x = self.embedding[ids] + _sinusoidal_positions(len(tokens), MODEL_DIM)
            counts = torch.arange(1, len(tokens) + 1, dtype=torch.float32).unsqueeze(1)
            for w_in, w_out in self.layers:
                context = x.cumsum(0) / counts  # running mean: cheap causal attention stand-in
                update = F.gelu(torch.cat([x, context], dim=1) @ w_in) @ w_out
                x = F.layer_norm(x + update, (MODEL_DIM,))
        # Last op outside inference mode: callers get an ordinary tensor they may modify in place.
        return x @ self.to_hidden

    def codec_codes(self, hidden: torch.Tensor) -> torch.Tensor:
        """int64 ``[tokens, CODES_PER_TOKEN]``, values in ``[0, CODEBOOK_SIZE)``: a code-group per token."""
        with torch.inference_mode():
            logits = hidden.to(torch.float32) @ self.to_codes
        return logits.view(hidden.shape[0], CODES_PER_TOKEN, CODEBOOK_SIZE).argmax(dim=-1)  # ordinary tensor


_model: ToyOmniModel | None = None
_model_lock = threading.Lock()


def get_model() -> ToyOmniModel:
    """The process-wide model, built on first use (stage processes that never call it pay nothing)."""
    global _model
    if _model is None:
        with _model_lock:  # handlers may call this from worker threads at the same time
            if _model is None:
                _model = ToyOmniModel()
    return _model
