"""code2wav's batched decode (omni_mesh.engines.gather, Qwen3OmniCode2Wav.decode_many, token2wav_batch)
on tiny random checkpoints, in one process:

- Qwen3-Omni: whole replies of different lengths decoded in one call each equal their own decode() (to
  float rounding: the model is causal, so a row never reads the padding after it), and their 16-bit PCM
  within one step;
- Qwen2.5-Omni: replies of any lengths (and one speaker) decoded in one DiT batch (right-padded, the
  padding masked: tests/test_code2wav_stream_batch.py), each from its own seed's noise, equal their own
  decode() within 2 steps of 16-bit PCM;
- through the stage's Gather: what queues while the model thread is busy goes in one call (at most
  max_batch), a request cancelled while it waits never runs, a failing call fails its own requests only.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.gathers import held_gather  # noqa: E402

from omni_mesh.audio import pcm16_bytes  # noqa: E402
from omni_mesh.engines.gather import Gather  # noqa: E402
from omni_mesh.engines.models import open_model  # noqa: E402
from omni_mesh.engines.settings import Sampling, parse_engine  # noqa: E402
from omni_mesh.engines.tiny import build_tiny  # noqa: E402

FRAMES = (7, 20, 13, 1, 33, 300, 2, 301)  # 301: past generate()'s one-forward decode, decoded alone
WAV_ATOL = 1e-6  # batched float arithmetic (measured ~2e-7 on a waveform in [-1, 1])


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread, as the stages run (tests/conftest.py)."""


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = build_tiny("qwen3_omni", tmp_path_factory.mktemp("q3"))
    model = open_model(parse_engine({"part": "code2wav", "model": str(directory)}, "test"))
    return model, model.load("code2wav")


def codes_of(decoder: Any, frames: int, seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 60, (frames, decoder.num_quantizers), generator=generator)


def pcm(wav: Any) -> np.ndarray:
    return np.frombuffer(pcm16_bytes(wav.numpy()), dtype=np.int16).astype(np.int32)


def test_replies_decoded_in_one_call_equal_their_own_decode(parts: Any) -> None:
    model, decoder = parts
    sampling = Sampling.of(model.spec, {})
    batch = [codes_of(decoder, n, i) for i, n in enumerate(FRAMES)]
    alone = [model.decode(decoder, codes, sampling) for codes in batch]
    together = model.decode_many(decoder, [(codes, sampling) for codes in batch])
    for n, one, other in zip(FRAMES, alone, together, strict=True):
        assert one.shape == other.shape and len(one) == decoder.conv.output_length(n), n
        assert float((one - other).abs().max()) < WAV_ATOL, n
        assert int(np.abs(pcm(one) - pcm(other)).max()) <= 1, n
    assert model.decode_many(decoder, [(codes_of(decoder, 0, 0), sampling)])[0].numel() == 0


def test_the_gather_decodes_what_queued_in_one_call_and_skips_the_cancelled(parts: Any) -> None:
    model, decoder = parts
    sampling = Sampling.of(model.spec, {})
    gather, calls, release, executor = held_gather(lambda requests: model.decode_many(decoder, requests), 4)
    batch = [codes_of(decoder, n, i) for i, n in enumerate(FRAMES[:6])]
    futures = [gather.submit((codes, sampling)) for codes in batch]
    assert futures[2].cancel()  # its client left while it waited
    release.set()
    wavs = {i: f.result(60) for i, f in enumerate(futures) if i != 2}
    executor.shutdown()
    assert calls == [4, 1]  # max_batch 4 of the 5 still waiting, then the last
    for i, wav in wavs.items():
        assert float((wav - model.decode(decoder, batch[i], sampling)).abs().max()) < WAV_ATOL
    counters = gather.counters()
    assert counters["batch_steps_total"] == 2 and counters["batch_rows_stepped_total"] == 5
    assert counters["batch_queued"] == 0


def test_a_failing_call_fails_its_own_requests_and_the_gather_goes_on(parts: Any) -> None:
    model, decoder = parts
    sampling = Sampling.of(model.spec, {})
    executor = ThreadPoolExecutor(max_workers=1)
    gather = Gather(executor, lambda requests: model.decode_many(decoder, requests), max_batch=8)
    bad = gather.submit((torch.zeros(3, 2, dtype=torch.long), sampling))  # not [frames, groups]
    with pytest.raises(ValueError, match="codes must be int64"):
        bad.result(60)
    good = gather.submit((codes_of(decoder, 5, 0), sampling))
    assert len(good.result(60)) == decoder.conv.output_length(5)
    executor.shutdown()


def test_qwen2_5_replies_of_any_lengths_decode_in_one_batch_each_from_its_own_seed(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    directory = build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("q25"))
    model = open_model(parse_engine({"part": "code2wav", "model": str(directory), "num_steps": 4}, "test"))
    decoder = model.load("code2wav")
    generator = torch.Generator().manual_seed(0)
    lengths = (30, 30, 12, 30, 30, 12, 7)
    requests = [(torch.randint(0, 100, (n,), generator=generator), Sampling.of(model.spec, {"seed": i}))
                for i, n in enumerate(lengths)]
    alone = [model.decode(decoder, codes, sampling) for codes, sampling in requests]
    batches: list[int] = []  # the DiT's batch per forward: rows and their unconditioned twins (guidance)
    hook = decoder.model.code2wav_dit_model.register_forward_pre_hook(
        lambda module, args, kwargs: batches.append(int(kwargs["hidden_states"].shape[0])), with_kwargs=True
    )
    try:
        together = model.decode_many(decoder, requests)
    finally:
        hook.remove()
    for n, one, other in zip(lengths, alone, together, strict=True):
        assert one.shape == other.shape, n
        assert int(np.abs(pcm(one) - pcm(other)).max()) <= 2, n
    assert set(batches) == {len(lengths)}  # all seven together, every forward
