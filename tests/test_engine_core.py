"""The batched thinker's engine core (omni_mesh.engines.core) in a real mesh (`omni-mesh up`: one thinker
replica of a tiny random Qwen2.5-Omni, text only, `max_batch: 4`, one torch thread):

- the model and the running batch run in a process of the replica's own (its child), reached through
  ipc sockets in a directory only this user can open, and the replies are the ones generate() gives
  each prompt alone;
- a request refused before it starts (its prompt too long) is a 4xx naming the limit, and the core keeps
  nothing of it; a client that leaves mid-reply frees its place in the core's batch;
- `core_process: false` keeps the batch in the replica's process (no child), with the same replies;
- a core that cannot load its model: `up` says why, the core's own error named, and starts nothing;
- the core killed while requests wait on it: they fail at once with an error naming the stage and how the
  core died, the replica makes way for a new one (the launcher restarts it, with a new core) that serves
  again, and the old core's socket directory is gone.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.batch_requests import PROMPTS, REPLY_TOKENS, alone_texts, chat  # noqa: E402
from support.meshkit import running_mesh, settled, up_command, wait_for, write_topology  # noqa: E402

from omni_mesh.engines.tiny import build_tiny  # noqa: E402
from omni_mesh.ports import free_port  # noqa: E402
from omni_mesh.procinfo import descendants  # noqa: E402

MAX_PROMPT_TOKENS = 64


def topology(**engine: Any) -> dict:
    return {"name": "core", "stages": [{
        "stage_id": 0, "name": "thinker", "final_output": True, "max_inflight": 8,
        "engine": {"part": "thinker", "model": "${OMNI_MESH_MODEL}", "threads": 1, "max_batch": 4,
                   "max_prompt_tokens": MAX_PROMPT_TOKENS, **engine},
    }]}


def params(i: int) -> dict:
    return {"temperature": 0, "max_tokens": REPLY_TOKENS[i], "seed": 1}


def text_of(outputs: list[dict]) -> str:
    return "".join(chunk.get("text") or "" for chunk in outputs)


def core_of(replica_pid: int) -> tuple[int, Path]:
    """The replica's engine core: its pid and its socket directory (from its command line)."""
    children = sorted(descendants(replica_pid))
    assert len(children) == 1, f"replica {replica_pid}: one engine core expected, found children {children}"
    argv = Path(f"/proc/{children[0]}/cmdline").read_bytes().split(b"\0")
    assert b"omni_mesh.engines.core" in argv, argv
    inbox = argv[argv.index(b"--inbox") + 1].decode()
    return children[0], Path(inbox.removeprefix("ipc://")).parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("q25"))


@pytest.fixture(scope="module")
def mesh(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_mesh(tmp_path_factory.mktemp("core_mesh"), topology(),
                      env={"OMNI_MESH_MODEL": str(checkpoint)}) as running:
        yield running


def test_the_model_runs_in_a_core_of_the_replicas_own_and_replies_as_alone(mesh: Any, checkpoint: Path) -> None:
    replica = mesh.replica("thinker")
    assert replica is not None
    pid, directory = core_of(replica["pid"])
    info = directory.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid(), oct(info.st_mode)
    assert sorted(p.name for p in directory.iterdir()) == ["events", "requests"]
    texts = alone_texts(checkpoint, [params(i) for i in range(len(PROMPTS))])
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda i: mesh.ok(chat(PROMPTS[i]), params=params(i), timeout_s=60), range(len(PROMPTS))))
    assert [text_of(r["outputs"]) for r in replies] == texts
    counters = settled(lambda: mesh.replica("thinker")["counters"], 20, "the thinker's counters")
    assert counters["generated_tokens_total"] >= sum(REPLY_TOKENS) // 2 and counters["batch_max"] == 4, counters
    assert counters["batch_steps_total"] < counters["batch_rows_stepped_total"], counters  # rows shared steps
    assert core_of(replica["pid"])[0] == pid  # the same core throughout


def test_core_process_false_keeps_the_batch_in_the_replica(checkpoint: Path, tmp_path: Path) -> None:
    texts = alone_texts(checkpoint, [params(i) for i in range(len(PROMPTS))])
    with running_mesh(tmp_path, topology(core_process=False), env={"OMNI_MESH_MODEL": str(checkpoint)}) as mesh:
        replica = mesh.replica("thinker")
        assert replica is not None and not descendants(replica["pid"])
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(pool.map(lambda i: mesh.ok(chat(PROMPTS[i]), params=params(i), timeout_s=60),
                                    range(len(PROMPTS))))
        assert [text_of(r["outputs"]) for r in replies] == texts
        counters = settled(lambda: mesh.replica("thinker")["counters"], 20, "the thinker's counters")
        assert counters["batch_steps_total"] < counters["batch_rows_stepped_total"], counters


def test_a_core_that_cannot_load_its_model_stops_up_with_its_reason(checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:64])  # the header is there, the tensors are not
    path = write_topology(tmp_path / "mesh", topology(), handlers=False)
    result = subprocess.run(up_command(path, free_port()), capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "OMNI_MESH_MODEL": str(broken)})
    assert result.returncode != 0, result.stderr[-3000:]
    assert "stage 'thinker': its engine core could not start" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]  # one line says it


def test_a_refused_prompt_is_a_4xx_and_a_client_that_leaves_frees_its_place(mesh: Any) -> None:
    response = mesh.request(chat("word " * 200), params={"temperature": 0}, timeout_s=30)
    assert response.status_code == 422, response.text
    assert "prompt too long" in response.text and str(MAX_PROMPT_TOKENS) in response.text, response.text

    body = {"inputs": chat(PROMPTS[3]), "params": {"temperature": 0, "max_tokens": 200}, "timeout_s": 30, "stream": True}
    with mesh.client.stream("POST", "/v1/requests", json=body, timeout=30) as stream:
        assert stream.status_code == 200
        next(stream.iter_lines())  # the first event came: the request is in the batch; leave
    counters = settled(lambda: mesh.replica("thinker")["counters"], 20, "the thinker's counters")
    assert (counters["batch_running"], counters["batch_queued"], counters["kv_cache_used_tokens"]) == (0, 0, 0), counters
    assert text_of(mesh.ok(chat(PROMPTS[0]), params=params(0), timeout_s=30)["outputs"])


def test_a_killed_core_fails_its_requests_at_once_and_the_replica_comes_back(mesh: Any) -> None:
    replica = mesh.replica("thinker")
    assert replica is not None
    core, directory = core_of(replica["pid"])
    os.kill(core, signal.SIGSTOP)  # requests now wait on it, deterministically
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(mesh.request, chat(PROMPTS[i]), params=params(i), timeout_s=60) for i in range(2)]
        wait_for(lambda: mesh.replica("thinker")["inflight"] == 2, 10, "both requests at the thinker")
        os.kill(core, signal.SIGKILL)
        responses = [future.result(timeout=30) for future in waiting]
    for response in responses:
        assert response.status_code >= 500, response.text
        assert "'thinker'" in response.text and "engine core" in response.text and "SIGKILL" in response.text, response.text

    def restarted() -> dict | None:
        found = mesh.replica("thinker")
        return found if found and found["pid"] != replica["pid"] and found.get("state", "ready") == "ready" else None

    again = wait_for(restarted, 120, "a new thinker replica")
    assert again["restarts"] >= 1, again
    assert not directory.exists(), f"the dead core's socket directory {directory} is left behind"
    assert core_of(again["pid"])[0] != core
    reply = wait_for(lambda: (r := mesh.request(chat(PROMPTS[0]), params=params(0), timeout_s=30)).status_code == 200 and r,
                     60, "a reply from the new replica")
    assert text_of(reply.json()["outputs"])
