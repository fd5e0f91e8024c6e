"""Connector lifecycles: what a replica held is reclaimed by its connector type, through the registry.

Real processes, real /dev/shm, the coordinator's real Registry: a replica's register carries one opaque
token per connector type, and once its process is confirmed gone the type reclaims, with process facts
the coordinator checked itself. A third-party type's hook is called the same way as the built-in one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from support.shm_kit import ShmPeer, our_segments

from omni_mesh import codec
from omni_mesh.connectors import (
    Lifecycle,
    ProcessFacts,
    available_connectors,
    cleanup_tokens,
    connector_class,
    held_by,
    holds,
    lifecycle_of,
    reclaim,
    reclaim_orphans,
    registry,
)
from omni_mesh.connectors.zmq import ZmqConnector
from omni_mesh.control import Register
from omni_mesh.coordinator.scheduling.registry import Registry
from omni_mesh.hostinfo import machine_id, namespace, process_start_time
from omni_mesh.topology import parse_topology

#: A replica's control connection's routing id: random and 16 bytes, as the coordinator requires.
ROUTING_ID = b"replica-id-1-random"

KiB = 1024


def facts(pid: int, start: int | None) -> ProcessFacts:
    return ProcessFacts(pid, start or 0, namespace("pid"), machine_id())


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.mark.parametrize("name", available_connectors())
def test_a_built_in_lifecycle_is_the_class_own(name: str) -> None:
    assert lifecycle_of(name) is connector_class(name).lifecycle


def test_a_lifecycle_is_found_without_importing_the_connector() -> None:
    """The coordinator and the launcher reclaim without torch or a backend."""
    code = (
        "import sys; from omni_mesh.connectors import lifecycle_of, reclaim_orphans;"
        "assert lifecycle_of('SharedMemoryConnector').__name__ == 'SharedMemoryLifecycle';"
        "reclaim_orphans(pid=1);"
        "loaded = [m for m in ('torch', 'omni_mesh.connectors.shared_memory') if m in sys.modules];"
        "assert not loaded, loaded"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_shared_memory_of_a_dead_process_is_reclaimed_through_its_token() -> None:
    producer = ShmPeer({"inline_max_bytes": 0, "max_pool_size": 1, "memory_pool_size": 256 * KiB})
    try:
        frame = bytes(codec.encode(torch.arange(1000)))
        producer.call("put", from_stage="a", to_stage="b", put_key="k", frame=frame)
        names = sorted(held_by({producer.pid}))
        assert names and set(names) <= set(our_segments())
        process = facts(producer.pid, process_start_time(producer.pid))
        tokens = cleanup_tokens(["SharedMemoryConnector", "ZmqConnector"])
        assert tokens["ZmqConnector"] is None  # holds nothing beyond its process
        assert holds(tokens, process)
        # Another /dev/shm's token, or one naming a type nobody knows: nothing here to reclaim.
        assert not holds({"SharedMemoryConnector": {"domain": "elsewhere/1"}, "NoSuchConnector": {}}, process)
        producer.kill()
        assert reclaim({"SharedMemoryConnector": {"domain": "elsewhere/1"}}, process) == []
        assert sorted(held_by({producer.pid})) == names  # SIGKILL leaves them
        assert sorted(reclaim(tokens, process)) == names
        assert held_by({producer.pid}) == [] and not set(names) & set(our_segments())
    finally:
        producer.kill()


def test_the_launcher_reclaims_what_a_dead_child_left_without_a_token() -> None:
    producer = ShmPeer({"inline_max_bytes": 0, "max_pool_size": 1, "memory_pool_size": 256 * KiB})
    try:
        producer.call(
            "put", from_stage="a", to_stage="b", put_key="k", frame=bytes(codec.encode(torch.ones(10)))
        )
        names = sorted(held_by({producer.pid}))
        assert names
        assert reclaim_orphans(pid=producer.pid) == []  # alive: left alone
        producer.kill()
        assert sorted(reclaim_orphans(pid=producer.pid)) == names
    finally:
        producer.kill()


def test_orphans_are_reclaimed_in_the_directory_the_child_ran_with() -> None:
    """`up` gives its children a shared-memory directory of the mesh's own: it reclaims there, naming the
    child's environment, without switching its own (a process-wide variable other threads read)."""
    directory = Path(tempfile.mkdtemp(prefix="omni-mesh-lifecycle-", dir="/dev/shm"))
    os.chmod(directory, 0o700)
    env = {"OMNI_MESH_SHM_DIR": str(directory)}
    producer = ShmPeer({"inline_max_bytes": 0, "max_pool_size": 1, "memory_pool_size": 256 * KiB}, env=env)
    try:
        producer.call(
            "put", from_stage="a", to_stage="b", put_key="k", frame=bytes(codec.encode(torch.ones(10)))
        )
        names = sorted(path.name for path in directory.iterdir())
        assert names
        producer.kill()
        assert reclaim_orphans(pid=producer.pid) == []  # this process's directory holds none of them
        assert sorted(reclaim_orphans(pid=producer.pid, env=env)) == names
        assert list(directory.iterdir()) == []
    finally:
        producer.kill()
        shutil.rmtree(directory, ignore_errors=True)


class Leases(Lifecycle):
    """A third-party type's lifecycle: it records what it was asked to reclaim, for whom."""

    reclaimed: list[tuple[Any, int]] = []

    @classmethod
    def token(cls) -> dict[str, str]:
        return {"lease": "L-7"}

    @classmethod
    def holds(cls, token: Any, process: ProcessFacts) -> bool:
        return isinstance(token, dict) and "lease" in token

    @classmethod
    def reclaim(cls, token: Any, process: ProcessFacts) -> list[str]:
        cls.reclaimed.append((token, process.pid))
        return [f"lease {token['lease']}"]


class LeasingConnector(ZmqConnector):
    lifecycle = Leases


@pytest.fixture
def leasing(monkeypatch: pytest.MonkeyPatch) -> None:
    """LeasingConnector registered for one test (the registry is left as it was)."""
    monkeypatch.setitem(registry.registered, "LeasingConnector", LeasingConnector)
    Leases.reclaimed.clear()


@pytest.mark.usefixtures("leasing")
def test_the_coordinator_reclaims_through_any_type_once_the_process_is_gone() -> None:
    topology = parse_topology(
        {
            "name": "t",
            "stages": [
                {"stage_id": 0, "name": "a"},
                {"stage_id": 1, "name": "b", "engine_input_source": [0]},
            ],
        }
    )
    registry = Registry(topology)
    child = sleeper()
    try:
        start = process_start_time(child.pid)
        message = Register(
            "a",
            "a-0",
            child.pid,
            "host",
            1,
            {},
            start=start,
            machine=machine_id(),
            pidns=namespace("pid"),
            cleanup={**cleanup_tokens(["LeasingConnector"]), "NoSuchConnector": {"lease": "forged"}},
        )
        replica, _ = registry.register(message, ROUTING_ID)
        assert registry.reclaim(replica) == []  # alive: nothing reclaimed, watched instead
        assert registry.silent == {"a-0": replica} and Leases.reclaimed == []
        child.kill()
        child.wait()
        assert registry.reclaim_silent() == ["lease L-7"]
        assert Leases.reclaimed == [({"lease": "L-7"}, child.pid)] and registry.silent == {}
    finally:
        child.kill()
        child.wait()


@pytest.mark.usefixtures("leasing")
def test_a_replica_on_another_machine_is_never_reclaimed_here() -> None:
    topology = parse_topology({"name": "t", "stages": [{"stage_id": 0, "name": "a"}]})
    registry = Registry(topology)
    gone = sleeper()
    gone.kill()
    gone.wait()
    message = Register(
        "a",
        "a-0",
        gone.pid,
        "host",
        1,
        {},
        start=1,
        machine="another-boot-id",
        pidns=namespace("pid"),
        cleanup=cleanup_tokens(["LeasingConnector"]),
    )
    replica, _ = registry.register(message, ROUTING_ID)
    assert not replica.local_process_gone()
    assert registry.reclaim(replica) == [] and Leases.reclaimed == []
