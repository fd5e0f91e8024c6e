"""Batching in a real mesh (`omni-mesh up`: thinker, talker and token2wav/code2wav with `max_batch: 8`,
tiny random Qwen2.5-Omni and Qwen3-Omni, one torch thread per stage):

- 8 concurrent greedy requests of different prompt and reply lengths share the thinker's and the
  talker's forward passes (their counters say so) and each gets the text transformers' generate() gives
  it alone, and the audio it gets when sent alone (within 2 steps of 16-bit PCM for Qwen2.5-Omni, 1 for
  Qwen3-Omni: see PCM_STEPS);
- streamed concurrently, each reply's text comes in chunks of `stream_interval` tokens (the first token
  at once) and adds up to the same text;
- 8 concurrent streamed requests: code2wav decodes their chunks together (its counters say so; Qwen3-Omni's
  on a CPU one a call, as its `call_batch` says) and each hears the audio it hears streamed alone (Qwen3-Omni
  bit for bit, Qwen2.5-Omni within 2 PCM steps);
- a client that leaves mid-reply frees its place: the others' replies are unchanged, the thinker shows
  nothing running or queued afterwards, and `/metrics` carries the batch's gauges and counters.
"""

from __future__ import annotations

import base64
import concurrent.futures
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.batch_requests import PROMPTS, REPLY_TOKENS, alone_texts  # noqa: E402
from support.meshkit import running_mesh, settled, wait_for  # noqa: E402
from support.replies import streamed_outputs, wav_samples  # noqa: E402

from omni_mesh.engines.tiny import build_tiny  # noqa: E402

AUDIO_CODES = 20
STREAM_INTERVAL = 3  # the thinker's tokens per streamed text chunk (engine.stream_interval)
#: how far batched audio may be from the audio sent alone, in 16-bit PCM steps: Qwen2.5's DiT's float
#: noise; Qwen3's codes are the same, and its code2wav, decoding replies queued together in one call
#: (right-padded), rounds a sample to the other side of a PCM step now and then (~2e-7 apart)
PCM_STEPS = {"qwen2_5_omni": 2, "qwen3_omni": 1}
#: the same for streamed audio: Qwen3's streamed chunks decode together bit for bit as alone
STREAM_PCM_STEPS = {"qwen2_5_omni": 2, "qwen3_omni": 0}


def topology() -> dict:
    def stage(sid: int, part: str, **engine: Any) -> dict:
        return {"stage_id": sid, "name": part, "max_inflight": 16,
                "engine": {"part": part, "model": "${OMNI_MESH_MODEL}", "threads": 1, **engine}}

    return {"name": "batching", "stages": [
        stage(0, "thinker", max_batch=8, stream_interval=STREAM_INTERVAL),
        {**stage(1, "talker", max_batch=8), "engine_input_source": [0]},
        {**stage(2, "code2wav", num_steps=4, max_batch=8), "engine_input_source": [1], "final_output": True},
    ]}


@pytest.fixture(scope="module", params=list(PCM_STEPS))
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(arch, tmp_path_factory.mktemp(arch))


@pytest.fixture(scope="module")
def mesh(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_mesh(tmp_path_factory.mktemp("batching_mesh"), topology(),
                      env={"OMNI_MESH_MODEL": str(checkpoint)}) as running:
        yield running


def inputs(prompt: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}]}


def params(max_tokens: int) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, "max_audio_tokens": AUDIO_CODES, "seed": 1}


@pytest.fixture(scope="module")
def texts(checkpoint: Path) -> list[str]:
    """Each prompt's text from the thinker's one-request path (transformers' generate()), in process."""
    return alone_texts(checkpoint, [params(n) for n in REPLY_TOKENS])


def thinker_counters(mesh: Any, stage: str = "thinker") -> dict:
    return mesh.stages()[stage][0]["counters"]


def totals(mesh: Any, stage: str) -> dict:
    """The stage's counters that only grow (its gauges, such as tokens per second, move by themselves)."""
    return {k: v for k, v in thinker_counters(mesh, stage).items() if k.endswith("_total")}


def test_eight_concurrent_requests_share_the_thinker_and_get_their_replies_alone(
    mesh: Any, texts: list[str], arch: str
) -> None:
    alone = [mesh.ok(inputs(p), params=params(n), timeout_s=60)["outputs"] for p, n in zip(PROMPTS, REPLY_TOKENS, strict=True)]
    assert [a["text"] for a in alone] == texts
    before = settled(lambda: totals(mesh, "thinker"), 20, "the thinker's counters")
    talker_before = settled(lambda: totals(mesh, "talker"), 20, "the talker's counters")
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda i: mesh.ok(inputs(PROMPTS[i]), params=params(REPLY_TOKENS[i]), timeout_s=90)["outputs"],
                                 range(len(PROMPTS))))
    assert [t["text"] for t in together] == texts
    for one, other in zip(alone, together, strict=True):
        a, b = wav_samples(one["audio_wav_base64"]), wav_samples(other["audio_wav_base64"])
        assert len(a) == len(b) and len(a) > 0
        assert int(np.abs(a - b).max()) <= PCM_STEPS[arch]
    wait_for(lambda: thinker_counters(mesh)["generated_tokens_total"] - before["generated_tokens_total"]
             == sum(REPLY_TOKENS), 15, "the thinker's counters to arrive")
    after = thinker_counters(mesh)
    steps = after["batch_steps_total"] - before["batch_steps_total"]
    rows = after["batch_rows_stepped_total"] - before["batch_rows_stepped_total"]
    # One at a time is 1.0 row a step. Under a loaded host the 8 arrive spread out, and the short replies
    # leave early: 1.9 was seen in a full suite run, so the line is drawn halfway, at 1.5.
    assert rows / steps >= 1.5, f"{rows} rows in {steps} steps: the requests hardly shared a forward"
    # The talker's counters come with its own next heartbeat (the thinker's arriving says nothing of it).
    wait_for(
        lambda: thinker_counters(mesh, "talker")["batch_steps_total"] > talker_before["batch_steps_total"],
        15,
        "the talker's counters to arrive",
    )
    talker = settled(lambda: thinker_counters(mesh, "talker"), 20, "the talker's counters")
    steps = talker["batch_steps_total"] - talker_before["batch_steps_total"]
    rows = talker["batch_rows_stepped_total"] - talker_before["batch_rows_stepped_total"]
    # the talker's requests arrive as the thinker ends them (3 to 30 tokens apart): they overlap less
    assert rows / steps > 1.2, f"the talker: {rows} rows in {steps} steps"


def test_streamed_replies_come_in_chunks_of_the_stream_interval(mesh: Any, texts: list[str]) -> None:
    def streamed(i: int) -> list[str]:
        body = {"inputs": inputs(PROMPTS[i]), "params": {**params(REPLY_TOKENS[i]), "modalities": ["text"]},
                "timeout_s": 60}
        return [output["text"] for output in streamed_outputs(mesh.client, body) if output.get("text")]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        chunks = list(pool.map(streamed, range(len(PROMPTS))))
    assert ["".join(c) for c in chunks] == texts
    for reply_tokens, text_chunks in zip(REPLY_TOKENS, chunks, strict=True):
        # the first token alone, then every STREAM_INTERVAL tokens, then the rest with the end
        assert len(text_chunks) <= 2 + (reply_tokens - 1) // STREAM_INTERVAL, (reply_tokens, text_chunks)
    longest = chunks[REPLY_TOKENS.index(max(REPLY_TOKENS))]
    assert len(longest) >= 3  # streamed, not all at the end


def streamed_audio(mesh: Any, i: int) -> tuple[str, np.ndarray]:
    outputs = streamed_outputs(mesh.client, {"inputs": inputs(PROMPTS[i]), "params": params(REPLY_TOKENS[i]),
                                             "timeout_s": 90})
    pcm = b"".join(base64.b64decode(o.get("audio_pcm16") or "") for o in outputs)
    return "".join(o.get("text") or "" for o in outputs), np.frombuffer(pcm, dtype="<i2").astype(np.int32)


def test_eight_concurrent_streams_share_code2wav_calls_and_hear_their_audio_alone(
    mesh: Any, arch: str
) -> None:
    # (a streamed text's deltas can split a character's bytes where the whole text does not: compared
    # stream to stream)
    alone = [streamed_audio(mesh, i) for i in range(len(PROMPTS))]
    before = settled(lambda: totals(mesh, "code2wav"), 20, "code2wav's counters")
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda i: streamed_audio(mesh, i), range(len(PROMPTS))))
    for (text, a), (other_text, b) in zip(alone, together, strict=True):
        assert text == other_text and len(a) == len(b) and len(a) > 0
        assert int(np.abs(a - b).max()) <= STREAM_PCM_STEPS[arch]
    after = settled(lambda: totals(mesh, "code2wav"), 20, "code2wav's counters")
    calls = after["batch_steps_total"] - before["batch_steps_total"]
    rows = after["batch_rows_stepped_total"] - before["batch_rows_stepped_total"]
    # Qwen3's code2wav on a CPU: one chunk a call (Qwen3OmniCode2Wav.call_batch: a batch saves it nothing)
    if arch == "qwen3_omni":
        assert calls and rows == calls, f"code2wav: {rows} chunks in {calls} calls ({before} -> {after})"
    else:
        assert calls and rows / calls > 1.2, f"code2wav: {rows} chunks in {calls} calls ({before} -> {after})"


def test_a_client_leaving_mid_batch_frees_its_place_and_leaves_the_others_alone(mesh: Any, texts: list[str]) -> None:
    long = {**params(3000), "max_audio_tokens": 1}  # runs until the client leaves (no eos in this tiny model's way)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        others = [pool.submit(lambda i=i: mesh.ok(inputs(PROMPTS[i]), params=params(REPLY_TOKENS[i]), timeout_s=90))
                  for i in range(len(PROMPTS))]
        with mesh.client.stream("POST", "/v1/requests", timeout=60, json={
            "inputs": inputs("go on and on"), "params": long, "timeout_s": 60, "stream": True,
        }) as response:
            assert response.status_code == 200
            next(line for line in response.iter_lines() if line.startswith("data:"))  # its first text: it runs
        left = time.monotonic()  # the client is gone: the coordinator aborts the request
        assert [f.result(120)["outputs"]["text"] for f in others] == texts
    wait_for(lambda: mesh.stages()["thinker"][0]["inflight"] == 0, 10, "the thinker to free every place")
    assert time.monotonic() - left < 30
    wait_for(lambda: thinker_counters(mesh)["batch_running"] == 0, 5, "the batch to empty")
    assert thinker_counters(mesh)["batch_queued"] == 0
    reply = mesh.ok(inputs(PROMPTS[0]), params=params(REPLY_TOKENS[0]), timeout_s=60)
    assert reply["outputs"]["text"] == texts[0]
    metrics = mesh.client.get("/metrics", timeout=10).text
    for name in ("omni_mesh_handler_batch_running", "omni_mesh_handler_batch_queued",
                 "omni_mesh_handler_generated_tokens_total", "omni_mesh_handler_generated_tokens_per_second"):
        assert f'{name}{{replica=' in metrics or f"{name}{{stage=" in metrics, name
