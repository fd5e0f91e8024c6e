"""Audio, images and video into the thinker, both models, on tiny checkpoints that ship their processor:
the encoder part (processor + towers loaded alone) feeding a thinker without towers, and a thinker that
encodes itself, each equal to the library's one-call thinker generate() on the same processor outputs:
the same greedy tokens and the same logits (a missing grid, position or deepstack feature would only
nudge the logits). Changing the image or the audio changes the reply."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.media_engines import require_media_engines

require_media_engines()

import torch  # noqa: E402

from omni_mesh.engines.media_inputs import ENCODED_KEY  # noqa: E402
from omni_mesh.engines.models import open_model  # noqa: E402
from omni_mesh.engines.processor import process  # noqa: E402
from omni_mesh.engines.settings import Sampling, parse_engine  # noqa: E402
from omni_mesh.engines.tiny import build_tiny  # noqa: E402

ARCHS = {"qwen2_5_omni": "qwen2_5_omni", "qwen3_omni": "qwen3_omni_moe"}
TOKENS = 6
RNG = np.random.default_rng(7)
AUDIO = (RNG.standard_normal(16_000 * 2) * 0.1).astype(np.float32)
TONE = (np.sin(np.arange(32_000) / 16_000 * 2 * np.pi * 440) * 0.5).astype(np.float32)
IMAGE = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
GREY = np.full((64, 64, 3), 200, np.uint8)
VIDEO = RNG.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
PARTS = {
    "audio": [{"type": "audio", "audio": AUDIO}],
    "image": [{"type": "image", "image": IMAGE}],
    "video": [{"type": "video", "video": VIDEO, "fps": 2.0}],
    "mixed": [{"type": "audio", "audio": AUDIO}, {"type": "image", "image": IMAGE},
              {"type": "video", "video": VIDEO, "fps": 2.0}],
}


def request(parts: list[dict]) -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]}


class Split:
    """One checkpoint as the stages load it: an encoder, a thinker fed by it (no towers), and a thinker
    that encodes itself; plus the library's one-call thinker as the reference."""

    def __init__(self, directory: Path) -> None:
        def parts(part: str) -> object:
            return open_model(parse_engine({"part": part, "model": str(directory)}, "test"))

        self.encoder_parts, self.fed_parts, self.self_parts = parts("encoder"), parts("thinker"), parts("thinker")
        self.towers = self.encoder_parts.load("encoder")
        self.fed = self.fed_parts.load("thinker", towers=False)
        self.whole = self.self_parts.load("thinker")  # with its towers: the one-call reference too
        self.sampling = Sampling.of(self.fed_parts.spec, {"max_tokens": TOKENS, "temperature": 0})

    def reference(self, inputs: dict) -> tuple[list[int], list]:
        """The library's one-call thinker generate() on the processor's outputs."""
        features = process(self.self_parts.processor, inputs).features
        model = self.whole.model
        model.model.rope_deltas = None
        extra = {} if "2_5" in type(model).__name__ else {"use_audio_in_video": False}
        out = model.generate(**features, max_new_tokens=TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **extra)
        return out.sequences[0, features["input_ids"].shape[1] :].tolist(), list(out.logits)

    def through(self, thinker: object, parts: object, inputs: dict) -> tuple[list[int], list]:
        ids, media = parts.prompt(thinker, inputs)
        if "2_5" not in type(thinker.model).__name__:
            media = {"use_audio_in_video": False, **media}
        out = thinker.model.generate(input_ids=ids, **media, max_new_tokens=TOKENS, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True)
        return out.sequences[0, ids.shape[1] :].tolist(), list(out.logits)

    def fed_by_encoder(self, inputs: dict) -> tuple[list[int], list]:
        encoded = self.encoder_parts.encode(self.towers, inputs)
        return self.through(self.fed, self.fed_parts, {ENCODED_KEY: encoded})

    def reply(self, inputs: dict) -> list[int]:
        """The stage's path: encoder, then the thinker part's own generate()."""
        encoded = self.encoder_parts.encode(self.towers, inputs)
        ids, media = self.fed_parts.prompt(self.fed, {ENCODED_KEY: encoded})
        output = self.fed_parts.think(self.fed, ids, self.sampling, None, None, media)
        return [int(t) for t in self.fed_parts.reply_ids(output).tolist()]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def split(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Split:
    return Split(build_tiny(request.param, tmp_path_factory.mktemp(request.param)))


@pytest.mark.parametrize("kind", sorted(PARTS))
def test_encoder_stage_and_self_encoding_thinker_equal_one_call_generate(split: Split, kind: str) -> None:
    inputs = request(PARTS[kind])
    tokens, logits = split.reference(inputs)
    for path in (split.fed_by_encoder(inputs), split.through(split.whole, split.self_parts, inputs)):
        assert path[0] == tokens
        assert len(path[1]) == len(logits)
        for ours, theirs in zip(path[1], logits, strict=True):
            assert torch.equal(ours, theirs), float((ours - theirs).abs().max())
    # the stage stops at the thinker's eos, where the bare generate() may go on
    reply = split.reply(inputs)
    eos = set(split.fed_parts.eos_token_ids(split.fed))
    assert reply == tokens[: len(reply)] and (len(reply) == TOKENS or reply[-1] in eos)


def test_a_thinker_fed_by_an_encoder_holds_no_towers(split: Split) -> None:
    core = split.fed.model.model
    assert core.audio_tower is None and core.visual is None
    names = [name for name, _ in split.fed.model.named_parameters()]
    assert names and not [n for n in names if "audio_tower" in n or "visual" in n]
    with pytest.raises(ValueError, match="without towers"):
        split.fed_parts.prompt(split.fed, request(PARTS["image"]))


@pytest.mark.parametrize(("kind", "other"), [("audio", {"type": "audio", "audio": TONE}),
                                             ("image", {"type": "image", "image": GREY})])
def test_changing_the_media_changes_the_reply(split: Split, kind: str, other: dict) -> None:
    assert split.reply(request(PARTS[kind])) != split.reply(request([other]))


def test_the_encoder_cache_spares_encoding_the_same_image_twice(split: Split) -> None:
    cache = split.towers.cache
    image = RNG.integers(0, 256, (32, 48, 3), dtype=np.uint8)
    before = cache.stats()
    first = split.encoder_parts.encode(split.towers, request([{"type": "image", "image": image}]))
    middle = cache.stats()
    second = split.encoder_parts.encode(split.towers, request([{"type": "image", "image": image.copy()}]))
    after = cache.stats()
    assert middle["misses"] == before["misses"] + 1 and middle["hits"] == before["hits"]
    assert after["hits"] == middle["hits"] + 1 and after["misses"] == middle["misses"]
    assert torch.equal(first["image_embeds"], second["image_embeds"])


def test_the_encoder_cache_is_bounded_least_recently_used_out_first() -> None:
    from omni_mesh.engines.encoder import EncoderCache

    cache = EncoderCache(max_items=2)
    for key in ("a", "b"):
        cache.put(key, {"embeds": torch.zeros(1)})
    assert cache.get("a") is not None  # "a" used last: "b" goes first
    cache.put("c", {"embeds": torch.ones(1)})
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.stats() == {"hits": 3, "misses": 1, "items": 2}
    off = EncoderCache(max_items=0)  # engine.encoder_cache: 0 keeps nothing
    off.put("a", {"embeds": torch.zeros(1)})
    assert off.get("a") is None and off.stats()["items"] == 0
