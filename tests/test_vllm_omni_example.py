"""docs/vllm-omni.md, run as a reader runs it: its YAML block saved under the name its commands use,
then its commands, in a fresh directory, with the venv's `omni-mesh` first on PATH. The code blocks
are read from the doc, so the doc and this test cannot drift apart. Only the port is changed (a free
one instead of 8000). The engines load a tiny random checkpoint: tens of seconds on a CPU.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("transformers")  # the engines extra, as in tests/test_engines_qwen2_5_omni.py

from support.meshkit import wait_for  # noqa: E402

from omni_mesh.ports import free_port  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm-omni.md"
READY_TIMEOUT_S = 600  # `up`'s own wait for a mesh with engines


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", DOC.read_text(), re.S | re.M)


def commands(block: str) -> list[str]:
    """The block's command lines, backslash continuations joined."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_documented_vllm_omni_stage_config_runs_and_answers(tmp_path: Path) -> None:
    (config,) = blocks("yaml")
    (script,) = blocks("bash")
    lines = commands(script)
    assert [line.split()[0] if " up " not in line else "up" for line in lines] == ["omni-mesh", "up", "curl"], lines
    assert "stage_args:" in config and "model_stage: thinker" in config and "runtime:" in config
    name = re.search(r"\bup (\S+\.yaml)", lines[1]).group(1)
    (tmp_path / name).write_text(config)
    port = str(free_port())
    models, up, curl = (line.replace("8000", port) for line in lines)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def run(line: str) -> str:
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{line!r} exited {done.returncode}: {done.stderr[-2000:]}"
        return done.stdout

    run(models)
    assert (tmp_path / "tiny-omni" / "config.json").is_file()
    log = (tmp_path / "up.log").open("w")
    mesh = subprocess.Popen(["bash", "-c", up], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        def ready() -> bool:
            assert mesh.poll() is None, f"`{up}` exited {mesh.returncode}:\n{(tmp_path / 'up.log').read_text()[-3000:]}"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, READY_TIMEOUT_S, "the documented mesh to be ready", interval_s=0.5)
        reply = json.loads(run(curl))
        # Two final stages (vllm-omni's file marks the thinker's text and code2wav's audio final).
        outputs = reply.get("outputs") or {}
        assert set(outputs) == {"stage_0", "stage_2"}, reply
        # The thinker is a generator: its answer is its chunks, one when the client does not stream.
        (thinker,) = outputs["stage_0"]
        assert isinstance(thinker["text"], str) and "talker" not in thinker, thinker
        assert outputs["stage_2"]["text"] == thinker["text"], outputs["stage_2"]["text"]  # carried to the end
        wav = base64.b64decode(outputs["stage_2"]["audio_wav_base64"])
        assert wav[:4] == b"RIFF" and len(wav) > 44, wav[:64]  # a WAV with samples in it
    finally:
        with contextlib.suppress(ProcessLookupError):  # what Ctrl-C does: `up` stops every process it started
            os.killpg(mesh.pid, signal.SIGINT)
        try:
            mesh.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(mesh.pid, signal.SIGKILL)
            mesh.wait()
        log.close()
    assert mesh.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]
