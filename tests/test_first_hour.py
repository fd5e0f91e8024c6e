"""The first hour with `omni-mesh up` (issue 41 item 5), run as a user runs it: the real CLI in a
subprocess. Ports are checked before anything starts (one line, no traceback, no process left),
closing the terminal (SIGHUP) stops the mesh as Ctrl-C does, leaving nothing in /dev/shm, a stream
still running past the grace ends with an error event saying the server stops, and `omni-mesh scale`
changes a running stage's replicas."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
from support.meshkit import OMNI_MESH, running_mesh, start_mesh, stopped_after, wait_for, write_topology

from omni_mesh.connectors.shm.meshdir import DEFAULT_DIR, DIR_PREFIX
from omni_mesh.ports import free_port

#: The variables omni_mesh.logs sets: the test runs without any the environment already has.
QUIET = ("TRANSFORMERS_", "HF_HUB_DISABLE_PROGRESS_BARS")
CHAIN = {
    "name": "first-hour",
    "stages": [
        {"stage_id": 0, "name": "a", "handler": "mesh_handlers:step"},
        {"stage_id": 1, "name": "b", "handler": "mesh_handlers:step", "engine_input_source": [0]},
    ],
}


def up(directory: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    path = write_topology(directory, CHAIN)
    outside_make = {name: value for name, value in os.environ.items() if name != "MAKELEVEL"}  # `make test`
    return subprocess.run(
        [str(OMNI_MESH), "up", str(path), *flags], cwd=directory, capture_output=True, text=True, timeout=60,
        env=outside_make,
    )


def one_line_error(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert "coordinator" not in done.stdout + done.stderr.split(":", 1)[1]  # nothing was started
    for word in words:
        assert word in done.stderr, done.stderr


@pytest.mark.parametrize("flags", [("--port", "99999"), ("--port", "0"), ("--control-port", "70000")])
def test_a_port_out_of_range_is_one_line_before_anything_starts(tmp_path: Path, flags: tuple[str, str]) -> None:
    one_line_error(up(tmp_path, *flags), f"{flags[0]} {flags[1]}: not a TCP port (1-65535)")


def test_rest_and_control_on_one_port_is_refused(tmp_path: Path) -> None:
    port = str(free_port())
    one_line_error(up(tmp_path, "--port", port, "--control-port", port), "--port and --control-port are both")


def test_a_port_in_use_is_named_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        one_line_error(up(tmp_path, "--port", str(taken)), f"--port {taken}: already in use on 127.0.0.1")
        one_line_error(
            up(tmp_path, "--port", str(free_port()), "--control-port", str(taken)), f"--control-port {taken}: already in use"
        )


def test_sighup_stops_the_mesh_as_ctrl_c_does(tmp_path: Path) -> None:
    # running_mesh's stop sends SIGHUP, waits for exit 0, and checks that no process, no segment and
    # not the mesh's own shared-memory directory is left.
    with running_mesh(tmp_path, CHAIN, sig=signal.SIGHUP) as mesh:
        assert mesh.ok({"n": 4})["outputs"]["trail"] == ["a", "b"]


def test_an_engine_like_stage_starts_and_stops_without_noise_in_the_log(tmp_path: Path) -> None:
    """A handler that loads for seconds and keeps a model thread, idle between requests, as an engine
    does: `up`'s polls of /ready while it loads (five a second) were each an INFO line, and Ctrl-C took
    the idle thread for a stuck one (a warning and every thread's stack per replica, 3 s more to stop)."""
    topology = {**CHAIN, "stages": [{**CHAIN["stages"][0], "handler": "mesh_handlers:Threaded"}, CHAIN["stages"][1]]}
    with running_mesh(tmp_path, topology) as mesh:
        assert mesh.ok({"n": 4})["outputs"]["trail"] == ["a", "b"]
    log = mesh.log()
    assert "replica a-0 of stage a ready" in log and "GET /ready" not in log, log[-3000:]
    assert "replica a-0 draining" in log and "still stuck" not in log and "most recent call first" not in log, log[-3000:]


def test_transformers_chatter_is_quiet_at_the_default_log_level(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    done = subprocess.run(
        [str(OMNI_MESH), "models", "tiny", "qwen2_5_omni", str(tmp_path / "tiny")],
        capture_output=True, text=True, timeout=600, env={k: v for k, v in os.environ.items() if not k.startswith(QUIET)},
    )
    assert done.returncode == 0, done.stderr
    # The tiny config's out-of-vocabulary warnings and the shard-writing progress bar, before the fix.
    assert "[transformers]" not in done.stderr and "it/s]" not in done.stderr, done.stderr


def scale(mesh_url: str, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMNI_MESH_API_KEY"}
    flags = ["--api-key", key] if key else []
    return subprocess.run(
        [str(OMNI_MESH), "scale", *args, "--url", mesh_url.removeprefix("http://"), *flags],
        capture_output=True, text=True, timeout=60, env=env,
    )


def test_scale_a_stage_of_a_running_mesh(tmp_path: Path) -> None:
    key = "scale-test-key"
    with running_mesh(tmp_path, CHAIN, "--max-replicas-total", "4", env={"OMNI_MESH_API_KEY": key}, headers={"authorization": f"Bearer {key}"}) as mesh:
        pids = lambda: sorted(r["pid"] for r in mesh.stages()["b"] if r["health"] == "healthy")  # noqa: E731
        first = pids()
        assert len(first) == 1
        done = scale(mesh.url, "b", "2", key=key)
        assert done.returncode == 0, done.stderr
        assert "b: 1 -> 2 replicas" in done.stdout
        two = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(pids()), 60, "b at 2 replicas")
        assert set(first) < set(two)
        assert mesh.ok({"n": 4})["outputs"]["trail"] == ["a", "b"]
        assert scale(mesh.url, "b", "1", key=key).returncode == 0
        wait_for(lambda: len(mesh.stages()["b"]) == 1, 60, "b back at 1 replica")
        assert mesh.ok({"n": 4})["outputs"]["trail"] == ["a", "b"]
        # Refusals: one line each, naming what is wrong, and nothing changes.
        for args, key_given, words in [
            (("c", "2"), key, ["no stage 'c'", "its stages: a, b"]),
            (("b", "0"), key, ["replicas must be at least 1"]),
            (("b", "4"), key, ["past the host cap of 4", "--max-replicas-total"]),
            (("b", "2"), None, ["missing or wrong API key"]),
        ]:
            done = scale(mesh.url, *args, key=key_given)
            assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done
            assert "Traceback" not in done.stderr and all(w in done.stderr for w in words), done.stderr
        assert [s["target_replicas"] for s in mesh.client.get("/v1/stages").json()["stages"]] == [1, 1]


def test_a_stream_past_the_grace_ends_saying_the_server_stops(tmp_path: Path) -> None:
    mesh = start_mesh(tmp_path, CHAIN)  # `up` gives the coordinator a grace of 10 s
    lines: list[str] = []
    payload = {"inputs": {"n": 4}, "params": {"hang": "b"}, "timeout_s": 120, "stream": True}

    def read() -> None:
        with httpx.stream("POST", f"{mesh.url}/v1/requests", json=payload, timeout=60) as response:
            lines.extend(response.iter_lines())

    reader = threading.Thread(target=read)
    with stopped_after(mesh):
        reader.start()
        wait_for(lambda: any(r["inflight"] for r in mesh.stages()["b"]), 20, "the request at b")
    reader.join(30)
    assert not reader.is_alive()
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert events[-1:] == ["error"], lines
    assert data[-1]["status"] == 503 and "the server is stopping" in data[-1]["error"], data
    log = mesh.log()
    assert "server stopping" in log, log[-4000:]
    assert "went away" not in log and " 499 " not in log and "CancelledError" not in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]


#: Handlers that cannot start, as a user's are: a module that raises on import, a class whose warm() raises.
BROKEN = {
    "broken_import.py": 'raise RuntimeError("no accelerator here")\n\n\nasync def step(inputs, ctx):\n    return inputs\n',
    "broken_warm.py": (
        "class Model:\n    @classmethod\n    def from_stage(cls, options):\n        return cls()\n\n"
        '    async def warm(self):\n        raise FileNotFoundError("model directory /models/none is missing")\n\n'
        "    async def __call__(self, inputs, ctx):\n        return inputs\n"
    ),
}


def up_broken(directory: Path, handler: str, replicas: int, *flags: str) -> subprocess.CompletedProcess[str]:
    for name, source in BROKEN.items():
        (directory / name).write_text(source)
    stages = [{"stage_id": 0, "name": "thinker", "handler": handler, "replicas": replicas}]
    path = write_topology(directory, {"name": mesh_name(directory), "stages": stages}, handlers=False)
    return subprocess.run(
        [str(OMNI_MESH), "up", str(path), "--port", str(free_port()), *flags],
        cwd=directory, capture_output=True, text=True, timeout=60,
    )


def mesh_name(directory: Path) -> str:
    return "broken-" + hashlib.sha1(str(directory).encode()).hexdigest()[:12]  # its shm directory's name


def left_behind(directory: Path) -> list[str]:
    """Processes started on the topology in `directory`, and the mesh's shared-memory directory."""
    processes = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and str(directory).encode() in (proc / "cmdline").read_bytes():
                processes.append(f"pid {proc.name}")
    return processes + [str(p) for p in Path(DEFAULT_DIR).glob(f"{DIR_PREFIX}{mesh_name(directory)}-*")]


@pytest.mark.parametrize(
    ("handler", "replicas", "cause"),
    [
        ("broken_import:step", 2, "RuntimeError: no accelerator here"),
        ("broken_warm:Model", 1, "FileNotFoundError: model directory /models/none is missing"),
    ],
)
def test_a_stage_that_cannot_start_is_one_line_per_replica(tmp_path: Path, handler: str, replicas: int, cause: str) -> None:
    done = up_broken(tmp_path, handler, replicas)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    failed = [line for line in done.stderr.splitlines() if "failed to start" in line]
    assert failed, done.stderr
    assert all(line.endswith(cause) for line in failed), done.stderr
    # Each names its replica (the launcher stops the others as soon as one exits: some may not get as far).
    assert {line.split(" ERROR ", 1)[1].split(" failed")[0] for line in failed} <= {
        f"stage 'thinker' (replica thinker-{i})" for i in range(replicas)
    }, failed
    wait_for(lambda: not left_behind(tmp_path), 5.0, "nothing left behind")
    debug = up_broken(tmp_path, handler, replicas, "--log-level", "debug")
    assert debug.returncode == 1 and "failed to start" in debug.stderr, debug.stderr
    assert "Traceback" in debug.stderr and cause in debug.stderr, debug.stderr
    wait_for(lambda: not left_behind(tmp_path), 5.0, "nothing left behind")


def test_a_handler_module_that_raises_when_up_imports_it_is_one_line(tmp_path: Path) -> None:
    # Its source does not show the name, so `up` imports it to check it, before anything starts.
    (tmp_path / "hidden.py").write_text('raise RuntimeError("no accelerator here")\nglobals()["step"] = None\n')
    stages = [{"stage_id": 0, "name": "thinker", "handler": "hidden:step"}]
    path = write_topology(tmp_path, {"name": "hidden", "stages": stages}, handlers=False)
    done = subprocess.run([str(OMNI_MESH), "up", str(path), "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    one_line_error(done, "stage 'thinker': handler 'hidden:step' raised RuntimeError: no accelerator here (nothing started)")
