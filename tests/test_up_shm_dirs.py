"""Meshes on one host do not touch each other's shared memory: `omni-mesh up` gives each its own
private directory (OMNI_MESH_SHM_DIR of every process it starts), unless the user named one.

Before, every mesh kept its segments in /dev/shm itself: a get by key in one mesh scanned and flagged
every other mesh's pools (which then copied their tiny payloads in for it), and a mesh's stop looked
through the others' segments.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from support.meshkit import Mesh, running_mesh, segments_in, write_topology

from omni_mesh.connectors import ConnectorError, create_connector
from omni_mesh.connectors.shm.meshdir import DIR_PREFIX
from omni_mesh.connectors.shm.segments import ENV_DIR
from omni_mesh.connectors.shm.wanted import WANTED_AT
from omni_mesh.launcher import Launcher
from omni_mesh.ports import free_port
from omni_mesh.topology import load_topology

TOPOLOGY = {
    "name": "shm-dirs",
    "connectors": {"shm": {"name": "SharedMemoryConnector"}},
    "stages": [
        {
            "stage_id": 0,
            "name": "a",
            "handler": "mesh_handlers:step",
            "output_connectors": {"to_stage_1": "shm"},
        },
        {
            "stage_id": 1,
            "name": "d",
            "handler": "mesh_handlers:step",
            "input_connectors": {"from_stage_0": "shm"},
            "final_output": True,
        },
    ],
}
TINY, POOLED = 4, 8192  # float64 elements: a payload in the metadata, one in a pool slot


def serve(mesh: Mesh) -> None:
    for n in (TINY, POOLED):
        assert mesh.ok({"n": n})["outputs"]["n"] == n


def own_dir(mesh: Mesh) -> Path:
    mesh.remember_tree()
    directory = mesh.own_shm_dir()
    assert directory is not None, "the mesh's processes keep their segments in /dev/shm itself"
    return directory


def wanted_flags(directory: Path) -> dict[str, int]:
    """The `wanted by key` byte of every pool's first segment in `directory`."""
    flags = {}
    for name in segments_in(directory):
        if "_p" not in name and "_x" not in name:
            with open(directory / name, "rb") as segment:
                segment.seek(WANTED_AT)
                flags[name] = segment.read(1)[0]
    return flags


def test_two_meshes_each_keep_to_a_directory_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_DIR, raising=False)
    with running_mesh(tmp_path / "one", TOPOLOGY) as one, running_mesh(tmp_path / "two", TOPOLOGY) as two:
        serve(one)
        serve(two)
        first, second = own_dir(one), own_dir(two)
        assert first != second and first.parent == second.parent == Path("/dev/shm")
        for directory in (first, second):
            info = directory.stat()
            assert directory.name.startswith(f"{DIR_PREFIX}shm-dirs-"), directory
            assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        assert one.our_segments() and set(one.our_segments()) <= set(segments_in(first))
        assert two.our_segments() and set(two.our_segments()) <= set(segments_in(second))
        assert not [n for n in segments_in(Path("/dev/shm")) if n in one.our_segments() + two.our_segments()]

        # A get by key in mesh one (a process of its own directory) flags mesh one's pools only: mesh
        # two's producers keep making no copies of their tiny payloads for it.
        monkeypatch.setenv(ENV_DIR, str(first))
        getter = create_connector("SharedMemoryConnector", {})
        try:
            assert getter.get("a", "d", "nobody-put-this") is None
        finally:
            getter.close()
        assert set(wanted_flags(first).values()) == {1}, wanted_flags(first)
        assert set(wanted_flags(second).values()) == {0}, wanted_flags(second)
        serve(two)
        assert set(wanted_flags(second).values()) == {0}

        # Stopping mesh one removes its directory and leaves mesh two's segments as they were.
        held = set(segments_in(second))
        one.stop()
        assert not first.exists()
        assert held <= set(segments_in(second))
        serve(two)


def test_a_directory_the_user_names_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = Path("/dev/shm") / f"omni-mesh-users-dir-{os.getpid()}"
    monkeypatch.setenv(ENV_DIR, str(mine))
    launcher = Launcher(load_topology(write_topology(tmp_path, TOPOLOGY)), port=free_port())
    assert all(child.env[ENV_DIR] == str(mine) for child in launcher.children)
    # The user's directory is neither made nor removed; a missing one is named before anything starts.
    with pytest.raises(ConnectorError, match=f"{ENV_DIR}={mine} does not exist"):
        launcher.start()
    assert not mine.exists() and all(child.process is None for child in launcher.children)
    mine.mkdir(mode=0o700)
    try:
        launcher.shm.create()
        assert launcher.shm.remove() == [] and mine.is_dir()
    finally:
        mine.rmdir()


def test_a_mesh_of_its_own_directory_names_it_in_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_DIR, raising=False)
    launcher = Launcher(load_topology(write_topology(tmp_path, TOPOLOGY)))
    directory = launcher.shm.path
    assert {child.env[ENV_DIR] for child in launcher.children} == {str(directory)}
    assert ENV_DIR not in os.environ  # the launcher's own process is left as it was
    launcher.shm.create()
    try:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        (directory / "omnimesh_1_2_3_00000000").write_bytes(b"x")  # what a killed process left
        assert launcher.shm.remove() == ["omnimesh_1_2_3_00000000"]
        assert not directory.exists()
    finally:
        launcher.shm.remove()
