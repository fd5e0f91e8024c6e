"""Running one replica as a process: `serve_stage` (the replica's coroutine) and `main_stage` (what
`omni-mesh stage` calls once it has read the topology)."""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

from omni_mesh import aio
from omni_mesh.fdlimit import raise_nofile_limit
from omni_mesh.stage.loading import default_replica_id
from omni_mesh.stage.replica import StageReplica
from omni_mesh.topology import Topology

log = logging.getLogger("omni_mesh.stage")

#: How long a replica that has drained and closed waits for its threads before it exits anyway.
EXIT_GRACE_S = 3.0


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
    exit_past_stuck_threads()
    return 0


def exit_past_stuck_threads() -> None:
    """Exit now if a thread is still stuck after the replica closed (a transfer blocked in a native
    call): Python would wait for it at exit, and a drained replica must go. Their stacks are logged.
    An idle pool thread is not stuck: a handler's own executor (an engine's model thread) is never shut
    down, but the replica is gone by now, and collecting it wakes the executor's idle thread to end
    (unfrozen first: the replica froze what its warm() loaded out of the collector's reach)."""
    gc.unfreeze()
    gc.collect()
    deadline = time.monotonic() + EXIT_GRACE_S
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not stuck:
        return
    log.warning("exiting with %d thread(s) still stuck %.0f s after the replica closed: %s", len(stuck), EXIT_GRACE_S, stuck)
    faulthandler.dump_traceback(all_threads=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)
