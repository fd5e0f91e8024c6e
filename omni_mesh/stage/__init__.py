"""Stage runtime: one replica of one stage, as an asyncio service.

The replica registers with the coordinator, heartbeats, and runs the stage handler for each piece of
work the coordinator routes to it (never more than `max_inflight` at once: the coordinator holds the
rest). Inputs come through the inbound edge's connector, outputs go out through each outbound edge's
connector, and only the connector metadata travels back to the coordinator. Every connector call runs
in a thread pool so the event loop never blocks. A request that fails, times out or is aborted has
everything it holds in connectors cleaned up.

The package, one concept a module:

    replica   `StageReplica`: start, drain on SIGTERM, close; the coordinator's messages dispatched
    link      the control-plane socket, registration, the heartbeat clock, connector health
    runner    the work loop: each request's inputs, handler, outputs, failure and abort cleanup
    context   what a handler is given: `StageContext` (ctx), streamed inputs, `StageInputError`
    loading   the default replica id (the handler: `omni_mesh.topology.load_handler`)
    main      `serve_stage`, `main_stage` (`omni-mesh stage`; `python -m omni_mesh.stage` runs it too)

What a handler is, is given and may have (its hooks) is `omni_mesh.handlers`, the contract this runtime
and the engines share.
"""

from omni_mesh.stage.context import StageContext, StageInputError
from omni_mesh.stage.link import HEALTH_WAIT_S, HEARTBEAT_S
from omni_mesh.stage.loading import default_replica_id
from omni_mesh.stage.main import main_stage, serve_stage
from omni_mesh.stage.replica import StageReplica
from omni_mesh.stage.runner import ABORT_SWEEP_S
from omni_mesh.topology import load_handler  # the stage package's API, kept

__all__ = [
    "ABORT_SWEEP_S",
    "HEALTH_WAIT_S",
    "HEARTBEAT_S",
    "StageContext",
    "StageInputError",
    "StageReplica",
    "default_replica_id",
    "load_handler",
    "main_stage",
    "serve_stage",
]
