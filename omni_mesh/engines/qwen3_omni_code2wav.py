"""Qwen3-Omni's code2wav alone (int64 [T, G] codes in, 24 kHz float32 waveform out), and its exact
streaming decode: the transformer runs on its KV cache and only the convolutions re-read frames."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omni_mesh.engines.checkpoint import load_part
from omni_mesh.engines.qwen3_omni import REFERENCE_CHUNK_FRAMES, load_config


class Qwen3OmniCode2Wav:
    """code2wav alone: int64 [T, G] codes in, 24 kHz float32 waveform out, in the part's dtype (generate()
    runs it in the model's dtype and returns float)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.num_quantizers = int(model.config.num_quantizers)
        self.samples_per_frame = int(model.total_upsample)
        self.conv = _ConvGeometry(model)
        # requests decoded in one call at most (code2wav's Gather): on a CPU a batch saves nothing (its
        # convolutions already run over thousands of samples a frame) and costs more than the same decodes one
        # by one once its activations leave the caches (tiny model, 25-frame chunks: 8 streams 148 ms either
        # way, 16 streams 780 ms against 320 ms; whole 200-frame decodes, 4: 480 ms against 350 ms); one a
        # call also lets a stream's first chunk (served first) wait for one short decode, not a batch of them
        self.call_batch = 1 if model.device.type == "cpu" else None

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: str) -> Qwen3OmniCode2Wav:
        config = load_config(model_dir)
        return cls(load_part(Qwen3OmniMoeCode2Wav, config.code2wav_config, Path(model_dir), "code2wav.",
                             dtype=dtype, device=device))

    def frames(self, codes: torch.Tensor) -> torch.Tensor:
        """`codes` as int64 [T, G] (one frame [G] is taken as [1, G]); ValueError for any other shape."""
        codes = torch.as_tensor(codes)
        if codes.dim() == 1 and len(codes) == self.num_quantizers:
            codes = codes.unsqueeze(0)
        if codes.dim() != 2 or codes.shape[1] != self.num_quantizers:
            raise ValueError(f"Qwen3-Omni code2wav: codes must be int64 [frames, {self.num_quantizers}], "
                             f"got shape {tuple(codes.shape)}")
        return codes.to(torch.long)

    def _codes(self, codes: torch.Tensor) -> torch.Tensor:
        """[T, G] codes as the model takes them: [1, G, T] on its device."""
        return self.frames(codes).to(self.model.device).T.unsqueeze(0)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """float32 [samples] of `codes`. Up to 300 frames this is generate()'s decode (one forward);
        past that generate() decodes 300-frame chunks and loses samples at each boundary, where this
        decodes exactly (the stream, 300 frames at a time, memory bounded)."""
        if len(codes) == 0:
            return torch.zeros(0)
        if len(codes) <= REFERENCE_CHUNK_FRAMES:
            return self.model(self._codes(codes)).reshape(-1).float().cpu()
        stream = self.stream(chunk_frames=REFERENCE_CHUNK_FRAMES)
        return torch.cat([stream.feed(codes), stream.finish()])

    @torch.no_grad()
    def decode_many(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        """decode() of each codes in `batch`: those of up to 300 frames in one forward, right-padded to the
        longest. code2wav is causal (a causal transformer, causal convolutions), so a row's samples never
        read the padding after it: each equals its own decode() to float rounding. Longer ones alone."""
        out: list[torch.Tensor] = [torch.zeros(0)] * len(batch)
        short = []
        for i, codes in enumerate(batch):
            if 0 < len(codes) <= REFERENCE_CHUNK_FRAMES:
                short.append(i)
            else:
                out[i] = self.decode(codes)
        if short:
            frames = [self.frames(batch[i]) for i in short]
            width = max(len(f) for f in frames)
            padded = torch.stack([torch.cat([f, f.new_zeros(width - len(f), f.shape[1])]) for f in frames])
            wav = self.model(padded.to(self.model.device).transpose(1, 2)).reshape(len(short), -1).float().cpu()
            for i, f, row in zip(short, frames, wav, strict=True):
                out[i] = row[: self.conv.output_length(len(f))]
        return out

    def stream(self, *, chunk_frames: int = 25, left_context: int | None = None) -> Code2WavStream:
        """Streaming decode: `chunk_frames` new frames per decode; `left_context` frames of the
        transformer's output decoded again before them (default: the fewest that reproduce the one-shot
        decode, `exact_left_context`)."""
        return Code2WavStream(self, chunk_frames, self.exact_left_context if left_context is None else left_context)

    @property
    def exact_left_context(self) -> int:
        return self.conv.left_context()


class Code2WavStream:
    """Decodes codes as they come, reproducing the one-shot decode (to float rounding).

    code2wav is a sliding-window causal transformer, then causal convolutions and transposed
    convolutions (these look one input step ahead, so a decode of T frames yields T * 1920 - loss
    samples, the tail needing frames not yet seen). The reference streaming decodes each chunk with
    25 frames of left context and cuts the context's audio off: it drops the `loss` samples at every
    boundary, and 25 frames do not cover the transformer's reach (layers x (window - 1) frames).
    Here the transformer runs incrementally with its KV cache (exact, and no frame goes through it
    twice), and only the convolutions see a left context: `left_context` frames of the transformer's
    output before the new ones, enough for every sample not yet emitted. Each decode emits the samples
    from where the last one stopped, so nothing is dropped and nothing repeats.
    """

    def __init__(self, code2wav: Qwen3OmniCode2Wav, chunk_frames: int, left_context: int) -> None:
        # fewer frames than the samples a decode cannot yield yet would leave gaps in the audio
        least = -(-code2wav.conv.loss // code2wav.samples_per_frame)
        if chunk_frames < 1 or left_context < least:
            raise ValueError(f"Qwen3-Omni code2wav stream: chunk_frames must be >= 1 and left_context >= {least} "
                             f"(exact: >= {code2wav.exact_left_context}), got {chunk_frames} and {left_context}")
        from transformers import DynamicCache

        self.code2wav = code2wav
        self.chunk_frames = chunk_frames
        self.left_context = left_context
        self.cache = DynamicCache(config=code2wav.model.config)
        self.pending = torch.zeros(0, code2wav.num_quantizers, dtype=torch.long)
        self.hidden: torch.Tensor | None = None  # the transformer's output for the last frames: [1, C, T]
        self.frames = 0  # frames through the transformer
        self.emitted = 0  # samples returned

    def feed(self, codes: torch.Tensor) -> torch.Tensor:
        """New samples (float32): decodes once `chunk_frames` frames are pending."""
        return self.feed_many([(self, codes)])[0]

    def finish(self) -> torch.Tensor:
        """The rest of the audio (what the frames still pending make)."""
        return self.feed_many([(self, None)])[0]

    @staticmethod
    @torch.no_grad()
    def feed_many(items: list[tuple[Code2WavStream, torch.Tensor | None]]) -> list[torch.Tensor]:
        """Each (stream, codes)'s `feed(codes)` (codes None: its `finish()`) with the convolutions of every
        stream that decodes in one call (`_ConvGeometry.run_many`, where a decode spends nearly all its
        time); each stream's transformer steps on its own KV cache (their lengths differ)."""
        out = [torch.zeros(0) for _ in items]
        decoding: list[tuple[int, Code2WavStream, torch.Tensor, int]] = []
        for i, (stream, codes) in enumerate(items):
            if codes is not None:
                stream.pending = torch.cat([stream.pending, stream.code2wav.frames(codes).cpu()])
            if len(stream.pending) >= (1 if codes is None else stream.chunk_frames):
                decoding.append((i, stream, *stream._transform()))
        if decoding:
            wavs = decoding[0][1].code2wav.conv.run_many([hidden for _, _, hidden, _ in decoding])
            for (i, stream, _, first), wav in zip(decoding, wavs, strict=True):
                out[i] = stream._emit(wav.reshape(-1), first)
        return out

    def _transform(self) -> tuple[torch.Tensor, int]:
        """The pending frames through the transformer (on its KV cache): what the convolutions decode
        ([1, C, frames]: `left_context` frames before the new ones) and the absolute frame it starts at."""
        model = self.code2wav.model
        codes, self.pending = self.code2wav._codes(self.pending), self.pending[:0]
        embeds = model.code_embedding(codes + model.code_offset).mean(1)
        new = model.pre_transformer(inputs_embeds=embeds, cache=self.cache, use_cache=True).last_hidden_state
        new = new.permute(0, 2, 1)  # [1, C, frames]
        done = self.frames
        self.frames += new.shape[-1]
        hidden = new if self.hidden is None else torch.cat([self.hidden, new], dim=-1)
        start = self.frames - hidden.shape[-1]  # the absolute frame hidden[..., 0] is
        first = max(start, done - self.left_context)
        self.hidden = hidden[..., max(0, hidden.shape[-1] - self.left_context) :]
        return hidden[..., first - start :], first

    def _emit(self, wav: torch.Tensor, first: int) -> torch.Tensor:
        """The samples of `wav` (decoded from absolute frame `first` on) not returned yet."""
        fresh = wav[max(0, self.emitted - first * self.code2wav.samples_per_frame) :]
        self.emitted += len(fresh)
        return fresh.float().cpu()


class _ConvGeometry:
    """code2wav after its transformer (upsampling blocks, decoder): runs it, and works out from its layers
    how many samples a decode yields and which frames each sample depends on."""

    def __init__(self, model: Any) -> None:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeCausalConvNet,
            Qwen3OmniMoeCausalTransConvNet,
        )

        self.model = model
        self.samples_per_frame = int(model.total_upsample)
        kinds = (Qwen3OmniMoeCausalConvNet, Qwen3OmniMoeCausalTransConvNet)
        # modules() walks each block in the order its forward() runs its layers
        self.layers = [m for part in (model.upsample, model.decoder) for m in part.modules()
                       if isinstance(m, kinds)]
        for layer in self.layers:
            if isinstance(layer, Qwen3OmniMoeCausalConvNet) and layer.stride != 1:
                raise ValueError("Qwen3-Omni code2wav: a strided causal convolution; its streaming geometry is unknown")
        self.transposed = Qwen3OmniMoeCausalTransConvNet
        #: samples a decode of n frames yields fewer than n * samples_per_frame (the same for every n)
        self.loss = self.samples_per_frame - self.output_length(1)

    def run_many(self, hiddens: list[torch.Tensor]) -> list[torch.Tensor]:
        """The waveform [1, 1, samples_i] of each transformer output [1, C, frames_i]: the upsampling blocks row by row (their linear layers round a
        row differently beside other rows; at 4 steps a frame they are the cheap part), the decoder (at
        1920 samples a frame, nearly all the time) in one call, right-padded to the longest: it is causal,
        so a row's own samples never read the padding after it (cut to output_length()). On a CPU without
        oneDNN, whose convolutions round a row differently with other rows or padding beside it; torch's
        own compute each row alike (a row equals its decode alone bit for bit; as fast on the tiny model)."""
        with _native_convolutions(hiddens[0].device):
            upsampled = [self._upsample(hidden) for hidden in hiddens]
            width = max(u.shape[-1] for u in upsampled)
            wav = torch.cat([torch.nn.functional.pad(u, (0, width - u.shape[-1])) for u in upsampled])
            for block in self.model.decoder:
                wav = block(wav)
        wav = wav.clamp(min=-1, max=1)
        return [row[..., : self.output_length(h.shape[-1])].unsqueeze(0) for h, row in zip(hiddens, wav, strict=True)]

    def _upsample(self, hidden: torch.Tensor) -> torch.Tensor:
        for blocks in self.model.upsample:
            for block in blocks:
                hidden = block(hidden)
        return hidden

    def output_length(self, frames: int) -> int:
        length = frames
        for layer in self.layers:
            if isinstance(layer, self.transposed):
                (kernel,), (stride,) = layer.conv.kernel_size, layer.conv.stride
                length = (length - 1) * stride + kernel - layer.left_pad - layer.right_pad
        return length  # causal convolutions of stride 1 keep the length

    def earliest_frame(self, sample: int) -> int:
        """The first frame the output sample `sample` depends on (walking the layers backwards)."""
        index = sample
        for layer in reversed(self.layers):
            if isinstance(layer, self.transposed):
                # output n is the full output n + left_pad: inputs i with
                # i * stride <= n + left_pad < i * stride + kernel
                (kernel,), (stride,) = layer.conv.kernel_size, layer.conv.stride
                index = -(-(index + layer.left_pad - kernel + 1) // stride)
            else:
                index -= layer.padding  # a causal convolution reads (kernel - 1) * dilation inputs back
        return index

    def left_context(self) -> int:
        """Frames before the first new one the convolutions need so that every sample from the first
        not yet emitted (frames * samples_per_frame - loss) equals the one-shot decode's."""
        frames = 10_000  # far from the start, where the need is the same for every chunk
        return max(0, frames - self.earliest_frame(frames * self.samples_per_frame - self.loss))


@contextmanager
def _native_convolutions(device: torch.device) -> Iterator[None]:
    """While inside, on a CPU: torch's own convolutions instead of oneDNN's (Code2WavStream's decoder runs,
    in the model thread: the switch is the process's)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = before and device.type != "cpu"
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before
