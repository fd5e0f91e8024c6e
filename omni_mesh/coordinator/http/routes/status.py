"""What the mesh is and how it is doing: health, readiness, topology, stages, totals, metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StrictInt

from omni_mesh.coordinator.http.envelope import MEANINGS, error_response, responses
from omni_mesh.coordinator.scheduling.autoscaler import ScaleRefused
from omni_mesh.coordinator.scheduling.metrics import CONTENT_TYPE_LATEST, Metrics, stats
from omni_mesh.coordinator.scheduling.service import Coordinator


class ReadyBody(BaseModel):
    ready: bool
    mesh: str = Field(description="the topology's name")
    instance: str = Field(description="this coordinator's instance id (OMNI_MESH_INSTANCE, or made at start)")
    missing: list[str] = Field(description="what keeps the mesh from serving: stages without a healthy replica, edges")
    scaled_to_zero: list[str] = Field(
        default_factory=list, description="stages at 0 replicas by autoscale: (a request starts one), not broken"
    )
    error: str | None = Field(default=None, description="when not ready: the same, in one sentence")
    stage: str | None = None
    request_id: str | None = None


class ReplicasBody(BaseModel):
    replicas: StrictInt = Field(description="the replicas the stage runs from now on (at least 1)")


def router(coordinator: Coordinator, metrics: Metrics) -> APIRouter:
    routes = APIRouter()
    dispatcher = coordinator.dispatcher
    registry = coordinator.registry

    @routes.get("/health", summary='200 `{"status": "ok"}` while the coordinator runs (no API key needed)')
    async def health() -> dict:
        # Open to anyone who can reach the port: it says nothing an outsider could use. The
        # counters are in /v1/stats, behind the API key.
        return {"status": "ok"}

    @routes.get(
        "/ready",
        summary="200 when every stage and edge can work, else 503 saying what is missing",
        responses={**responses(401), 503: {"model": ReadyBody, "description": MEANINGS[503]}},
    )
    async def ready() -> JSONResponse:
        idle = coordinator.autoscaler.scaled_to_zero()
        missing = registry.readiness(scaled_to_zero=idle)
        mesh = {"mesh": coordinator.topology.name, "instance": coordinator.instance, "scaled_to_zero": sorted(idle)}
        if missing:
            error = f"not ready: {'; '.join(missing)}"
            body = ReadyBody(ready=False, missing=missing, error=error, **mesh)
            return JSONResponse(status_code=503, content=body.model_dump())
        return JSONResponse(content={"ready": True, "missing": [], **mesh})

    @routes.get(
        "/v1/coordinators",
        summary="every coordinator of the mesh: id, pid, ports, health, requests served and in flight",
        responses=responses(401),
    )
    async def coordinators() -> dict:
        return {"coordinators": coordinator.peers.listing(coordinator.status())}

    @routes.get("/v1/topology", summary="stages, edges and the connector of each edge", responses=responses(401))
    async def topology() -> dict:
        return coordinator.topology.to_dict()

    @routes.get(
        "/v1/stages",
        summary="each stage's replicas with health, in-flight work and counters",
        responses=responses(401),
    )
    async def stages() -> dict:
        now = registry.now()  # the coordinator's own time (its stalls excluded)
        return {
            "stages": [
                {
                    "stage_id": stage.stage_id,
                    "name": stage.name,
                    "queued": len(dispatcher.queues[stage.name]),
                    **coordinator.autoscaler.describe(stage),
                    "replicas": [
                        r.describe(now, registry.heartbeat_timeout_s) for r in registry.of_stage(stage.name)
                    ],
                }
                for stage in coordinator.topology.stages
            ]
        }

    @routes.post(
        "/v1/stages/{name}/replicas",
        summary="`omni-mesh scale`: set the replicas of a stage without autoscale: (`omni-mesh up` acts on it)",
        responses=responses(401, 404, 409, 422),
    )
    async def scale(name: str, body: ReplicasBody) -> JSONResponse:
        try:
            before = coordinator.autoscaler.set_replicas(name, body.replicas)
        except ScaleRefused as exc:
            return error_response(exc.status, str(exc), stage=name if exc.status != 404 else None)
        return JSONResponse(content={"stage": name, "target_replicas": body.replicas, "previous": before})

    @routes.get(
        "/metrics", summary="Prometheus metrics (omni_mesh_*)", response_class=Response, responses=responses(401)
    )
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @routes.get("/v1/stats", summary="live totals behind /dashboard and `omni-mesh status`", responses=responses(401))
    async def live_stats() -> dict:
        return {
            **stats(coordinator, metrics),
            "control": {
                "malformed_messages": coordinator.malformed,
                # control connections refused: without this mesh's keys, or over the connection cap
                "refused_connections": coordinator.refused_connections.count,
                "connections_over_cap": coordinator.cap.over_cap if coordinator.cap else 0,
                "forged_messages": coordinator.forged.count,  # sent in another connection's replica's name
            },
            "ingress": dispatcher.inputs.health(),  # large inputs' connector
        }

    return routes
