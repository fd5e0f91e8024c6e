"""The thinkers' batching tests' shared parts (tests/test_thinker_batch.py, tests/test_mixed_step.py): a
tiny random checkpoint of each thinker (loaded once per module by its fixture), a prompt's ids, the one-request path's
reply, and the check that a batched reply is that one."""

from __future__ import annotations

from typing import Any

import pytest

ROWS_ATOL = 1e-5  # the talker's input rows: batched float arithmetic (measured ~7e-7)


#: The thinkers the tests run on (a module-scoped fixture's params: `load`).
ARCHS = ["qwen2_5_omni", "qwen3_omni"]


def load(arch: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(the model, its loaded thinker) of a tiny random checkpoint of `arch`."""
    from omni_mesh.engines.models import open_model
    from omni_mesh.engines.settings import parse_engine
    from omni_mesh.engines.tiny import build_tiny

    directory = build_tiny(arch, tmp_path_factory.mktemp(arch))
    model = open_model(parse_engine({"part": "thinker", "model": str(directory)}, "test"))
    return model, model.load("thinker")


def ids_of(model: Any, prompt: str) -> Any:
    from omni_mesh.engines.text import prompt_ids

    return prompt_ids(model.tokenizer, {"messages": [{"role": "user", "content": prompt}]})


def alone(model: Any, thinker: Any, prompt: str, sampling: Any, for_talker: bool = True) -> Any:
    """The one-request path of the thinker stage (max_batch 1): seeded, then generate()."""
    import torch

    model.seed(sampling.seed)
    with torch.no_grad():
        return model.think(thinker, ids_of(model, prompt), sampling, None, None, for_talker=for_talker)


def assert_same(model: Any, one: Any, other: Any) -> None:
    """The same reply ids, and the talker's inputs within float noise (ROWS_ATOL)."""
    import torch

    assert model.reply_ids(one).tolist() == model.reply_ids(other).tolist()
    a, b = model.talker_payload(one), model.talker_payload(other)
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert value.shape == b[key].shape, key
            assert float((value - b[key]).abs().max()) < ROWS_ATOL, key
        else:
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b[key])), key
