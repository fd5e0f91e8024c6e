"""Audio, images and video through a real mesh (`omni-mesh up compose/qwen*_omni.yaml`, tiny checkpoints
that ship their processor) over `/v1/requests` and the OpenAI route: the greedy reply equals the library's
one-call `Qwen*ForConditionalGeneration.generate()` on the same processor outputs (text exactly, the
waveform within 2 steps of 16-bit PCM), with the encoder stage and without it (the thinker encodes
the media itself). Qwen3-Omni's talker cannot speak audio with images or video in transformers 5.25 (the
library's generate() fails on it): there the text is compared and the audio must be there. The stage
that encodes counts its cache's hits and misses in /metrics and /v1/stages. One mesh per model and
topology; few tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from support.media_engines import require_media_engines

require_media_engines()

from support import media_files  # noqa: E402
from support.meshkit import running_mesh, settled, wait_for  # noqa: E402
from support.omni_reference import QUESTION, Reference  # noqa: E402
from support.replies import pcm_samples, wav_samples  # noqa: E402

from omni_mesh.engines.tiny import build_tiny  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = {"qwen2_5_omni": ("qwen2_5_omni.yaml", "qwen2.5-omni"), "qwen3_omni": ("qwen3_omni.yaml", "qwen3-omni")}
VOICES = {"qwen2_5_omni": "Chelsie", "qwen3_omni": "Ethan"}  # generate()'s default speakers
TOKENS, CODES, SEED = 4, 20, 11
FILES = {  # (kind, bytes, format) and the OpenAI part that carries it
    "audio": ("audio", media_files.wav(1.0), "wav"),
    "image": ("image", media_files.image("png", 40, 28), "png"),
    "video": ("video", media_files.video(4, 56, 56, 2), "mp4"),
    "video+track": ("video", media_files.video(4, 56, 56, 2, with_audio=True), "mp4"),  # audio-in-video
}
PARTS = {
    "audio": media_files.input_audio(FILES["audio"][1]),
    "image": media_files.image_url(FILES["image"][1]),
    "video": media_files.video_url(FILES["video"][1]),
    "video+track": media_files.video_url(FILES["video+track"][1]),
}
KINDS = {"audio": ["audio"], "image": ["image"], "video": ["video"], "mixed": ["audio", "image", "video"]}
IN_VIDEO = {"video+track": ["video+track"], "mixed+track": ["audio", "image", "video+track"]}  # use_audio_in_video
LAYOUTS = {**KINDS, **IN_VIDEO}
_references: dict[str, Reference] = {}
_replies: dict[tuple[str, str, bool], tuple[str, np.ndarray | None]] = {}


def messages(kind: str) -> list[dict]:
    return [{"role": "user", "content": [*(PARTS[k] for k in LAYOUTS[kind]), {"type": "text", "text": QUESTION}]}]


def topology(arch: str, with_encoder: bool) -> dict:
    """The compose file, its talker capped at CODES (the OpenAI route sends no max_audio_tokens); without
    the encoder stage the thinker is the entry stage. (Qwen2.5's token2wav decodes a streamed reply chunk by
    chunk, not equal to the one-shot decode: qwen2_5_omni.ChunkedDecode.)"""
    spec = yaml.safe_load((ROOT / "compose" / COMPOSE[arch][0]).read_text())
    stages = {stage["name"]: stage for stage in spec["stages"]}
    stages["talker"]["engine"]["max_audio_tokens"] = CODES
    if arch == "qwen2_5_omni":  # the OpenAI route streams: its whole reply in one chunk, decoded as generate() does
        stages["talker"]["engine"].update(first_chunk_codes=CODES, chunk_codes=CODES)
    if not with_encoder:
        spec["stages"] = [stage for stage in spec["stages"] if stage["name"] != "encoder"]
        del stages["thinker"]["engine_input_source"]
    return spec


@pytest.fixture(scope="module", params=sorted(COMPOSE))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, build_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module", params=["encoder", "self-encoding thinker"])
def mesh(request: pytest.FixtureRequest, checkpoint: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory):
    arch, directory = checkpoint
    spec = topology(arch, request.param == "encoder")
    with running_mesh(tmp_path_factory.mktemp("mesh"), spec, env={"OMNI_MESH_MODEL": str(directory)}) as running:
        names = [stage["name"] for stage in running.client.get("/v1/topology").json()["stages"]]
        assert ("encoder" in names) == (request.param == "encoder")
        yield running


def expected(checkpoint: tuple[str, Path], kind: str, in_video: bool = False) -> tuple[str, np.ndarray | None]:
    """The reference reply (text, 16-bit samples) to `messages(kind)`, computed once per model;
    `in_video`: use_audio_in_video (the videos' audio tracks heard too)."""
    arch, directory = checkpoint
    if (arch, kind, in_video) not in _replies:
        reference = _references.get(arch) or _references.setdefault(arch, Reference(arch, directory))
        features = reference.features([FILES[k] for k in LAYOUTS[kind]], use_audio_in_video=in_video)
        text, wav = reference.generate(features, max_tokens=TOKENS, max_codes=CODES, seed=SEED,
                                       use_audio_in_video=in_video)
        _replies[arch, kind, in_video] = text, None if wav is None else pcm_samples(wav)
    return _replies[arch, kind, in_video]


def assert_same(text: str, samples: np.ndarray, reference: tuple[str, np.ndarray | None]) -> None:
    assert text == reference[0]
    assert len(samples) > 0
    if reference[1] is None:  # Qwen3, audio with vision: the library's talker cannot speak it (omni_reference)
        return
    assert samples.shape == reference[1].shape
    assert np.abs(samples - reference[1]).max() <= 2
    assert np.abs(reference[1]).max() > 100  # not a comparison of silences


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_requests_reply_to_media_equals_one_call_generate(mesh, checkpoint, kind: str) -> None:
    params = {"temperature": 0, "seed": SEED, "max_tokens": TOKENS, "max_audio_tokens": CODES}
    outputs = mesh.ok({"messages": messages(kind)}, params=params, timeout_s=120)["outputs"]
    assert_same(outputs["text"], wav_samples(outputs["audio_wav_base64"]), expected(checkpoint, kind))


def test_openai_reply_to_media_equals_one_call_generate(mesh, checkpoint) -> None:
    body = {
        "model": COMPOSE[checkpoint[0]][1], "messages": messages("mixed"), "modalities": ["text", "audio"],
        "audio": {"voice": VOICES[checkpoint[0]], "format": "wav"}, "max_tokens": TOKENS, "temperature": 0, "seed": SEED,
    }
    response = mesh.client.post("/v1/chat/completions", json=body, timeout=150)
    assert response.status_code == 200, response.text
    audio = response.json()["choices"][0]["message"]["audio"]
    assert_same(audio["transcript"], wav_samples(audio["data"]), expected(checkpoint, "mixed"))



@pytest.mark.parametrize("kind", sorted(IN_VIDEO))
def test_audio_in_video_equals_one_call_generate_on_both_routes(mesh, checkpoint, kind: str) -> None:
    """vLLM's mm_processor_kwargs.use_audio_in_video: the video's audio track heard with its frames (alone,
    and mixed with an audio clip and an image), as /v1/requests params and as the OpenAI route's field."""
    reference = expected(checkpoint, kind, in_video=True)
    deaf = expected(checkpoint, kind)  # the same media with the track unheard: another reply, or this tests nothing
    assert reference[0] != deaf[0] or (reference[1] is not None and not np.array_equal(reference[1], deaf[1]))
    params = {"temperature": 0, "seed": SEED, "max_tokens": TOKENS, "max_audio_tokens": CODES,
              "mm_processor_kwargs": {"use_audio_in_video": True}}
    outputs = mesh.ok({"messages": messages(kind)}, params=params, timeout_s=120)["outputs"]
    assert_same(outputs["text"], wav_samples(outputs["audio_wav_base64"]), reference)
    body = {
        "model": COMPOSE[checkpoint[0]][1], "messages": messages(kind), "modalities": ["text", "audio"],
        "audio": {"voice": VOICES[checkpoint[0]], "format": "wav"}, "max_tokens": TOKENS, "temperature": 0,
        "seed": SEED, "mm_processor_kwargs": {"use_audio_in_video": True},
    }
    response = mesh.client.post("/v1/chat/completions", json=body, timeout=150)
    assert response.status_code == 200, response.text
    audio = response.json()["choices"][0]["message"]["audio"]
    assert_same(audio["transcript"], wav_samples(audio["data"]), reference)


def test_encoder_cache_hits_and_misses_in_metrics_and_stages(mesh) -> None:
    """The same image twice (a new one each mesh): the second encoding is a cache hit, in `/metrics`
    and `/v1/stages` of the stage that encodes (the encoder, or a thinker that encodes itself)."""
    from prometheus_client.parser import text_string_to_metric_families

    encoding = "encoder" if "encoder" in mesh.stages() else "thinker"

    def scraped() -> dict[str, float]:
        families = text_string_to_metric_families(mesh.client.get("/metrics").text)
        return {
            sample.name: sample.value for family in families for sample in family.samples
            if sample.name.startswith("omni_mesh_handler_encoder_cache") and sample.labels["stage"] == encoding
        }

    def counted(**want: float) -> dict[str, float] | None:
        figures = scraped()
        return figures if all(figures.get(f"omni_mesh_handler_encoder_cache_{k}") == v for k, v in want.items()) else None

    before = settled(scraped, 20, "the encoder cache's counters in /metrics")
    hits, misses = before["omni_mesh_handler_encoder_cache_hits_total"], before["omni_mesh_handler_encoder_cache_misses_total"]
    pixels = media_files.image("png", 36, 20, color=(9, 90, 170))  # in no other request to this mesh
    inputs = {"messages": [{"role": "user", "content": [media_files.image_url(pixels)]}]}
    params = {"temperature": 0, "max_tokens": 1, "max_audio_tokens": 1}
    mesh.ok(inputs, params=params, timeout_s=120)
    wait_for(lambda: counted(hits_total=hits, misses_total=misses + 1), 10, "one miss for a new image")
    mesh.ok(inputs, params=params, timeout_s=120)
    wait_for(lambda: counted(hits_total=hits + 1, misses_total=misses + 1), 10, "one hit for the same image")
    reported = mesh.stages()[encoding][0]["counters"]
    assert reported["encoder_cache_hits_total"] == hits + 1 and reported["encoder_cache_items"] >= 1
