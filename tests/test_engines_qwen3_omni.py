"""Qwen3-Omni split across a real mesh (`omni-mesh up compose/qwen3_omni.yaml`) on a tiny random
checkpoint of the real architecture: a greedy reply equals the library's one-call generate() (text,
waveform within 2 steps of 16-bit PCM), and the streamed audio equals the unstreamed audio (its
code2wav is causal: streaming costs nothing in fidelity). The parts alone: test_qwen3_omni_parts.py."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.meshkit import running_mesh  # noqa: E402
from support.replies import pcm_samples, sse_events, wav_samples  # noqa: E402

from omni_mesh.engines.tiny import build_tiny  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = ROOT / "compose" / "qwen3_omni.yaml"
PROMPT = "Hello there, how are you?"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("qwen3_omni", tmp_path_factory.mktemp("qwen3_omni"))


@pytest.fixture(scope="module")
def mesh(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    # compose/qwen3_omni.yaml with 2-frame talker chunks: a tiny random talker ends its reply after a few
    # frames, and the streaming test wants several chunks of them
    topology = yaml.safe_load(TOPOLOGY.read_text())
    talker = next(stage for stage in topology["stages"] if stage["name"] == "talker")
    talker["engine"].update(first_chunk_codes=2, chunk_codes=2)
    with running_mesh(tmp_path_factory.mktemp("qwen3_mesh"), topology, env={"OMNI_MESH_MODEL": str(checkpoint)}) as running:
        yield running


def reference(checkpoint: Path, *, max_tokens: int, max_codes: int) -> tuple[str, np.ndarray]:
    """generate() greedy on the same checkpoint: the chat template over one user message, the
    checkpoint's eos, max_codes frames (generate() counts the eos frame too)."""
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(checkpoint)).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        sequences, wav = model.generate(
            input_ids=ids, thinker_max_new_tokens=max_tokens, thinker_eos_token_id=model.config.im_end_token_id,
            thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=max_codes + 1,
        )
    return tokenizer.decode(sequences[0, ids.shape[1] :], skip_special_tokens=True), wav.reshape(-1).float().numpy()








def test_mesh_reply_equals_one_call_generate(mesh, checkpoint: Path) -> None:
    params = {"temperature": 0, "max_tokens": 6, "max_audio_tokens": 30}
    outputs = mesh.ok({"prompt": PROMPT}, params=params, timeout_s=60)["outputs"]
    text, wav = reference(checkpoint, max_tokens=6, max_codes=30)
    assert outputs["text"] == text
    ours, theirs = wav_samples(outputs["audio_wav_base64"]), pcm_samples(wav)
    assert ours.shape == theirs.shape and len(ours) > 0
    assert np.abs(ours - theirs).max() <= 2
    assert np.abs(theirs).max() > 100  # not a comparison of silences


def test_streamed_audio_equals_unstreamed_audio(mesh) -> None:
    params = {"temperature": 0, "max_tokens": 8, "max_audio_tokens": 60}
    whole = wav_samples(mesh.ok({"prompt": PROMPT}, params=params, timeout_s=60)["outputs"]["audio_wav_base64"])
    body = {"inputs": {"prompt": PROMPT}, "params": params, "timeout_s": 60, "stream": True}
    pcm, chunks = bytearray(), 0
    with mesh.client.stream("POST", "/v1/requests", json=body, timeout=90) as response:
        for kind, event in sse_events(response):
            assert kind != "error", event
            if kind == "done":
                break
            piece = base64.b64decode(event["output"].get("audio_pcm16") or "")
            chunks += bool(piece)
            pcm += piece
    streamed = np.frombuffer(bytes(pcm), dtype="<i2").astype(np.int32)
    assert chunks >= 3, (chunks, len(whole) // 1920)  # the audio came in pieces, as it was made
    assert streamed.shape == whole.shape
    assert np.abs(streamed - whole).max() <= 1  # float rounding of the same samples, at most
