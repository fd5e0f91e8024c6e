"""Qwen2.5-Omni's streaming token2wav (`ChunkedDecode`), and the streamed chunks of several requests
decoded in one token2wav call (`ChunkedDecode.feed_many`, code2wav's stream Gather: omni_mesh.engines.gather)."""

from __future__ import annotations

import torch

from omni_mesh.engines.qwen2_5_omni import Token2Wav
from omni_mesh.engines.token2wav_batch import decode_many


class ChunkedDecode:
    """Streaming token2wav as far as its reference allows: its DiT decodes a whole sequence from noise,
    so each chunk is decoded with up to `context` codes before it (decoded again, their audio cut off)
    from noise of its own. The audio differs from the one-shot decode (boundaries are not seamless);
    the non-streamed reply is the one equal to generate()'s."""

    def __init__(self, token2wav: Token2Wav, speaker: str | None, seed: int | None, context: int) -> None:
        self.token2wav = token2wav
        self.speaker = speaker
        self.seed = seed
        self.context = context
        self.codes = torch.zeros(0, dtype=torch.int64)
        self.chunks = 0

    def feed(self, codes: torch.Tensor) -> torch.Tensor:
        return self.feed_many([(self, codes)])[0]

    def finish(self) -> torch.Tensor:
        return torch.zeros(0)

    @staticmethod
    def feed_many(items: list[tuple[ChunkedDecode, torch.Tensor | None]]) -> list[torch.Tensor]:
        """Each (stream, codes)'s `feed(codes)` (codes None: its `finish()`), every window in one
        token2wav call (`token2wav_batch.decode_many`: any lengths, each row from its own seed)."""
        windows = [stream._window(codes) for stream, codes in items if codes is not None]
        if not windows:
            return [torch.zeros(0) for _ in items]
        token2wav = items[0][0].token2wav
        wavs = iter(decode_many(token2wav, [(codes, speaker, seed) for codes, speaker, seed, _ in windows]))
        cuts = iter(cut for *_, cut in windows)
        return [torch.zeros(0) if codes is None else next(wavs)[next(cuts) * token2wav.samples_per_code :]
                for _, codes in items]

    def _window(self, codes: torch.Tensor) -> tuple[torch.Tensor, str | None, int | None, int]:
        """The codes to decode for a new chunk (its context first), their speaker and seed, and how many
        of them (the context) to cut off the audio."""
        done = len(self.codes)
        self.codes = torch.cat([self.codes, codes.reshape(-1).to(torch.int64)])
        start = max(0, done - self.context)
        seed = None if self.seed is None else self.seed + self.chunks
        self.chunks += 1
        return self.codes[start:], self.speaker, seed, done - start
