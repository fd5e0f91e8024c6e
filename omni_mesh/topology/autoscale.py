"""`autoscale:` on a stage (or in `defaults:`): how many replicas follow the load, with Ray Serve's names.

`min_replicas` (0: scale to zero when idle), `max_replicas`, `target_ongoing_requests` (in flight plus
queued, per replica), `upscale_delay_s` and `downscale_delay_s` (how long the load must ask for more,
or fewer, replicas before the target moves). A stage's `replicas:` is the count it starts with. A
stage's own keys win over the ones in `defaults: {autoscale: ...}`, key by key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omni_mesh.topology.model import TopologyError

#: Ray Serve's defaults, where they suit a mesh: 2 ongoing requests per replica; a load must ask for
#: more for a few seconds (a burst of one second is not worth a process start), for fewer much longer
#: (a replica stopped too soon is started again at the next burst).
TARGET_ONGOING = 2.0
UPSCALE_DELAY_S = 5.0
DOWNSCALE_DELAY_S = 60.0


class AutoscaleSection(BaseModel):
    """The `autoscale:` mapping, as the file writes it (the JSON Schema is made from this)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    min_replicas: int | None = Field(None, ge=0, description="the fewest replicas; 0: scale to zero when idle")
    max_replicas: int | None = Field(None, ge=1, description="the most replicas (required)")
    target_ongoing_requests: float | None = Field(
        None, gt=0, description=f"in flight plus queued per replica to aim at (default {TARGET_ONGOING:g})"
    )
    upscale_delay_s: float | None = Field(
        None, ge=0, description=f"how long the load must ask for more before scaling up (default {UPSCALE_DELAY_S:g})"
    )
    downscale_delay_s: float | None = Field(
        None, ge=0, description=f"how long the load must ask for fewer before scaling down (default {DOWNSCALE_DELAY_S:g})"
    )


@dataclass(frozen=True)
class AutoscaleSpec:
    """A stage's checked autoscaling settings."""

    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float = TARGET_ONGOING
    upscale_delay_s: float = UPSCALE_DELAY_S
    downscale_delay_s: float = DOWNSCALE_DELAY_S

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
        }


def _set_keys(section: AutoscaleSection | None) -> dict[str, Any]:
    return section.model_dump(exclude_none=True) if section is not None else {}


def read_autoscale(
    value: AutoscaleSection | None,
    defaults: AutoscaleSection | None,
    replicas: int | None,
    who: str,
    *,
    max_queued: int | None = None,
) -> tuple[AutoscaleSpec | None, int | None]:
    """The stage's autoscaling (its keys over `defaults:`'s, each section already checked by its model)
    and its starting replicas: `replicas` when given (checked to lie within min and max), else
    min_replicas (at least 1)."""
    merged = {**_set_keys(defaults), **_set_keys(value)}
    if not merged:
        return None, replicas
    if "max_replicas" not in merged:
        raise TopologyError(f"{who}: autoscale needs max_replicas (the most replicas the stage may run)")
    spec = AutoscaleSpec(**{"min_replicas": 1, **merged})
    if spec.min_replicas > spec.max_replicas:
        raise TopologyError(
            f"{who}: autoscale.min_replicas {spec.min_replicas} is above autoscale.max_replicas {spec.max_replicas}"
        )
    if spec.min_replicas == 0 and max_queued == 0:
        raise TopologyError(
            f"{who}: autoscale.min_replicas 0 (scale to zero) with max_queued 0: a request for the idle stage "
            "waits in its queue while a replica starts; allow a queue (max_queued >= 1) or keep min_replicas >= 1"
        )
    if replicas is None:
        return spec, max(1, spec.min_replicas)
    if not max(1, spec.min_replicas) <= replicas <= spec.max_replicas:
        raise TopologyError(
            f"{who}: replicas {replicas} (the starting count) must lie within autoscale.min_replicas "
            f"{spec.min_replicas} and autoscale.max_replicas {spec.max_replicas} (and be at least 1)"
        )
    return spec, replicas
