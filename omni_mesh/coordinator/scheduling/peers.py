"""The coordinators of one mesh as `GET /v1/coordinators` lists them (docs/architecture.md, "Several
coordinators").

Under `omni-mesh up --coordinators N` each coordinator writes its own status line (id, pid, ports,
requests served and in flight) to a directory the launcher made for them (OMNI_MESH_COORDINATORS_DIR),
every STATUS_S; each reads them all. A line not rewritten for STALE_S belongs to a coordinator that
stands still or is gone: `unresponsive`, or `down` once its process is gone. Without the directory
(one coordinator, or one pod of a Deployment) a coordinator lists itself alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_mesh.defaults import COORDINATOR_ID_ENV, COORDINATORS_DIR_ENV
from omni_mesh.procinfo import stat_fields

STATUS_S = 0.5  # how often a coordinator rewrites its line
STALE_S = 2.0  # a line older than this: its coordinator is not answering


class Peers:
    def __init__(self, coordinator_id: str | None = None, directory: str | None = None) -> None:
        self.coordinator_id = (
            coordinator_id if coordinator_id is not None else os.environ.get(COORDINATOR_ID_ENV)
        )
        where = directory if directory is not None else os.environ.get(COORDINATORS_DIR_ENV)
        self.directory = Path(where) if where else None
        self.ports: dict[str, Any] = {}  # what it listens on: rest, own (its private REST port), control

    @property
    def name(self) -> str:
        return self.coordinator_id or "c0"

    async def run(self, describe: Callable[[], dict[str, Any]]) -> None:
        """Rewrite our line every STATUS_S (until cancelled); alone (no directory), nothing to write."""
        while self.directory is not None:
            with contextlib.suppress(OSError):  # a full or vanished directory must not stop the loop
                self._write(describe())
            await asyncio.sleep(STATUS_S)

    def _write(self, status: dict[str, Any]) -> None:
        assert self.directory is not None
        path = self.directory / f"{self.name}.json"
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps({**status, "written": time.time()}))
        os.replace(temporary, path)  # a reader sees the old line or the new one, never half of one

    def listing(self, own: dict[str, Any]) -> list[dict[str, Any]]:
        """Every coordinator's line, ours as it is now, sorted by id."""
        found = {self.name: {**own, "health": "healthy"}}
        if self.directory is not None:
            for path in self.directory.glob("*.json"):
                with contextlib.suppress(OSError, ValueError):
                    line = json.loads(path.read_text())
                    if isinstance(line, dict) and line.get("id") != self.name:
                        found[str(line.get("id"))] = _judged(line)
        return [found[key] for key in sorted(found)]

    def describe(self, served: int, inflight: int) -> dict[str, Any]:
        return {
            "id": self.name,
            "pid": os.getpid(),
            "ports": self.ports,
            "served": served,
            "inflight": inflight,
        }

    def close(self) -> None:
        if self.directory is not None:
            with contextlib.suppress(OSError):
                (self.directory / f"{self.name}.json").unlink()


def _judged(line: dict[str, Any]) -> dict[str, Any]:
    """A peer's line with its health: healthy while it keeps rewriting it."""
    written = line.pop("written", 0)
    age = time.time() - written if isinstance(written, int | float) else float("inf")
    pid = line.get("pid")
    if age <= STALE_S:
        health = "healthy"
    elif isinstance(pid, int) and _running(pid):
        health = "unresponsive"
    else:
        health = "down"
    return {**line, "health": health, "status_age_s": round(age, 3)}


def _running(pid: int) -> bool:
    fields = stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")
