"""draw_rows: greedy rows with the same length-free processors share one call, and each row's token is the
one `thinker_batch.draw` picks for it alone (sequences of different lengths, repeated ids, an empty one,
a sampled row and rows of other settings beside them)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LogitsProcessorList  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
)

from omni_mesh.engines.draw_rows import draw_rows, shared_key  # noqa: E402
from omni_mesh.engines.thinker_batch import draw  # noqa: E402

VOCAB = 40


def talker_like(penalty: float, suppressed: list[int]) -> tuple[LogitsProcessorList, dict]:
    settings = {"repetition_penalty": penalty, "suppress_tokens": suppressed, "do_sample": False}
    return LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(penalty), SuppressTokensLogitsProcessor(suppressed)]
    ), settings


def test_shared_draws_equal_each_rows_own() -> None:
    generator = torch.Generator().manual_seed(0)
    a, settings_a = talker_like(1.5, [30, 31, 32])
    b, settings_b = talker_like(1.2, [30, 31, 32])
    none, plain = LogitsProcessorList(), {"do_sample": False}
    sampled = LogitsProcessorList([TemperatureLogitsWarper(0.7)])
    rows = []
    for length, (processors, settings, greedy) in zip(
        [5, 1, 9, 3, 0, 4, 0, 6, 2],
        [
            (a, settings_a, True),
            (a, settings_a, True),
            (a, settings_a, True),
            (b, settings_b, True),
            (none, plain, True),
            (none, plain, True),
            (a, settings_a, True),
            (sampled, {"do_sample": True}, False),
            (b, settings_b, True),
        ],
        strict=True,
    ):
        sequence = torch.randint(0, 8, (1, length), generator=generator)  # few ids: repeats in every row
        key = shared_key(processors, settings, greedy)
        rows.append(
            (processors, sequence, greedy, torch.Generator().manual_seed(length) if not greedy else None, key)
        )
    logits = torch.randn(len(rows), VOCAB, generator=generator)
    # the penalised ids must decide: raise them so the penalty changes which id wins
    logits[:, :8] += 2.0
    together = draw_rows(rows, logits)
    for i, (processors, sequence, greedy, _, _) in enumerate(rows):
        alone_generator = torch.Generator().manual_seed(int(sequence.shape[1])) if not greedy else None
        alone = draw(processors, sequence, logits[i : i + 1], greedy, alone_generator)
        assert torch.equal(together[i], alone), i


def test_rows_that_cannot_share_get_no_key() -> None:
    penalty, settings = talker_like(1.1, [1])
    assert shared_key(penalty, settings, greedy=False) is None
    assert shared_key(LogitsProcessorList([TemperatureLogitsWarper(0.5)]), {}, greedy=True) is None
    ignoring = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.1, prompt_ignore_length=2)])
    assert shared_key(ignoring, settings, greedy=True) is None
    assert shared_key(penalty, settings, True) == shared_key(talker_like(1.1, [1])[0], dict(settings), True)
