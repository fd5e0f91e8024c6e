"""A mesh's own shared-memory directory: what `omni-mesh up` gives the processes it starts.

Meshes that share /dev/shm see each other's pools: a get by key in one scans (and flags, so that
they keep copies of their tiny payloads) every pool in the directory. So `up` makes a private
directory (mode 0700) under /dev/shm, named for the mesh and unique per run, hands it to every
process through OMNI_MESH_SHM_DIR, and removes it, with whatever is left in it, when the mesh stops.
A user who set OMNI_MESH_SHM_DIR keeps that directory: nothing is made or removed then.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.shm.segments import DEFAULT_DIR, ENV_DIR

#: Per-mesh directories are named `omnimesh-<mesh>-<random>`; segments are `omnimesh_...` (a dash, not
#: an underscore), so a scan of /dev/shm for segments never takes a directory for one.
DIR_PREFIX = "omnimesh-"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.]+")


class MeshShmDir:
    """The shared-memory directory of one mesh: `own` when the mesh makes (`create`) and removes
    (`remove`) it; otherwise the user's, left as it is."""

    def __init__(self, path: Path, *, own: bool) -> None:
        self.path = path
        self.own = own

    @classmethod
    def for_mesh(cls, mesh: str, env: dict[str, str], parent: Path = Path(DEFAULT_DIR)) -> MeshShmDir:
        """The directory of mesh `mesh` whose processes get `env`: the one `env` names
        (OMNI_MESH_SHM_DIR: the user's choice wins), else a new one of its own, named in `env`."""
        if env.get(ENV_DIR):
            return cls(Path(env[ENV_DIR]), own=False)
        slug = _UNSAFE.sub("-", mesh).strip("-.")[:40] or "mesh"
        directory = cls(parent / f"{DIR_PREFIX}{slug}-{secrets.token_hex(4)}", own=True)
        env[ENV_DIR] = str(directory.path)
        return directory

    def create(self) -> None:
        """Make our own directory, private to this user; never one that exists (someone else's). The
        user's must exist: said now, naming it, rather than at the first put of every stage."""
        if not self.own:
            if not self.path.is_dir():
                raise ConnectorError(
                    f"shared-memory directory {ENV_DIR}={self.path} does not exist: create it (mode 0700, on "
                    f"a tmpfs such as {DEFAULT_DIR}), or unset {ENV_DIR} and the mesh gets one of its own"
                )
            return
        try:
            os.mkdir(self.path, 0o700)
        except OSError as exc:
            raise ConnectorError(
                f"cannot make the mesh's shared-memory directory {self.path}: {exc.strerror}; set "
                f"{ENV_DIR} to a directory of yours (mode 0700) on a tmpfs"
            ) from None
        os.chmod(self.path, 0o700)  # whatever the umask

    def remove(self) -> list[str]:
        """Unlink what is left in our own directory (plain files: a mesh makes nothing else there),
        then the directory; returns the names unlinked."""
        removed: list[str] = []
        if not self.own:
            return removed
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.path):
                with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
        return removed
