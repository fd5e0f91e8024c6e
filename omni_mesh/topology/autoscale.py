"""`autoscale:` on a stage (or in `defaults:`): how many replicas follow the load, with Ray Serve's names.

`min_replicas` (0: scale to zero when idle), `max_replicas`, `target_ongoing_requests` (in flight plus
queued, per replica), `upscale_delay_s` and `downscale_delay_s` (how long the load must ask for more,
or fewer, replicas before the target moves). A stage's `replicas:` is the count it starts with. A
stage's own keys win over the ones in `defaults: {autoscale: ...}`, key by key.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


def _section(value: Any, where: str) -> dict[str, Any]:
    """The mapping's keys set, checked one by one (a TopologyError naming the key at fault)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TopologyError(f"{where}: autoscale must be a mapping (min_replicas, max_replicas, ...), got {value!r}")
    try:
        section = AutoscaleSection.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, list(AutoscaleSection.model_fields), n=1)
            known = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(AutoscaleSection.model_fields)}"
            raise TopologyError(f"{where}: unknown key autoscale.{key}; {known}", key_of=(value, key)) from None
        raise TopologyError(
            f"{where}: autoscale.{key}: {error['msg']} (got {error.get('input')!r})",
            key_of=(value, error["loc"][0]) if error["loc"] else None,
        ) from None
    return section.model_dump(exclude_none=True)


def read_autoscale(
    value: Any, defaults: Any, replicas: int | None, who: str, *, max_queued: Any = None
) -> tuple[AutoscaleSpec | None, int | None]:
    """The stage's autoscaling (its keys over `defaults:`'s) and its starting replicas: `replicas`
    when given (checked to lie within min and max), else min_replicas (at least 1)."""
    merged = {**_section(defaults, "defaults"), **_section(value, who)}
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
