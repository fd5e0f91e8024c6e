"""Running one replica as a process: `serve_stage` (the replica's coroutine) and `main_stage` (what
`omni-mesh stage` calls once it has read the topology)."""

from __future__ import annotations

import logging
import sys
from typing import Any

from omni_mesh import aio
from omni_mesh.fdlimit import raise_nofile_limit
from omni_mesh.stage.replica import StageReplica
from omni_mesh.topology import Topology


async def serve_stage(topology: Topology, stage_name: str, coordinator: str, **options: Any) -> None:
    replica = StageReplica(topology, topology.stage(stage_name), coordinator, **options)
    await replica.run()


def main_stage(topology: Topology, stage_name: str, coordinator: str, **options: Any) -> int:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {stage_name} %(levelname)s %(message)s", stream=sys.stderr
    )
    raise_nofile_limit()
    aio.run(serve_stage(topology, stage_name, coordinator, **options))
    return 0
