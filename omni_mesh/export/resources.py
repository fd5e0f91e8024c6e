"""The optional `resources:` key of a stage: what one replica needs from the machine it runs on.

```yaml
stages:
  - stage_id: 0
    name: thinker
    resources:
      cpu: 4                 # cores (or "500m"): Kubernetes requests
      memory: 16Gi           # Kubernetes requests and limits
      gpus: 1                # whole devices: Kubernetes requests and limits, compose device reservations
      gpu_type: nvidia.com/gpu   # the device plugin's resource name (amd.com/gpu, ...); compose: its vendor
```

The topology keeps stage keys it does not interpret verbatim, so this key is read (and checked) here,
by the exporters, the only code that uses it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from omni_mesh.export.source import ExportError
from omni_mesh.topology import StageSpec

KEY = "resources"
DEFAULT_GPU = "nvidia.com/gpu"
_CPU = re.compile(r"^\d+(\.\d+)?m?$")
_MEMORY = re.compile(r"^\d+(\.\d+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Resources:
    cpu: str | None = None
    memory: str | None = None
    gpus: int = 0
    gpu_type: str = DEFAULT_GPU

    @property
    def gpu_vendor(self) -> str:
        """The compose device driver: `nvidia` for nvidia.com/gpu."""
        return self.gpu_type.split("/")[0].split(".")[0]


def stage_resources(stage: StageSpec) -> Resources:
    raw = stage.options.get(KEY)
    if raw is None:
        return Resources()
    who = f"stage {stage.stage_id} {stage.name!r}: {KEY}"
    if not isinstance(raw, dict):
        raise ExportError(f"{who} must be a mapping (cpu, memory, gpus, gpu_type), got {raw!r}")
    unknown = sorted(set(raw) - {"cpu", "memory", "gpus", "gpu_type"}, key=str)
    if unknown:
        raise ExportError(f"{who}: unknown key {unknown[0]!r} (known: cpu, memory, gpus, gpu_type)")
    gpus = raw.get("gpus", 0)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise ExportError(f"{who}.gpus must be a whole number of devices >= 0, got {gpus!r}")
    gpu_type = raw.get("gpu_type", DEFAULT_GPU)
    if not isinstance(gpu_type, str) or not _RESOURCE_NAME.match(gpu_type):
        raise ExportError(f"{who}.gpu_type must be a device plugin's resource name such as {DEFAULT_GPU}, got {gpu_type!r}")
    return Resources(
        cpu=_quantity(raw.get("cpu"), _CPU, f"{who}.cpu", "a number of cores such as 2, 0.5 or 500m"),
        memory=_quantity(raw.get("memory"), _MEMORY, f"{who}.memory", "bytes or a size such as 512Mi or 16Gi"),
        gpus=gpus,
        gpu_type=gpu_type,
    )


def _quantity(value: Any, pattern: re.Pattern, who: str, expected: str) -> str | None:
    if value is None:
        return None
    text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not pattern.match(text) or not float(re.sub(r"[^\d.]", "", text)) > 0:
        raise ExportError(f"{who} must be {expected}, got {value!r}")
    return text
