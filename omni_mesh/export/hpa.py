"""A pod's HorizontalPodAutoscaler, from its stages' `autoscale:` sections (or, without one, from their
queues), so Kubernetes follows the same settings `omni-mesh up` acts on.

With `autoscale:`: min and max replicas, a target of `target_ongoing_requests` per replica on the
External metric omni_mesh_stage_ongoing_requests{stage} (in flight plus queued: what the coordinator
counts), and `upscale_delay_s` / `downscale_delay_s` as the scale-up and scale-down stabilization
windows. Stages that share a pod (a SharedMemoryConnector edge) scale together: the pod takes the
largest minimum, the largest maximum and the longest delays of its stages, and each autoscaled stage
adds its metric (the HPA follows the busiest). Without `autoscale:`, the pod scales on its queues
(a replica's worth of waiting work, max_inflight, per replica) from `replicas` to 4 x that.
"""

from __future__ import annotations

import math
from typing import Any

from omni_mesh.topology import StageSpec

QUEUE_METRIC = "omni_mesh_stage_queued_requests"
ONGOING_METRIC = "omni_mesh_stage_ongoing_requests"
#: Kubernetes refuses stabilization windows longer than an hour.
MAX_WINDOW_S = 3600


def hpa_spec(stages: list[StageSpec], replicas: int, target: dict[str, str], ceiling: int | None) -> tuple[dict, list[str]]:
    """The HPA's spec for a Deployment (`target`: its scaleTargetRef) of `replicas` pods running
    `stages`, and warnings (what Kubernetes cannot do as the topology asks); `ceiling`: --max-replicas."""
    scaled = [stage for stage in stages if stage.autoscale is not None]
    metrics = [_metric(stage) for stage in stages]
    if not scaled:
        spec = {
            "scaleTargetRef": target,
            "minReplicas": replicas,
            "maxReplicas": ceiling or 4 * replicas,
            "metrics": metrics,
            # A replica asked to go drains its work first (up to 30 s): scale down unhurriedly.
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 120}},
        }
        return spec, []
    warnings = []
    least = max(stage.autoscale.min_replicas for stage in scaled)  # type: ignore[union-attr]
    if least == 0:
        names = ", ".join(s.name for s in scaled if s.autoscale.min_replicas == 0)  # type: ignore[union-attr]
        warnings.append(
            f"stage(s) {names}: min_replicas 0 (scale to zero) becomes minReplicas 1 in Kubernetes: a plain "
            "HorizontalPodAutoscaler cannot scale to zero (that needs the HPAScaleToZero feature gate, or KEDA)"
        )
    up = max(stage.autoscale.upscale_delay_s for stage in scaled)  # type: ignore[union-attr]
    down = max(stage.autoscale.downscale_delay_s for stage in scaled)  # type: ignore[union-attr]
    spec = {
        "scaleTargetRef": target,
        "minReplicas": max(1, least),
        "maxReplicas": ceiling or max(stage.autoscale.max_replicas for stage in scaled),  # type: ignore[union-attr]
        "metrics": metrics,
        "behavior": {
            "scaleUp": {"stabilizationWindowSeconds": _window(up)},
            "scaleDown": {"stabilizationWindowSeconds": _window(down)},
        },
    }
    return spec, warnings


def _metric(stage: StageSpec) -> dict[str, Any]:
    if stage.autoscale is None:
        name, value = QUEUE_METRIC, str(stage.max_inflight)
    else:
        name, value = ONGOING_METRIC, quantity(stage.autoscale.target_ongoing_requests)
    return {
        "type": "External",
        "external": {
            "metric": {"name": name, "selector": {"matchLabels": {"stage": stage.name}}},
            "target": {"type": "AverageValue", "averageValue": value},
        },
    }


def quantity(value: float) -> str:
    """A Kubernetes quantity: `2` for 2.0, `1500m` for 1.5."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def _window(seconds: float) -> int:
    return min(MAX_WINDOW_S, math.ceil(seconds))
