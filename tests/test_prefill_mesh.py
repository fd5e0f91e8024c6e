"""A long prompt through a real mesh (`omni-mesh up compose/qwen2_5_omni.yaml`, a tiny checkpoint whose
thinker context is raised to 32768 so a prompt within it takes the thinker seconds to prefill):

- a prompt past the context is a 422 naming the limit, at once, and costs the thinker no compute;
- a prompt within it whose deadline passes (or whose client leaves) mid-prefill stops costing the
  thinker's process CPU within 1 s (measured from /proc), the thinker shows in flight until its compute
  has stopped, and the next request is served.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.meshkit import running_mesh, wait_for  # noqa: E402

from omni_mesh.engines.tiny import build_tiny  # noqa: E402
from omni_mesh.procinfo import cpu_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = ROOT / "compose" / "qwen2_5_omni.yaml"
CONTEXT = 32768
LONG = "hello " * 5000  # ~20k tokens of this tokenizer: within the context, ~10 s of prefill on one thread
PAST = "hello " * 40000  # the red team's prompt: ~160k tokens here


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    checkpoint = build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("long_context"))
    config = json.loads((checkpoint / "config.json").read_text())
    config["thinker_config"]["text_config"]["max_position_embeddings"] = CONTEXT
    (checkpoint / "config.json").write_text(json.dumps(config))
    with running_mesh(
        tmp_path_factory.mktemp("prefill_mesh"), TOPOLOGY, env={"OMNI_MESH_MODEL": str(checkpoint)}
    ) as running:
        yield running


def thinker(mesh) -> dict:
    return mesh.stages()["thinker"][0]


def assert_stops_within_a_second(mesh, ended: float) -> None:
    """From 1 s after `ended` on, the thinker's process spends (almost) no CPU, and shows free."""
    pid = thinker(mesh)["pid"]
    time.sleep(max(0.0, ended + 1.0 - time.monotonic()))
    before = cpu_seconds({pid})
    time.sleep(2.0)
    spent = cpu_seconds({pid}) - before
    assert spent < 0.3, f"the thinker spent {spent:.2f} s of CPU from 1 s to 3 s after the request ended"
    assert thinker(mesh)["inflight"] == 0
    reply = mesh.ok(
        {"prompt": "Hello"}, params={"temperature": 0, "max_tokens": 3, "max_audio_tokens": 20}, timeout_s=60
    )
    assert reply["outputs"]["audio_wav_base64"]


def test_a_prompt_past_the_context_is_a_4xx_at_once(mesh) -> None:
    pid = thinker(mesh)["pid"]
    before = cpu_seconds({pid})
    started = time.monotonic()
    response = mesh.client.post(
        "/v1/requests", json={"inputs": {"prompt": PAST}, "timeout_s": 10}, timeout=30
    )
    took = time.monotonic() - started
    assert response.status_code == 422, response.text
    assert f"context of {CONTEXT} tokens" in response.text and "thinker" in response.text
    assert took < 5.0, f"refused after {took:.1f} s"
    assert cpu_seconds({pid}) - before < 2.0  # tokenizing it, no prefill (that would be minutes)


def test_a_deadline_mid_prefill_frees_the_thinker_within_a_second(mesh) -> None:
    body = {"inputs": {"prompt": LONG}, "params": {"max_tokens": 4}, "timeout_s": 3}
    started = time.monotonic()
    response = mesh.client.post("/v1/requests", json=body, timeout=30)
    ended = time.monotonic()
    assert response.status_code == 504, response.text
    assert ended - started < 6.0
    # Right after the 504 it is shown busy while its compute ends, or it has already stopped (its own
    # deadline fired before the coordinator's): never shown free while it computes.
    pid = thinker(mesh)["pid"]
    before = cpu_seconds({pid})
    if thinker(mesh)["inflight"] == 0:
        time.sleep(0.5)
        assert cpu_seconds({pid}) - before < 0.2, "the thinker is shown free while it still computes"
    assert_stops_within_a_second(mesh, ended)


def test_a_client_leaving_mid_prefill_frees_the_thinker_within_a_second(mesh) -> None:
    body = {"inputs": {"prompt": LONG}, "params": {"max_tokens": 4}, "timeout_s": 60, "stream": True}
    with mesh.client.stream("POST", "/v1/requests", json=body, timeout=60) as response:
        assert response.status_code == 200
        wait_for(lambda: thinker(mesh)["inflight"] == 1, 10, "the thinker to take the request")
        time.sleep(1.0)  # well into the prefill
    ended = time.monotonic()  # the client is gone: the coordinator aborts the request
    assert_stops_within_a_second(mesh, ended)
