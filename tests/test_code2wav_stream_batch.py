"""Streamed code2wav/token2wav chunks of several requests decoded in one call (`feed_many` of
Qwen3OmniCode2Wav's and Qwen2.5-Omni token2wav's streams, code2wav's stream Gather), on tiny random
checkpoints, in one process:

- 5 concurrent streams of different lengths, their chunks arriving round by round as a talker sends them
  (a short first chunk, then 25 codes), each round in one call: each stream's audio equals what it gets
  streamed alone (Qwen3: bit for bit, or within float32 rounding where the CPU's GEMM blocks by the batch:
  `same_audio`; Qwen2.5: within 2 steps of 16-bit PCM), and one call decodes them;
- Qwen2.5's DiT over rows of different lengths, right-padded: with the padding masked each row equals
  its own decode; without the mask the shorter rows would not (the check can tell);
- through the Gather: the chunks queued while the model thread is busy go in one call; a new stream's
  first chunk goes before the chunks queued ahead of it, in a call of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.gathers import held_gather  # noqa: E402

from omni_mesh.audio import pcm16_bytes  # noqa: E402
from omni_mesh.engines.models import open_model  # noqa: E402
from omni_mesh.engines.settings import Sampling, parse_engine  # noqa: E402
from omni_mesh.engines.tiny import build_tiny  # noqa: E402

LENGTHS = (37, 5, 80, 23, 61)  # codes (Qwen3: frames) of each concurrent stream
FIRST, CHUNK = 10, 25  # the talker's first chunk and the others (settings: first_chunk_codes, chunk_codes)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread, as the stages run (tests/conftest.py)."""


def same_audio(one: Any, other: Any, what: Any) -> None:
    """Bit for bit where torch's CPU convolution sums a row alone as it sums it among others (the hosts
    CI ran on). On AVX-512 hosts its GEMM blocks by the batch and rows land up to ~1e-8 apart: float32
    rounding, three orders below a 16-bit PCM step. A stage on a CPU decodes one request a call
    (Qwen3OmniCode2Wav.call_batch), so through a mesh the audio is the stream's own bit for bit anyway."""
    if one.shape != other.shape or not one.numel():
        assert torch.equal(one, other), (what, one.shape, other.shape)
        return
    diff = float((one - other).abs().max())
    assert torch.equal(one, other) or diff < 1e-6, (what, diff)


def load(arch: str, directory: Any, **engine: Any) -> tuple[Any, Any]:
    model = open_model(parse_engine({"part": "code2wav", "model": str(build_tiny(arch, directory)), **engine}, "test"))
    return model, model.load("code2wav")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return load("qwen3_omni", tmp_path_factory.mktemp("q3"))


@pytest.fixture(scope="module")
def qwen2_5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return load("qwen2_5_omni", tmp_path_factory.mktemp("q25"), num_steps=4)


def codes_for(arch_model: Any, decoder: Any, n: int, seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    if hasattr(decoder, "num_quantizers"):  # Qwen3: frames of code groups
        return torch.randint(0, 60, (n, decoder.num_quantizers), generator=generator)
    return torch.randint(0, 100, (n,), generator=generator)


def chunked(codes: Any) -> list[Any]:
    return [codes[:FIRST]] + [codes[i : i + CHUNK] for i in range(FIRST, len(codes), CHUNK)]


def pcm(wav: Any) -> np.ndarray:
    return np.frombuffer(pcm16_bytes(wav.numpy()), dtype=np.int16).astype(np.int32)


def streamed_alone(model: Any, decoder: Any, codes: Any, sampling: Sampling) -> Any:
    stream = model.stream_decoder(decoder, sampling)
    return torch.cat([stream.feed(chunk) for chunk in chunked(codes)] + [stream.finish()])


def streamed_together(model: Any, decoder: Any, batch: list[Any], samplings: list[Sampling]) -> tuple[list[Any], list[int]]:
    """Each stream's audio, every round of chunks (then the finishes) decoded in one decode_chunks() call;
    and the size of each call."""
    streams = [model.stream_decoder(decoder, s) for s in samplings]
    queues = [chunked(codes) for codes in batch]
    pieces: list[list[Any]] = [[] for _ in batch]
    calls = []
    while any(queues) or calls[-1:] != [-1]:
        rows = [i for i, q in enumerate(queues) if q] or list(range(len(batch)))
        items = [(streams[i], queues[i].pop(0) if queues[i] else None) for i in rows]
        for i, wav in zip(rows, model.decode_chunks(items), strict=True):
            pieces[i].append(wav)
        calls.append(len(items) if any(c is not None for _, c in items) else -1)  # -1: the finishes
    return [torch.cat(p) for p in pieces], calls[:-1]


def test_qwen3_streams_decoded_together_equal_each_streamed_alone(qwen3: Any) -> None:
    model, decoder = qwen3
    sampling = Sampling.of(model.spec, {})
    batch = [codes_for(model, decoder, n, i) for i, n in enumerate(LENGTHS)]
    alone = [streamed_alone(model, decoder, codes, sampling) for codes in batch]
    together, calls = streamed_together(model, decoder, batch, [sampling] * len(batch))
    assert calls[0] == len(LENGTHS) and max(calls) == len(LENGTHS)
    for n, one, other, codes in zip(LENGTHS, alone, together, batch, strict=True):
        assert len(one) == decoder.conv.output_length(n), n
        same_audio(one, other, n)
        assert float((one - model.decode(decoder, codes, sampling)).abs().max()) < 1e-5, n  # the one-shot decode


def test_qwen2_5_streams_decoded_together_equal_each_streamed_alone(qwen2_5: Any) -> None:
    model, decoder = qwen2_5
    samplings = [Sampling.of(model.spec, {"seed": i}) for i in range(len(LENGTHS))]
    batch = [codes_for(model, decoder, n, i) for i, n in enumerate(LENGTHS)]
    alone = [streamed_alone(model, decoder, codes, s) for codes, s in zip(batch, samplings, strict=True)]
    forwards: list[int] = []  # the DiT's batch per forward (rows; guidance doubles them inside)
    hook = decoder.model.code2wav_dit_model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(int(kwargs["hidden_states"].shape[0])), with_kwargs=True
    )
    try:
        together, calls = streamed_together(model, decoder, batch, samplings)
    finally:
        hook.remove()
    assert calls[0] == len(LENGTHS)
    assert max(forwards) == len(LENGTHS)  # the first round's windows (5 and 10 codes) in one DiT batch
    for n, one, other in zip(LENGTHS, alone, together, strict=True):
        assert len(one) == n * decoder.samples_per_code, n
        assert int(np.abs(pcm(one) - pcm(other)).max()) <= 2, n


def test_qwen2_5_dit_rows_of_different_lengths_need_the_padding_masked(qwen2_5: Any) -> None:
    """One DiT forward, a row of 31 codes beside one of 50 (right-padded): masked, its output equals its
    forward alone (measured ~6e-8); unmasked, its attention reads the padding (measured ~1e-5: the tiny
    random DiT's attention weighs little, so the waveforms hide it; its forward shows it)."""
    from omni_mesh.engines.dit_mask import compact_mask

    model, decoder = qwen2_5
    dit, speaker = decoder.model.code2wav_dit_model, decoder.speakers["Chelsie"]
    generator = torch.Generator().manual_seed(0)

    def forward(codes: Any, noise: Any) -> Any:
        rows, length = noise.shape[:2]
        return dit(hidden_states=noise, quantized_code=codes, time_step=torch.tensor(0.3), apply_cfg=True,
                   speaker_embedding=speaker["cond"].float().reshape(1, 1, -1).expand(rows, length, -1),
                   condition_vector=speaker["ref_mel"].float().expand(rows, -1, -1))

    long, short = (torch.randint(0, 100, (1, n), generator=generator) for n in (50, 31))
    frames = [n * dit.repeats for n in (50, 31)]
    noise = [torch.randn(1, n, dit.mel_dim, generator=generator) for n in frames]
    with torch.no_grad():
        alone = forward(short, noise[1])  # [2, frames, mel]: the row and its unconditioned twin
        codes = torch.cat([long, torch.nn.functional.pad(short, (0, 50 - 31))])
        padded = torch.cat([noise[0], torch.nn.functional.pad(noise[1], (0, 0, 0, frames[0] - frames[1]))])
        unmasked = forward(codes, padded)[[1, 3], : frames[1]]
        with compact_mask(dit, frames):
            masked = forward(codes, padded)[[1, 3], : frames[1]]
    assert float((masked - alone).abs().max()) < 1e-6
    assert float((unmasked - alone).abs().max()) > 1e-6


def streams_of(model: Any, decoder: Any, sampling: Sampling) -> tuple[list[Any], list[Any]]:
    """The codes of streams of LENGTHS, and a stream decoder for each."""
    batch = [codes_for(model, decoder, n, i) for i, n in enumerate(LENGTHS)]
    return batch, [model.stream_decoder(decoder, sampling) for _ in batch]


def test_the_stream_gather_decodes_the_chunks_queued_in_one_call(qwen3: Any) -> None:
    model, decoder = qwen3
    sampling = Sampling.of(model.spec, {})
    gather, calls, release, executor = held_gather(model.decode_chunks, 8)
    batch, streams = streams_of(model, decoder, sampling)
    futures = [gather.submit((stream, codes)) for stream, codes in zip(streams, batch, strict=True)]
    release.set()
    wavs = [f.result(60) for f in futures]
    rests = [gather.submit((stream, None)).result(60) for stream in streams]
    executor.shutdown()
    assert calls[0] == len(LENGTHS)
    for codes, wav, rest in zip(batch, wavs, rests, strict=True):
        same_audio(torch.cat([wav, rest]), streamed_alone_whole(model, decoder, codes, sampling), len(codes))


def streamed_alone_whole(model: Any, decoder: Any, codes: Any, sampling: Sampling) -> Any:
    """A stream fed all its codes at once, then finished, alone."""
    stream = model.stream_decoder(decoder, sampling)
    return torch.cat([stream.feed(codes), stream.finish()])


def test_first_chunks_go_before_the_chunks_queued_ahead_of_them_in_a_call_of_their_own(qwen3: Any) -> None:
    model, decoder = qwen3
    sampling = Sampling.of(model.spec, {})
    gather, calls, release, executor = held_gather(model.decode_chunks, 8)
    batch, streams = streams_of(model, decoder, sampling)
    for stream, codes in zip(streams[:3], batch, strict=False):  # three streams under way
        stream.feed(codes[:FIRST])
    order: list[str] = []
    going = [gather.submit((stream, codes[FIRST:])) for stream, codes in zip(streams[:3], batch, strict=False)]
    new = [gather.submit((stream, codes[:FIRST]), first=True) for stream, codes in zip(streams[3:], batch[3:], strict=True)]
    for name, futures in (("going", going), ("new", new)):
        for future in futures:
            future.add_done_callback(lambda _, name=name: order.append(name))
    release.set()
    wavs = [f.result(60) for f in going + new]
    executor.shutdown()
    assert calls == [2, 3] and order == ["new"] * 2 + ["going"] * 3  # submitted last, served first
    for i, wav in enumerate(wavs[3:], start=3):
        same_audio(wav, model.stream_decoder(decoder, sampling).feed(batch[i][:FIRST]), i)
    for i, wav in enumerate(wavs[:3]):  # each stream's second chunk, as it gets it alone
        alone = model.stream_decoder(decoder, sampling)
        alone.feed(batch[i][:FIRST])
        same_audio(wav, alone.feed(batch[i][FIRST:]), i)
