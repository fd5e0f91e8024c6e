"""Qwen3TalkerBatch's first step of a request (one forward of the talker's decoder and codec head, where
generate() had run it) gives generate()'s logits and last hidden state bit for bit, on the same prefilled
cache, and leaves the same cache length and rope delta."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from omni_mesh.engines.models import open_model  # noqa: E402
from omni_mesh.engines.qwen3_talker_batch import Qwen3TalkerBatch  # noqa: E402
from omni_mesh.engines.settings import Sampling, parse_engine  # noqa: E402
from omni_mesh.engines.text import prompt_ids  # noqa: E402
from omni_mesh.engines.tiny import build_tiny  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread, as the stages run (tests/conftest.py)."""


@pytest.mark.parametrize("prompt", ["hello there, tell me about it", "a"])
def test_the_direct_first_step_is_generates(tmp_path: Any, prompt: str) -> None:
    model = open_model(
        parse_engine({"part": "thinker", "model": str(build_tiny("qwen3_omni", tmp_path))}, "test")
    )
    thinker, talker = model.load("thinker"), model.load("talker")
    ids = prompt_ids(model.tokenizer, {"messages": [{"role": "user", "content": prompt}]})
    with torch.no_grad():
        payload = model.talker_payload(
            model.think(thinker, ids, Sampling.of(model.spec, {"max_tokens": 12}), None, None)
        )
    sampling = Sampling.of(model.spec, {"temperature": 0, "max_audio_tokens": 5})
    batch = Qwen3TalkerBatch(talker.model, talker.codec_eos)
    with torch.inference_mode():
        kwargs = dict(model.talk_begin(talker, payload, sampling, None).prepared.kwargs)
        cache = kwargs.pop("cache")
        result = talker.model.generate(
            **kwargs,
            cache=cache,
            max_new_tokens=1,
            do_sample=False,
            output_logits=True,
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
        expected = (
            result.hidden_states[0][0][-1][:, -1:],
            result.logits[0],
            cache.get_seq_length(),
            batch._rope_delta(),
        )
        kwargs = dict(model.talk_begin(talker, payload, sampling, None).prepared.kwargs)
        cache = kwargs.pop("cache")
        hidden, logits = batch._first_step(kwargs, cache)
    assert torch.equal(hidden, expected[0]) and torch.equal(logits, expected[1])
    assert (cache.get_seq_length(), batch._rope_delta()) == expected[2:]
