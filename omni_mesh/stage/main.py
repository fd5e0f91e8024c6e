"""Running one replica as a process: `serve_stage` (the replica's coroutine) and `main_stage` (what
`omni-mesh stage` calls once it has read the topology)."""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

from omni_mesh import aio
from omni_mesh.fdlimit import raise_nofile_limit
from omni_mesh.stage.loading import default_replica_id
from omni_mesh.stage.replica import StageReplica
from omni_mesh.topology import Topology

log = logging.getLogger("omni_mesh.stage")


class StartFailed(Exception):
    """A replica that failed before it was ready (its handler's import, `from_stage` or `warm`, a
    connector); the cause is `__cause__`."""

    def __init__(self, stage: str, replica: str) -> None:
        super().__init__(f"stage {stage!r} (replica {replica}) failed to start")


async def serve_stage(topology: Topology, stage_name: str, coordinator: str, **options: Any) -> None:
    # The id is settled first, so that a failure to build the replica can name it too.
    options["replica_id"] = options.get("replica_id") or default_replica_id(
        stage_name, options.get("host") or socket.gethostname()
    )
    replica: StageReplica | None = None
    try:
        replica = StageReplica(topology, topology.stage(stage_name), coordinator, **options)
        await replica.run()
    except Exception as exc:
        if replica is not None and replica.ready:
            raise
        raise StartFailed(stage_name, options["replica_id"]) from exc


def main_stage(topology: Topology, stage_name: str, coordinator: str, **options: Any) -> int:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {stage_name} %(levelname)s %(message)s", stream=sys.stderr
    )
    raise_nofile_limit()
    try:
        aio.run(serve_stage(topology, stage_name, coordinator, **options))
    except StartFailed as exc:
        # One line per replica that cannot start (`up` starts many): the traceback only at debug.
        cause = exc.__cause__
        message = " ".join(str(cause).split())
        log.error("%s: %s: %s", exc, type(cause).__name__, message, exc_info=cause if log.isEnabledFor(logging.DEBUG) else None)
        return 1
    return 0
