"""Shared-memory segment names cannot be squatted, and the segments' directory must be private.

Another local user who pre-creates the names a pool would grow by (or many names that look like
them) cannot make a large put fail: names carry a random part and a name already taken is skipped
for a fresh one. OMNI_MESH_SHM_DIR is read when a segment is made, and a directory that is missing,
owned by another user or writable by others is refused with its path, owner and mode.
Real processes (tests/support/shm_consumer.py), real files; squatters' files are owned by `nobody`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.shm_kit import ShmPeer as Peer
from support.shm_kit import connector, our_segments

from omni_mesh import codec
from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.shm.segments import (
    CREATE_TRIES,
    ENV_DIR,
    ProcessIdentity,
    create_unique_segment,
    new_token,
    owner_of,
    segment_name,
    shm_dir,
    unlink_segment,
)

MiB = 1 << 20
NOBODY = 65534
POOL = {"memory_pool_size": 2 * MiB, "inline_max_bytes": 0, "max_pool_size": 20 * MiB}

pytestmark = pytest.mark.usefixtures("no_segment_left")  # tests/conftest.py


def squat(path: Path) -> None:
    """A file another user made where we might make a segment."""
    path.write_bytes(b"")
    os.chown(path, NOBODY, NOBODY)


@contextlib.contextmanager
def squatted(names: list[str]) -> Iterator[list[Path]]:
    paths = [shm_dir() / name for name in names]
    try:
        for path in paths:
            squat(path)
        yield paths
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


def payload(mib: int, fill: float) -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.full((mib * MiB // 4,), fill)}


def test_a_large_put_succeeds_when_every_name_of_old_and_many_others_are_squatted() -> None:
    """The producer is a process of its own; its first segment is public (the directory can be
    listed), so a squatter knows its prefix: the names growth and one-offs used to take (`_p1`,
    `_x1`, ...) and a thousand more are taken before the large puts. They all succeed, in a grown
    segment and in one-offs, and no squatted file is touched."""
    producer = Peer(POOL)
    try:
        first = producer.call("put", from_stage="a", to_stage="b", put_key="small/0",
                              frame=bytes(codec.encode(payload(1, 0.0))))
        assert first["ok"], first
        (pool,) = [name for name in our_segments() if owner_of(name).pid == producer.pid]  # its first
        names = [f"{pool}_{kind}{n}" for kind in "px" for n in range(1, 501)]
        with squatted(names) as paths, connector() as consumer:
            for i in range(3):  # 2 + 16 MiB fit under 20 MiB: one growth, then one-offs
                value = payload(6, float(i + 1))
                reply = producer.call("put", from_stage="a", to_stage="b", put_key=f"large/{i}",
                                      frame=bytes(codec.encode(value)))
                assert reply["ok"], reply
                assert reply["metadata"]["segment"] not in names
                got, _ = consumer.get("a", "b", f"large/{i}", reply["metadata"])
                assert torch.equal(got["hidden_states"], value["hidden_states"])
                del got
            for path in paths:
                info = path.stat()
                assert (info.st_uid, info.st_size) == (NOBODY, 0), path
    finally:
        producer.kill()
        for name in our_segments():
            if f"_{producer.pid}_" in name:
                unlink_segment(name)


def test_a_taken_name_is_skipped_for_a_fresh_one_a_few_times_then_the_error_says_why() -> None:
    me = ProcessIdentity.current()
    names = [segment_name(me, new_token()) for _ in range(CREATE_TRIES + 1)]
    with squatted(names[:3]):
        tried = iter(names)
        name, mm = create_unique_segment(lambda: next(tried), 4096, populate=False)
        try:
            assert name == names[3] and stat.S_IMODE((shm_dir() / name).stat().st_mode) == 0o600
        finally:
            mm.close()
            unlink_segment(name)
    with squatted(names[:CREATE_TRIES]):
        tried = iter(names)
        with pytest.raises(ConnectorError, match=f"{CREATE_TRIES} fresh random segment names were all taken in "):
            create_unique_segment(lambda: next(tried), 4096, populate=False)
        assert (shm_dir() / names[CREATE_TRIES]).exists() is False


@pytest.fixture
def own_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of this test's as OMNI_MESH_SHM_DIR, set long after omni_mesh was imported."""
    directory = Path("/dev/shm") / f"omni-mesh-dir-test-{os.getpid()}"
    monkeypatch.setenv(ENV_DIR, str(directory))
    yield directory
    with contextlib.suppress(FileNotFoundError):
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()


def _put_error(config: dict | None = None) -> str | None:
    with connector(config) as conn:
        try:
            conn.put_or_raise("a", "b", "k", payload(1, 1.0))
        except ConnectorError as exc:
            return str(exc)
        return None


def test_the_directory_is_read_when_needed_and_a_private_one_is_used(own_dir: Path) -> None:
    own_dir.mkdir(mode=0o700)
    assert _put_error() is None
    assert not any(own_dir.iterdir())  # closed: its segments are gone


def test_a_missing_directory_is_reported_as_missing_not_as_full(own_dir: Path) -> None:
    error = _put_error()
    assert error is not None
    assert f"shared-memory directory {ENV_DIR}={own_dir} does not exist" in error, error
    assert "full" not in error and "No space" not in error, error


@pytest.mark.parametrize(
    ("owner", "mode", "said"),
    [(NOBODY, 0o700, f"owned by uid {NOBODY} with mode 700"), (0, 0o777, "with mode 777"), (0, 0o720, "mode 720")],
)
def test_a_directory_another_user_owns_or_can_write_to_is_refused(
    own_dir: Path, owner: int, mode: int, said: str
) -> None:
    own_dir.mkdir()
    os.chmod(own_dir, mode)
    os.chown(own_dir, owner, owner)
    error = _put_error()
    assert error is not None and f"{ENV_DIR}={own_dir} is " in error and said in error, error
    assert "writable by nobody else (mode 0700)" in error
    assert not any(own_dir.iterdir())


def test_the_systems_dev_shm_is_accepted_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm is the system's (sticky 1777, or 0777 where Kubernetes mounts a memory emptyDir): the
    ownership rule is for directories someone else could have made in its place."""
    monkeypatch.setenv(ENV_DIR, "/dev/shm")
    with connector() as conn:
        _, metadata = conn.put_or_raise("a", "b", "k", payload(1, 1.0))
        assert (Path("/dev/shm") / metadata["segment"]).exists()
    assert not (Path("/dev/shm") / metadata["segment"]).exists()
