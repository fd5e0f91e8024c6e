"""Qwen2.5-Omni token2wav's speaker encoder run once per decode call (omni_mesh.engines.speaker_once),
on a tiny random checkpoint, in one process:

- the encoder itself, counted where its first layer runs: rows of a few distinct inputs are encoded once
  each, in one call, and each row gets what the unwrapped encoder gives it; the wrapper is gone after;
- a decode alone equals the model's own forward without the wrapper bit for bit, with the encoder run
  once instead of once per ODE forward;
- rows of one speaker decoded in one call: the encoder runs once, on two rows (the reference mel and the
  guidance's zeros), whatever the number of rows and ODE steps, and each row is within 2 steps of 16-bit
  PCM of its own decode.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from omni_mesh.audio import pcm16_bytes  # noqa: E402
from omni_mesh.engines.dit_mask import compact_mask  # noqa: E402
from omni_mesh.engines.models import open_model  # noqa: E402
from omni_mesh.engines.settings import Sampling, parse_engine  # noqa: E402
from omni_mesh.engines.speaker_once import speaker_once  # noqa: E402
from omni_mesh.engines.tiny import build_tiny  # noqa: E402

STEPS = 4  # ODE steps: RK4 over 3 intervals, 12 DiT forwards a decode


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread, as the stages run (tests/conftest.py)."""


@pytest.fixture(scope="module")
def qwen2_5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    directory = build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("q25"))
    model = open_model(parse_engine({"part": "code2wav", "model": str(directory), "num_steps": STEPS}, "test"))
    return model, model.load("code2wav")


class Encoded:
    """The rows of each call of the speaker encoder's first layer (the encoder's own work, under any
    wrapper), while inside."""

    def __init__(self, dit: Any) -> None:
        self.layer = dit.input_embed.spk_encoder.blocks[0]
        self.calls: list[int] = []

    def __enter__(self) -> list[int]:
        self.hook = self.layer.register_forward_pre_hook(lambda module, args: self.calls.append(args[0].shape[0]))
        return self.calls

    def __exit__(self, *exc: object) -> None:
        self.hook.remove()


def pcm(wav: Any) -> np.ndarray:
    return np.frombuffer(pcm16_bytes(wav.numpy()), dtype=np.int16).astype(np.int32)


def test_distinct_rows_are_encoded_once_each_and_every_row_gets_its_own(qwen2_5: Any) -> None:
    _, decoder = qwen2_5
    dit = decoder.model.code2wav_dit_model
    encoder = dit.input_embed.spk_encoder
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 40, dit.mel_dim, generator=generator)
    rows = torch.stack([a, b, a, torch.zeros_like(a), b, a])
    with torch.no_grad():
        expected = encoder(rows)
        with speaker_once(dit), Encoded(dit) as calls:
            first = encoder(rows)
            again = encoder(rows.clone())  # the same input as the last forward: its output
            other = encoder(rows[:2])
    assert calls == [3, 2]  # a, b and zeros once each; then the new input's two
    assert torch.allclose(first, expected, atol=1e-5) and torch.equal(again, first)
    assert torch.equal(first[0], first[2]) and torch.equal(first[1], first[4])
    assert torch.allclose(other, expected[:2], atol=1e-5)
    assert "forward" not in encoder.__dict__  # the model's own forward again
    with torch.no_grad(), Encoded(dit) as calls:
        encoder(rows)
    assert calls == [len(rows)]


def test_a_decode_alone_equals_the_models_own_forward_bit_for_bit(qwen2_5: Any) -> None:
    _, decoder = qwen2_5
    dit = decoder.model.code2wav_dit_model
    codes = torch.randint(0, 100, (30,), generator=torch.Generator().manual_seed(1))
    entry = decoder.speakers[next(iter(decoder.speakers))]
    with torch.no_grad(), compact_mask(dit), Encoded(dit) as plain:
        torch.manual_seed(5)
        own = decoder.model(codes.reshape(1, -1), conditioning=entry["cond"].float(),
                            reference_mel=entry["ref_mel"].float(), num_steps=STEPS).reshape(-1)
    with Encoded(dit) as once:
        ours = decoder.decode(codes, speaker=next(iter(decoder.speakers)), seed=5)
    assert plain == [2] * (3 * 4) and once == [2]  # every RK4 forward before; one call now
    assert torch.equal(ours, own)


def test_rows_of_one_speaker_in_one_call_encode_it_once(qwen2_5: Any) -> None:
    model, decoder = qwen2_5
    generator = torch.Generator().manual_seed(2)
    lengths = (30, 12, 30, 7, 21, 30)
    requests = [(torch.randint(0, 100, (n,), generator=generator), Sampling.of(model.spec, {"seed": i}))
                for i, n in enumerate(lengths)]
    alone = [model.decode(decoder, codes, sampling) for codes, sampling in requests]
    with Encoded(decoder.model.code2wav_dit_model) as calls:
        together = model.decode_many(decoder, requests)
    assert calls == [2]  # not 2 x 6 rows in each of 12 forwards
    for n, one, other in zip(lengths, alone, together, strict=True):
        assert one.shape == other.shape, n
        assert int(np.abs(pcm(one) - pcm(other)).max()) <= 2, n
