"""`omni-mesh serve MODEL` as a vLLM user starts it (issue 41 items 1 and 2): a hub id from a prepared
huggingface_hub cache with HF_HUB_OFFLINE=1, and a directory, each answering the official `openai`
client (text, and streamed audio) under the model's name; `--print-topology` writes what it runs; an
engine topology without an `openai:` section serves OpenAI's API named after its model.

The checkpoint is a tiny random Qwen2.5-Omni built at test time (it speaks noise: the replies are
checked for shape, not words), laid out in a cache directory as the hub lays out a download.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from support.meshkit import OMNI_MESH, Mesh, start_command, stopped_after  # noqa: E402

from omni_mesh.engines.tiny import build_tiny  # noqa: E402
from omni_mesh.topology import load_topology  # noqa: E402

HUB_ID = "omni-mesh/tiny-qwen2_5_omni"
REVISION = "0123456789abcdef0123456789abcdef01234567"
#: Short replies: a random talker never says stop, so the audio is as long as max_audio_tokens.
SHORT = {"max_tokens": 4, "extra_body": {"params": {"max_audio_tokens": 30}}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hub_env(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A huggingface_hub cache holding HUB_ID (as a download leaves it: refs/main -> a snapshot), offline."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    shutil.copytree(checkpoint, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def serve(directory: Path, model: str, *flags: str, env: dict[str, str] | None = None) -> Mesh:
    # One torch thread a stage (three share this machine), and time for a loaded CI machine.
    flags = ("--threads", "1", "--timeout-s", "120", *flags)
    command = lambda port: [str(OMNI_MESH), "serve", model, "--port", str(port), *flags]  # noqa: E731
    return start_command(directory, command, directory, env=env)


@pytest.fixture(scope="module")
def by_id(hub_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with stopped_after(serve(tmp_path_factory.mktemp("by_id"), HUB_ID, env=hub_env)) as mesh:
        yield mesh


def check_answers(mesh: Mesh, name: str) -> None:
    """The official client: the model listed by `name`, a text reply, a streamed audio reply."""
    with openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        assert [model.id for model in client.models.list()] == [name]
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
        text = client.chat.completions.create(model=name, messages=messages, **SHORT)
        assert text.model == name and text.choices[0].message.content  # noise, but text
        assert text.usage.completion_tokens == 4 and text.choices[0].finish_reason == "length"
        assert text.choices[0].message.audio is None
        stream = client.chat.completions.create(
            model=name, messages=messages, modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"},
            stream=True, **SHORT,
        )
        transcript, audio = "", b""
        for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            sound = getattr(delta, "audio", None) or {}  # a model in newer clients, a plain dict in older ones
            sound = sound if isinstance(sound, dict) else sound.model_dump()
            transcript += sound.get("transcript") or ""
            audio += base64.b64decode(sound.get("data") or "")
        assert transcript and len(audio) > 24_000 // 10  # some audio: 30 codes of the tiny talker


def test_serve_a_cached_hub_id_offline_answers_the_openai_client(by_id: Mesh) -> None:
    check_answers(by_id, HUB_ID)
    stages = {stage["name"] for stage in by_id.client.get("/v1/topology").json()["stages"]}
    assert stages == {"encoder", "thinker", "talker", "code2wav"}


def test_serve_a_directory_under_a_served_name_with_replicas(checkpoint: Path, tmp_path: Path) -> None:
    flags = ("--served-model-name", "tiny-omni", "--replicas", "talker=2", "--max-model-len", "4096")
    with stopped_after(serve(tmp_path, str(checkpoint), *flags)) as mesh:
        check_answers(mesh, "tiny-omni")
        assert len(mesh.stages()["talker"]) == 2


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(OMNI_MESH), *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}, cwd=cwd
    )


def test_print_topology_writes_what_up_runs(hub_env: dict[str, str], tmp_path: Path) -> None:
    done = cli("serve", HUB_ID, "--print-topology", "--dtype", "float32", "--replicas", "code2wav=3", env=hub_env)
    assert done.returncode == 0, done.stderr
    topology = yaml.safe_load(done.stdout)
    assert [stage["engine"]["part"] for stage in topology["stages"]] == ["encoder", "thinker", "talker", "code2wav"]
    assert {stage["engine"]["model"] for stage in topology["stages"]} == {HUB_ID}  # the id, resolved in each stage
    assert topology["stages"][3]["replicas"] == 3 and topology["stages"][0]["engine"]["dtype"] == "float32"
    assert topology["openai"]["model"] == HUB_ID
    (tmp_path / "served.yaml").write_text(done.stdout)
    checked = cli("validate", str(tmp_path / "served.yaml"), env=hub_env)
    assert checked.returncode == 0, checked.stderr


def test_a_model_serve_cannot_find_is_one_line_naming_it(hub_env: dict[str, str], tmp_path: Path) -> None:
    missing = cli("serve", "omni-mesh/not-cached", "--print-topology", env=hub_env)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert "'omni-mesh/not-cached'" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    other = cli("serve", str(tmp_path), "--print-topology")
    assert other.returncode == 2 and "model_type 'llama' has no stage graph here" in other.stderr
    bad = cli("serve", HUB_ID, "--replicas", "vocoder=2", "--print-topology", env=hub_env)
    assert bad.returncode == 2 and "vocoder" in bad.stderr and "encoder, thinker, talker, code2wav" in bad.stderr


def test_an_engine_topology_without_openai_section_serves_the_api_named_after_its_model(tmp_path: Path) -> None:
    data = yaml.safe_load((Path(__file__).parents[1] / "compose" / "qwen2_5_omni.yaml").read_text())
    del data["openai"]
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(data))
    os.environ["OMNI_MESH_TEST_SERVE_MODEL"] = HUB_ID
    try:
        text = (tmp_path / "topology.yaml").read_text().replace("${OMNI_MESH_MODEL}", "${OMNI_MESH_TEST_SERVE_MODEL}")
        (tmp_path / "topology.yaml").write_text(text)
        spec = load_topology(tmp_path / "topology.yaml").openai
    finally:
        del os.environ["OMNI_MESH_TEST_SERVE_MODEL"]
    assert spec is not None and spec.model == HUB_ID
    assert (spec.text_output.stage, spec.audio_output.stage, spec.audio_output.field) == ("code2wav", "code2wav", "audio_pcm16")


def test_max_model_len_cuts_the_reply_to_fit_and_refuses_a_prompt_that_fills_it() -> None:
    from omni_mesh.engines.settings import Sampling, parse_engine, within_model_len
    from omni_mesh.errors import InvalidInput

    spec = parse_engine({"part": "thinker", "model": HUB_ID, "max_tokens": 100, "max_model_len": 120}, "stage 'thinker'")
    sampling = Sampling.of(spec, {})
    assert within_model_len(spec, sampling, 15).max_tokens == 100  # fits as it is
    assert within_model_len(spec, sampling, 50).max_tokens == 70  # cut, as vLLM cuts it
    with pytest.raises(InvalidInput, match="the prompt is 120 tokens, and this model's max_model_len is 120"):
        within_model_len(spec, sampling, 120)
    with pytest.raises(ValueError, match="engine.max_model_len must be an integer >= 1"):
        parse_engine({"part": "thinker", "model": HUB_ID, "max_model_len": 0}, "stage 'thinker'")


def readme_block(after: str, language: str) -> str:
    """The README's first ```language block after the line that contains `after`."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    start = text.index(f"```{language}\n", text.index(after)) + len(language) + 4
    return text[start : text.index("```", start)]


def test_the_readmes_media_examples_run_as_written(by_id: Mesh, tmp_path: Path) -> None:
    """Issue 38: README's curl and OpenAI-client examples with an image and an audio clip, run as written
    (but for the port) against `omni-mesh serve`, as after `make run`."""
    import json
    import sys

    where = by_id.url.removeprefix("http://")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])  # the README runs .venv/bin/python
    curl = readme_block("With curl, an image and a spoken question", "bash").replace("localhost:8000", where)
    done = subprocess.run(["bash", "-e", "-c", curl], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    outputs = json.loads((tmp_path / "reply.json").read_text())["outputs"]
    assert outputs["text"] and len(base64.b64decode(outputs["audio_wav_base64"])) > 44  # noise, but spoken
    client = readme_block("With OpenAI's client:", "python").replace("localhost:8000", where)
    done = subprocess.run([sys.executable, "-c", client], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
