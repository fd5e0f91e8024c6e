"""The first hour with `omni-mesh up` (issue 41 item 5), run as a user runs it: the real CLI in a
subprocess. Ports are checked before anything starts (one line, no traceback, no process left), and
closing the terminal (SIGHUP) stops the mesh as Ctrl-C does, leaving nothing in /dev/shm."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from support.meshkit import OMNI_MESH, running_mesh, write_topology

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
    return subprocess.run(
        [str(OMNI_MESH), "up", str(path), *flags], cwd=directory, capture_output=True, text=True, timeout=60
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


def test_transformers_chatter_is_quiet_at_the_default_log_level(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    done = subprocess.run(
        [str(OMNI_MESH), "models", "tiny", "qwen2_5_omni", str(tmp_path / "tiny")],
        capture_output=True, text=True, timeout=600, env={k: v for k, v in os.environ.items() if not k.startswith(QUIET)},
    )
    assert done.returncode == 0, done.stderr
    # The tiny config's out-of-vocabulary warnings and the shard-writing progress bar, before the fix.
    assert "[transformers]" not in done.stderr and "it/s]" not in done.stderr, done.stderr
