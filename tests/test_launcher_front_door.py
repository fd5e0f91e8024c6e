"""The rest of the front door: `up` on a port in use, /ready naming its mesh, a crash-looping replica,
offline API docs, --version and defaults in --help. Real processes and sockets."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.meshkit import OMNI_MESH, Mesh, running_mesh, start_mesh, up_command, wait_for, write_topology

from omni_mesh import __version__
from omni_mesh.children import EXIT_ORPHANED, PARENT_PID_ENV
from omni_mesh.connectors.shm.segments import owner_of
from omni_mesh.launcher import Launcher
from omni_mesh.ports import free_port
from omni_mesh.topology import load_topology

TOPOLOGY = {
    "name": "front-door",
    "stages": [{"stage_id": 0, "name": "a", "handler": "mesh_handlers:step", "final_output": True}],
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("front-door"), TOPOLOGY) as mesh:
        yield mesh


def test_ready_names_the_mesh_and_its_instance(mesh: Mesh) -> None:
    body = mesh.ready().json()
    assert body["ready"] is True and body["mesh"] == "front-door" and len(body["instance"]) == 32


def test_up_refuses_a_port_in_use_before_starting_anything(mesh: Mesh, tmp_path: Path) -> None:
    path = write_topology(tmp_path, TOPOLOGY)
    port = int(mesh.url.rsplit(":", 1)[1])
    started = time.monotonic()
    outside_make = {name: value for name, value in os.environ.items() if name != "MAKELEVEL"}  # `make test`
    result = subprocess.run(
        up_command(path, port), capture_output=True, text=True, timeout=60, cwd=tmp_path, env=outside_make
    )
    assert result.returncode == 2, result.stderr  # a flag's error, said before anything starts
    assert f"127.0.0.1:{port}" in result.stderr and "pass --port N" in result.stderr, result.stderr
    assert time.monotonic() - started < 15
    assert "ready" not in result.stdout
    assert mesh.ready().status_code == 200  # the running mesh was not disturbed



def test_under_make_a_port_in_use_says_port_n_not_the_flag(mesh: Mesh, tmp_path: Path) -> None:
    """`make run` passes $(PORT) to --port: under make (MAKELEVEL set) the hint is the make variable."""
    path = write_topology(tmp_path, TOPOLOGY)
    port = int(mesh.url.rsplit(":", 1)[1])
    env = {**os.environ, "MAKELEVEL": "1"}
    result = subprocess.run(up_command(path, port), capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr
    assert f"127.0.0.1:{port}" in result.stderr and "run make with PORT=N" in result.stderr, result.stderr
    assert "--port" not in result.stderr, result.stderr


def test_up_with_a_handler_that_cannot_be_imported_says_so_in_one_line_and_starts_nothing(tmp_path: Path) -> None:
    topology = {
        "name": "broken-handler",
        "stages": [{"stage_id": 0, "name": "a", "handler": "no_such_module_here:step", "replicas": 3}],
    }
    path = write_topology(tmp_path, topology)
    started = time.monotonic()
    result = subprocess.run(up_command(path, free_port()), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: stage 'a': cannot load handler 'no_such_module_here:step': No module named 'no_such_module_here' "
        "(nothing started)"
    ], result.stderr
    assert "Traceback" not in result.stdout + result.stderr and "a-0" not in result.stdout
    assert time.monotonic() - started < 30


def test_the_api_docs_load_without_a_cdn(mesh: Mesh) -> None:
    for page, asset in (("/docs", "/docs-assets/swagger-ui-bundle.js"), ("/redoc", "/docs-assets/redoc.standalone.js")):
        html = mesh.client.get(page).text
        assert asset in html and "cdn" not in html.lower() and "googleapis" not in html
        response = mesh.client.get(asset)
        assert response.status_code == 200 and len(response.content) > 100_000
    spec = mesh.client.get("/openapi.json").json()
    assert set(spec["paths"]["/v1/requests"]["post"]["responses"]) >= {"200", "401", "413", "422", "429", "502", "504"}


def test_a_crash_looping_replica_is_given_up_on_with_a_clear_message(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A replica that exits right after every start is restarted a bounded number of times, then left
    down with an error naming it; the launcher keeps the rest of the mesh."""
    launcher = Launcher(load_topology(write_topology(tmp_path, TOPOLOGY)), port=free_port(),
                        max_quick_restarts=2, restart_backoff_s=0.05)
    launcher.coordinator.argv = [sys.executable, "-c", "import time; time.sleep(60)"]  # stays up
    launcher.coordinator.start()
    crasher = launcher.replicas[0]
    crasher.argv = [sys.executable, "-c", "import sys; sys.exit(3)"]
    crasher.start()
    watcher = threading.Thread(target=launcher.supervise)
    watcher.start()
    try:
        deadline = time.monotonic() + 20
        while not crasher.given_up and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        launcher._stop.set()
        watcher.join()
        launcher.coordinator.process.kill()
        launcher.coordinator.process.wait()
    assert crasher.given_up and crasher.restarts == 2
    assert any("giving up on a-0" in r.message and "exited with status 3" in r.message for r in caplog.records)


def test_a_launcher_killed_outright_takes_its_children_with_it(tmp_path: Path) -> None:
    """SIGKILL gives `up` no chance to stop anything: its coordinator and replicas go by their
    parent-death signal, and as they stop on SIGTERM they remove their segments."""
    mesh = start_mesh(tmp_path, {**TOPOLOGY, "stages": [{**TOPOLOGY["stages"][0], "replicas": 2}]})
    try:
        assert mesh.client.post("/v1/requests", json={"inputs": {"n": 1 << 16}}).status_code == 200
        mesh.remember_tree()
        assert len(mesh.alive()) >= 4  # the launcher, the coordinator, two replicas
        mesh.process.kill()
        mesh.process.wait(10)
        wait_for(lambda: not mesh.alive(), 15.0, "the mesh's processes to exit after their launcher's SIGKILL")
        assert mesh.our_segments() == []
    finally:
        mesh.kill()


_FORK_HOOK_THAT_HANGS = """
import os, sys, threading, time
from omni_mesh.children import Child

held, hold = threading.Event(), threading.Lock()
os.register_at_fork(after_in_child=hold.acquire)  # as a library's hook that wants its lock back


def keep_it() -> None:
    with hold:
        held.set()
        time.sleep(120)


threading.Thread(target=keep_it, daemon=True).start()
held.wait()
child = Child("c", [sys.executable, "-c", "pass"])
child.start()
print(child.process.wait(timeout=30))
"""


def test_a_child_starts_while_another_thread_holds_a_lock_a_fork_hook_wants() -> None:
    """No Python runs in a child before exec: a library's fork hook (huggingface_hub's, filelock's)
    that waits for a lock some other thread held at the fork cannot hang the launcher's restarts.
    (With a `preexec_fn` it did: a restart in CI waited 300 s on a child that never reached exec.)"""
    result = subprocess.run([sys.executable, "-c", _FORK_HOOK_THAT_HANGS], capture_output=True, text=True, timeout=20)
    assert result.returncode == 0 and result.stdout.strip() == "0", result.stderr


def test_a_child_whose_launcher_went_before_it_asked_to_die_with_it_exits() -> None:
    """The window between exec and the child's own prctl: a launcher gone by then is noticed."""
    not_its_parent = {**os.environ, PARENT_PID_ENV: "1"}
    result = subprocess.run([sys.executable, "-m", "omni_mesh", "--version"], env=not_its_parent,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == EXIT_ORPHANED and "the launcher (pid 1) is gone" in result.stderr, result


def test_a_crash_looping_coordinator_stops_the_launcher(tmp_path: Path) -> None:
    launcher = Launcher(load_topology(write_topology(tmp_path, TOPOLOGY)), port=free_port(),
                        max_quick_restarts=1, restart_backoff_s=0.05)
    launcher.coordinator.argv = [sys.executable, "-c", "import sys; sys.exit(4)"]
    launcher.replicas = []
    launcher.coordinator.start()
    with pytest.raises(RuntimeError, match="giving up on coordinator"):
        launcher.supervise()


def test_another_meshs_ready_answer_is_not_taken_for_ours(mesh: Mesh, tmp_path: Path) -> None:
    """A launcher whose port check passed (say, the other mesh bound after it) still refuses the
    other mesh's /ready: its instance id is not ours."""
    launcher = Launcher(load_topology(write_topology(tmp_path, TOPOLOGY)), port=int(mesh.url.rsplit(":", 1)[1]),
                        ready_timeout_s=10)
    for child in launcher.children:  # its own processes, stand-ins that just run
        child.argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        child.start()
    try:
        with pytest.raises(RuntimeError, match="another mesh \\('front-door'\\) answers"):
            launcher.wait_ready()
    finally:
        for child in launcher.children:
            child.process.kill()
            child.process.wait()


def test_a_control_port_taken_before_the_coordinator_binds_it_is_picked_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The launcher picks the control port for its children; another process that takes it first
    (here: a plain listener) costs one start-up, not the mesh."""
    launcher = Launcher(load_topology(write_topology(tmp_path, TOPOLOGY)), port=free_port())
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        launcher.use_control_port(squatter.getsockname()[1])
        try:
            launcher.start()
            assert launcher.control != f"tcp://127.0.0.1:{squatter.getsockname()[1]}"
            assert all(launcher.control in child.argv for child in launcher.children)
        finally:
            launcher.stop()
    assert any("was taken before the coordinator bound it" in r.message for r in caplog.records)
    assert not any(child.running() for child in launcher.children)


#: A replica stand-in that makes a shared-memory segment of its own, says so, and ignores SIGTERM (as a
#: replica still waiting to register does).
STUBBORN_REPLICA = """
import signal, sys, time
from omni_mesh.connectors.shm.segments import ProcessIdentity, create_segment, new_token, segment_name
signal.signal(signal.SIGTERM, signal.SIG_IGN)
create_segment(segment_name(ProcessIdentity.current(), new_token()), 4096, populate=False)
print("made", flush=True)
time.sleep(60)
"""


def test_the_replicas_of_an_abandoned_start_are_killed_at_once_and_their_segments_reaped(tmp_path: Path) -> None:
    """A start-up that never became ready holds no request: its replicas get a moment after SIGTERM,
    not a drain grace, and what they leave in the mesh's shared-memory directory is reaped before the
    next start-up."""
    launcher = Launcher(load_topology(write_topology(tmp_path, TOPOLOGY)), port=free_port())
    (replica,) = launcher.replicas
    replica.argv = [sys.executable, "-c", STUBBORN_REPLICA]
    launcher.shm.create()
    process = subprocess.Popen(replica.argv, stdout=subprocess.PIPE, text=True, env=replica.env)
    replica.process = process

    def of_stand_in() -> list[str]:
        return [n for n in os.listdir(launcher.shm.path) if (o := owner_of(n)) and o.pid == process.pid]

    try:
        assert process.stdout.readline() == "made\n"
        assert of_stand_in(), "the stand-in made no segment in the mesh's directory"
        started = time.monotonic()
        launcher._abandon_start()
        assert time.monotonic() - started < 5
        assert process.returncode == -signal.SIGKILL
        assert not of_stand_in()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        launcher.shm.remove()


def test_a_rest_port_taken_between_its_pick_and_up_is_picked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """support.meshkit picks the REST port before `omni-mesh up` binds it; a process that takes it in
    between (a plain listener here, handed out as the first pick) costs one start, not the test."""
    from support import meshkit

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(meshkit, "free_port", lambda: next(picks, None) or free_port())
        with running_mesh(tmp_path, TOPOLOGY) as mesh:
            assert mesh.url != f"http://127.0.0.1:{taken}" and mesh.ready().status_code == 200


def test_version_and_defaults_in_help() -> None:
    version = subprocess.run([str(OMNI_MESH), "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.strip() == f"omni-mesh {__version__}"
    for argv in (["up", "--help"], ["coordinator", "--help"], ["bench", "connector", "--help"]):
        text = subprocess.run([str(OMNI_MESH), *argv], capture_output=True, text=True, timeout=30).stdout
        assert "(default: " in text, argv


def test_port_check_sees_a_plain_listener(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        launcher = Launcher(load_topology(write_topology(tmp_path, TOPOLOGY)), port=port)
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
            launcher.check_port()
