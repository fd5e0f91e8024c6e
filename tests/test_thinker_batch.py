"""The thinkers' continuous batching (omni_mesh.engines.batching, thinker_batch) on tiny random
checkpoints of both architectures, in one process (and the talkers'):

- 8 requests of different prompt and reply lengths decoded in one batch each get the reply the
  one-request path (transformers' generate()) gives it alone: the same tokens, and the talker's inputs
  within float noise; greedy, and sampled with a seed and penalties; the talkers' the same codes
  (Qwen3-Omni's frames, its code predictor batched too);
- a request cancelled mid-batch leaves at once (no token after the cancel), the others' replies are
  unchanged, and the request waiting for a place takes the freed one before the others end.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.batch_requests import PROMPTS, REPLY_TOKENS  # noqa: E402
from support.thinker_parts import ARCHS, alone, assert_same, ids_of, load  # noqa: E402

from omni_mesh.engines.batching import Batcher  # noqa: E402
from omni_mesh.engines.settings import Sampling  # noqa: E402
from omni_mesh.engines.thinker_batch import ThinkerBatch  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread, as the stages run (tests/conftest.py)."""


@pytest.fixture(scope="module", params=ARCHS)
def parts(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load(request.param, tmp_path_factory)


def batcher_of(model: Any, thinker: Any, max_batch: int) -> Batcher:
    return Batcher("thinker", ThinkerBatch(thinker.model, model.thinker_step_layers), max_batch)


def batched(model: Any, thinker: Any, requests: list[tuple[str, Sampling]], batcher: Batcher,
            pushes: list[Any] | None = None, stops: list[Any] | None = None, for_talker: bool = True) -> list[Any]:
    """`requests` submitted together (none starts before the last is queued); their outputs."""
    queued = threading.Event()
    futures = []
    for i, (prompt, sampling) in enumerate(requests):
        ids = ids_of(model, prompt)

        def begin(ids: Any = ids, sampling: Sampling = sampling) -> Any:
            queued.wait(30)
            return model.think_begin(thinker, ids, sampling, None, for_talker=for_talker)

        push = pushes[i] if pushes else (lambda token: None)
        stop = stops[i] if stops else (lambda: False)
        futures.append(batcher.submit(begin, push, stop))
    queued.set()
    try:
        return [future.result(120) for future in futures]
    finally:
        batcher.close()


def leaving_client(
    batcher: Batcher, requests: int
) -> tuple[list[Any], list[Any], dict[str, list[int]], list[list[Any]]]:
    """Pushes and stop flags for `requests` requests sent together: request 1's client leaves after its
    5th token (code, frame). `at`: the batch's step count then ("cancelled") and when the last request
    got its first token ("joined"); `seen`: what each request got."""
    cancel = threading.Event()
    seen: list[list[Any]] = [[] for _ in range(requests)]
    at: dict[str, list[int]] = {"cancelled": [], "joined": []}

    def push_of(i: int) -> Any:
        def push(token: Any) -> None:
            seen[i].append(token)
            if i == 1 and len(seen[i]) == 5:
                cancel.set()
                at["cancelled"].append(batcher.steps_total)
            if i == requests - 1 and not at["joined"]:
                at["joined"].append(batcher.steps_total)
        return push

    stops = [cancel.is_set if i == 1 else (lambda: False) for i in range(requests)]
    return [push_of(i) for i in range(requests)], stops, at, seen


@pytest.mark.parametrize("params", [
    {"temperature": 0},
    {"temperature": 0.9, "seed": 7, "top_k": 20, "presence_penalty": 0.5, "repetition_penalty": 1.2},
], ids=["greedy", "seeded"])
def test_eight_requests_in_one_batch_get_the_replies_they_get_alone(parts: Any, params: dict) -> None:
    model, thinker = parts
    spec = model.spec
    samplings = [Sampling.of(spec, {**params, "max_tokens": n}) for n in REPLY_TOKENS]
    references = [alone(model, thinker, p, s) for p, s in zip(PROMPTS, samplings, strict=True)]
    batcher = batcher_of(model, thinker, max_batch=8)
    outputs = batched(model, thinker, list(zip(PROMPTS, samplings, strict=True)), batcher)
    lengths = [len(model.reply_ids(r)) for r in references]
    assert len(set(lengths)) > 4  # replies of different lengths: rows leave the batch at different steps
    for reference, output in zip(references, outputs, strict=True):
        assert_same(model, reference, output)
    counters = batcher.counters()
    # all 8 in one batch from the first step: one step per token of the longest reply (each prompt's last
    # token is a row of the first step, which makes every first token)
    assert counters["batch_steps_total"] == max(lengths)
    assert counters["batch_rows_stepped_total"] == sum(lengths)
    assert batcher.tokens_total == sum(lengths)
    assert counters["batch_running"] == 0 and counters["batch_queued"] == 0


def test_a_thinker_that_feeds_no_stage_keeps_no_hidden_states_and_replies_the_same(parts: Any) -> None:
    """A text-only mesh (the thinker its last stage): no step's hidden states kept, no talker's inputs
    built, and the same reply ids, one request at a time and batched."""
    model, thinker = parts
    samplings = [Sampling.of(model.spec, {"temperature": 0, "max_tokens": n}) for n in REPLY_TOKENS]
    references = [alone(model, thinker, p, s) for p, s in zip(PROMPTS, samplings, strict=True)]
    engine = model.batch_engine(thinker, "thinker", for_talker=False)
    assert engine.layers == ()
    stepped: list[bool] = []
    forward = thinker.model.model.forward

    def watched(*args: Any, **kwargs: Any) -> Any:
        stepped.append(bool(kwargs.get("output_hidden_states")))
        return forward(*args, **kwargs)

    thinker.model.model.forward = watched
    try:
        outputs = batched(model, thinker, list(zip(PROMPTS, samplings, strict=True)), Batcher("thinker", engine, 8),
                          for_talker=False)
        one = [alone(model, thinker, p, s, for_talker=False) for p, s in zip(PROMPTS, samplings, strict=True)]
    finally:
        del thinker.model.model.forward  # the class's method again
    assert stepped and not any(stepped)  # no forward, batched or alone, asked for hidden states
    for reference, output, alone_output in zip(references, outputs, one, strict=True):
        assert model.reply_ids(output).tolist() == model.reply_ids(reference).tolist()
        assert model.reply_ids(alone_output).tolist() == model.reply_ids(reference).tolist()
        assert not hasattr(output, "prompt_rows") and (not isinstance(output, dict) or set(output) == {"reply_ids"})


def test_a_cancelled_request_leaves_at_once_and_the_waiting_one_takes_its_place(parts: Any) -> None:
    model, thinker = parts
    long = Sampling.of(model.spec, {"temperature": 0, "max_tokens": 40})
    prompts = PROMPTS[:5]
    references = [alone(model, thinker, p, long) for p in prompts]
    assert all(len(model.reply_ids(r)) == 40 for r in references)  # no eos before max_tokens: rows stay
    batcher = batcher_of(model, thinker, max_batch=4)
    pushes, stops, at, seen = leaving_client(batcher, len(prompts))
    outputs = batched(model, thinker, [(p, long) for p in prompts], batcher, pushes=pushes, stops=stops)
    assert len(model.reply_ids(outputs[1])) == 5 and seen[1] == model.reply_ids(references[1]).tolist()[:5]
    for i in (0, 2, 3, 4):
        assert_same(model, references[i], outputs[i])
    # request 4 waited for a place (max_batch 4) and got its first token in the step after the cancel (step
    # 5 made request 1's 5th token), long before the others ended (their 40 tokens take 40 steps)
    assert at == {"cancelled": [5], "joined": [6]}
    assert batcher.counters()["batch_steps_total"] == 5 + 40


def talker_payloads(model: Any, thinker: Any) -> list[dict]:
    return [model.talker_payload(alone(model, thinker, p, Sampling.of(model.spec, {"max_tokens": n})))
            for p, n in zip(PROMPTS, REPLY_TOKENS, strict=True)]


def talk_alone(model: Any, talker: Any, payload: dict, sampling: Sampling) -> Any:
    """The talker stage's one-request path (max_batch 1): seeded, then generate()."""
    model.seed(sampling.seed)
    with torch.no_grad():
        return model.talk(talker, payload, sampling, None, None)


def talk_batched(model: Any, talker: Any, requests: list[tuple[dict, Sampling]], batcher: Batcher,
                 pushes: list[Any] | None = None, stops: list[Any] | None = None) -> list[Any]:
    """Talker requests submitted together (none starts before the last is queued); their codes."""
    queued = threading.Event()

    def begin_of(payload: dict, sampling: Sampling) -> Any:
        def begin() -> Any:
            queued.wait(30)
            return model.talk_begin(talker, payload, sampling, None)
        return begin

    futures = [batcher.submit(begin_of(p, s), pushes[i] if pushes else (lambda code: None),
                              stops[i] if stops else (lambda: False))
               for i, (p, s) in enumerate(requests)]
    queued.set()
    try:
        return [future.result(120) for future in futures]
    finally:
        batcher.close()


# The talkers: Qwen2.5-Omni's (codes [n]) and Qwen3-Omni's (frames [n, groups]: its code predictor draws
# every row's residual codes at once); exactly the codes generate() gives each alone.
@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.8, "seed": 5}],
                         ids=["greedy", "seeded"])
def test_eight_talker_requests_in_one_batch_get_the_codes_they_get_alone(parts: Any, params: dict) -> None:
    model, thinker = parts
    talker = model.load("talker")
    payloads = talker_payloads(model, thinker)
    samplings = [Sampling.of(model.spec, {**params, "max_audio_tokens": n, "seed": params.get("seed", 0) + i})
                 for i, n in enumerate((20, 35, 11, 50, 8, 27, 40, 15))]
    references = [talk_alone(model, talker, p, s) for p, s in zip(payloads, samplings, strict=True)]
    pushed: list[list[Any]] = [[] for _ in payloads]
    batcher = Batcher("talker", model.batch_engine(talker, "talker"), 8)
    codes = talk_batched(model, talker, list(zip(payloads, samplings, strict=True)), batcher,
                         pushes=[p.append for p in pushed])
    assert len({len(c) for c in references}) > 4
    assert [c.tolist() for c in codes] == [c.tolist() for c in references]
    if model.arch == "qwen3_omni_moe":  # frames are pushed as the code predictor completes them
        assert [torch.cat(p).tolist() if p else [] for p in pushed] == [c.tolist() for c in references]
    assert batcher.counters()["batch_rows_stepped_total"] > 3 * batcher.counters()["batch_steps_total"]


def test_a_cancelled_talker_request_leaves_at_once_and_the_others_get_their_codes(parts: Any) -> None:
    model, thinker = parts
    talker = model.load("talker")
    payloads = talker_payloads(model, thinker)[:5]
    sampling = Sampling.of(model.spec, {"temperature": 0, "max_audio_tokens": 30})
    references = [talk_alone(model, talker, p, sampling) for p in payloads]
    batcher = Batcher("talker", model.batch_engine(talker, "talker"), 4)
    pushes, stops, at, _ = leaving_client(batcher, len(payloads))
    codes = talk_batched(model, talker, [(p, sampling) for p in payloads], batcher, pushes=pushes, stops=stops)
    assert len(references[1]) == 30 and codes[1].tolist() == references[1].tolist()[:5]  # nothing after the cancel
    for i in (0, 2, 3, 4):
        assert codes[i].tolist() == references[i].tolist()
    # the waiting request (max_batch 4) took the freed place within one step (Qwen3's first frame comes
    # with its first step, Qwen2.5's first code with its prefill)
    assert at["joined"][0] - at["cancelled"][0] <= 1
    assert batcher.counters()["batch_running"] == 0


# Qwen3's talker: a reply of one token has nothing to speak (no generate() at all)
@pytest.mark.parametrize("parts", ["qwen3_omni"], indirect=True)
def test_talker_requests_with_nothing_to_speak_end_at_once_beside_the_others(parts: Any) -> None:
    model, thinker = parts
    talker = model.load("talker")
    one_token = model.talker_payload(alone(model, thinker, PROMPTS[0], Sampling.of(model.spec, {"max_tokens": 1})))
    full = talker_payloads(model, thinker)[1]
    sampling = Sampling.of(model.spec, {"temperature": 0, "max_audio_tokens": 20})
    requests = [(one_token, sampling), (full, sampling), (one_token, sampling)]
    references = [talk_alone(model, talker, p, s) for p, s in requests]
    batcher = Batcher("talker", model.batch_engine(talker, "talker"), 4)
    codes = talk_batched(model, talker, requests, batcher)
    assert [c.tolist() for c in codes] == [c.tolist() for c in references]
    assert len(codes[0]) == len(codes[2]) == 0 and len(codes[1]) == 20
    assert batcher.counters()["batch_running"] == 0
