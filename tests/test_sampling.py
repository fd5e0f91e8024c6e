"""Sampling as vLLM has it (issue 41 item 3): each param of a request (on /v1/requests and OpenAI's
route) and each engine default changes the reply as transformers' generate() with the same argument
does, on a tiny random Qwen2.5-Omni thinker served by `omni-mesh up`; presence/frequency penalties
(generate() has none) equal a direct computation; `stop` strings end the text before them, streamed
or not; a param out of range is a 4xx naming it, never accepted and ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from support.meshkit import running_mesh  # noqa: E402
from support.replies import streamed_outputs  # noqa: E402

from omni_mesh.engines.generation import Penalties  # noqa: E402
from omni_mesh.engines.stops import StopText  # noqa: E402
from omni_mesh.engines.tiny import build_tiny  # noqa: E402

PROMPT = "Hello there, how are you?"
MAX_TOKENS = 12
#: Engine defaults of the mesh's thinker: they only matter when a request samples (temperature > 0).
ENGINE_TOP_K, ENGINE_SEED = 3, 5


def test_penalties_equal_a_direct_computation() -> None:
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 10, generator=generator)
    prompt, reply = [1, 1, 2, 9], [3, 3, 3, 4, 1]  # the prompt's tokens are not counted (vLLM's)
    processor = Penalties(len(prompt), presence=0.5, frequency=0.25, bias=((7, 3.0), (0, -100.0)))
    ours = processor(torch.tensor([prompt + reply]), scores.clone())
    expected = scores.clone()[0].tolist()
    for token in range(10):
        count = reply.count(token)
        expected[token] -= 0.25 * count + (0.5 if count else 0.0)
    expected[7] += 3.0
    expected[0] -= 100.0
    assert torch.allclose(ours[0], torch.tensor(expected))


def test_stop_text_cuts_at_the_first_stop_string_however_the_text_is_split() -> None:
    text = "one two stop three halt four"
    for size in (1, 2, 3, 5, len(text)):
        cut = StopText(("halt", "stop"))
        deltas = [cut.add(text[i : i + size]) for i in range(0, len(text), size)] + [cut.flush()]
        assert "".join(deltas) == "one two "
        assert not any("st" in d for d in deltas)  # the start of the stop string was held back, never sent
    assert StopText(("zzz",)).whole(text) == text
    assert StopText(()).whole(text) == text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def mesh(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    engine = {"part": "thinker", "model": str(checkpoint), "threads": 1, "max_tokens": MAX_TOKENS,
              "top_k": ENGINE_TOP_K, "seed": ENGINE_SEED}
    topology = {"name": "sampling", "stages": [{"stage_id": 0, "name": "thinker", "engine": engine}]}
    with running_mesh(tmp_path_factory.mktemp("mesh"), topology) as running:
        yield running


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    """transformers' own thinker generate(), over the chat template as the stage applies it."""
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(checkpoint)).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]

    def generate(seed: int | None = None, **kwargs) -> list[int]:
        if seed is not None:
            torch.manual_seed(seed)
        kwargs.setdefault("max_new_tokens", MAX_TOKENS)
        kwargs.setdefault("do_sample", False)
        with torch.no_grad():
            out = model.thinker.generate(ids, **kwargs)
        return out[0, ids.shape[1] :].tolist()

    generate.model, generate.tokenizer, generate.ids = model, tokenizer, ids
    return generate


def text_of(reference, tokens: list[int]) -> str:
    return reference.tokenizer.decode(tokens, skip_special_tokens=True)


def reply(mesh, **params) -> dict:
    """The thinker's chunks (a client that does not stream gets its text in one) as one reply."""
    chunks = mesh.ok({"prompt": PROMPT}, params=params, timeout_s=60)["outputs"]
    return {**chunks[-1], "text": "".join(chunk.get("text") or "" for chunk in chunks)}


def test_each_param_changes_the_reply_as_generate_does(mesh, reference) -> None:
    greedy = reference()
    assert reply(mesh)["text"] == text_of(reference, greedy)
    cases = [  # (our params, generate()'s arguments)
        ({"repetition_penalty": 2.0}, {"repetition_penalty": 2.0}),
        ({"max_tokens": 3}, {"max_new_tokens": 3}),
        # sampling: the engine's top_k and seed are the defaults, a request's own override them
        ({"temperature": 1.0}, {"do_sample": True, "temperature": 1.0, "top_k": ENGINE_TOP_K, "seed": ENGINE_SEED}),
        ({"temperature": 1.0, "top_k": -1, "seed": 7}, {"do_sample": True, "temperature": 1.0, "top_k": 0, "seed": 7}),
        ({"temperature": 1.0, "top_k": 2, "seed": 7}, {"do_sample": True, "temperature": 1.0, "top_k": 2, "seed": 7}),
        ({"temperature": 1.0, "top_k": -1, "min_p": 0.9, "seed": 7},
         {"do_sample": True, "temperature": 1.0, "top_k": 0, "min_p": 0.9, "seed": 7}),
        ({"logit_bias": {str(greedy[0]): -100}}, {"sequence_bias": {(greedy[0],): -100.0}}),
    ]
    seen = {tuple(greedy)}
    for params, kwargs in cases:
        expected = reference(**kwargs)
        ours = reply(mesh, **params)
        assert ours["text"] == text_of(reference, expected), params
        assert ours["usage"]["completion_tokens"] == len(expected), params
        seen.add(tuple(expected))
    assert len(seen) == len(cases) + 1  # each param changed the reply: none was accepted and ignored


def penalized_greedy(reference, presence: float, frequency: float) -> str:
    """Greedy, each step's logits less vLLM's penalties over the reply so far (full forward passes)."""
    tokens = reference.ids[0].tolist()
    prompt_length = len(tokens)
    eos = reference.model.thinker.generation_config.eos_token_id
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = reference.model.thinker(input_ids=torch.tensor([tokens])).logits[0, -1].clone()
            for token in set(tokens[prompt_length:]):
                count = tokens[prompt_length:].count(token)
                logits[token] -= frequency * count + presence
            tokens.append(int(logits.argmax()))
            if tokens[-1] == eos:
                break
    return text_of(reference, tokens[prompt_length:])


def test_presence_and_frequency_penalties_equal_a_direct_computation(mesh, reference) -> None:
    greedy = reply(mesh)["text"]
    for presence, frequency in ((1.5, 0.0), (0.0, 0.75), (1.0, 0.5)):
        expected = penalized_greedy(reference, presence, frequency)
        assert expected != greedy, (presence, frequency)
        assert reply(mesh, presence_penalty=presence, frequency_penalty=frequency)["text"] == expected


def test_stop_ids_and_stop_strings_end_the_reply_as_vllm_does(mesh, reference) -> None:
    greedy = reference()
    stop_id = greedy[3]  # stop on a token of the greedy reply: it ends at its first occurrence, included
    expected = reference(eos_token_id=[reference.model.thinker.generation_config.eos_token_id, stop_id])
    assert expected[-1] == stop_id and len(expected) < MAX_TOKENS
    ours = reply(mesh, stop_token_ids=[stop_id])
    assert (ours["text"], ours["finish_reason"]) == (text_of(reference, expected), "stop")
    assert ours["usage"]["completion_tokens"] == len(expected)

    # a stop string made by a later token of the greedy reply: the text ends right before it
    full = text_of(reference, greedy)
    word = next(text_of(reference, [t]) for t in greedy[2:] if text_of(reference, [t]).strip().isalpha())
    with_stop = reference(stop_strings=[word], tokenizer=reference.tokenizer)
    hf_text = text_of(reference, with_stop)
    assert hf_text.endswith(word)  # generate() keeps the stop string; vLLM (and we) leave it out
    ours = reply(mesh, stop=word)
    assert ours["text"] == hf_text[: -len(word)] == full[: full.index(word)]
    assert ours["finish_reason"] == "stop" and ours["usage"]["completion_tokens"] == len(with_stop)

    body = {"inputs": {"prompt": PROMPT}, "params": {"stop": [word]}, "timeout_s": 60}
    deltas = [output.get("text") or "" for output in streamed_outputs(mesh.client, body)]
    assert "".join(deltas) == ours["text"] and word not in "".join(deltas)


def test_openai_route_takes_the_same_params(mesh, reference) -> None:
    with openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": PROMPT}]
        greedy = reference()
        extra = {"repetition_penalty": 2.0, "stop_token_ids": [greedy[5]]}
        expected = reference(repetition_penalty=2.0, eos_token_id=[402, greedy[5]])
        answer = client.chat.completions.create(model=name, messages=messages, extra_body=extra)
        assert answer.choices[0].message.content == reply(mesh, **extra)["text"]
        if greedy[5] in expected:  # the penalty may have steered away from the stop id
            assert answer.choices[0].message.content == text_of(reference, expected)
        answer = client.chat.completions.create(model=name, messages=messages, temperature=1.0, seed=9,
                                                extra_body={"top_k": 2})
        expected = reference(do_sample=True, temperature=1.0, top_k=2, seed=9)
        assert answer.choices[0].message.content == text_of(reference, expected)
        full = text_of(reference, greedy)
        word = next(text_of(reference, [t]) for t in greedy[2:] if text_of(reference, [t]).strip().isalpha())
        stream = client.chat.completions.create(model=name, messages=messages, stop=word, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == full[: full.index(word)]

        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=name, messages=messages, presence_penalty=3.0)
        assert "presence_penalty" in str(refused.value)


@pytest.mark.parametrize(
    ("param", "value"),
    [("top_k", -2), ("repetition_penalty", 0), ("presence_penalty", 2.5), ("frequency_penalty", "x"),
     ("stop", [""]), ("stop_token_ids", [-1]), ("max_tokens", 0), ("seed", -1), ("min_p", 2),
     ("logit_bias", {"x": 1})],
)
def test_a_param_out_of_range_is_a_4xx_naming_it(mesh, param: str, value) -> None:
    response = mesh.request({"prompt": PROMPT}, params={param: value}, timeout_s=30)
    assert response.status_code == 422, response.text
    assert repr(param) in json.dumps(response.json()) or param in response.text
