"""Deployment files generated from a topology, so the topology stays the one source of truth.

- `compose.py`: a Compose file (`omni-mesh export compose`); the committed compose/docker-compose*.yml
  of the one-host demos are its output; `compose_coordinators.py`: several coordinators in it.
- `k8s.py`: Kubernetes manifests (`omni-mesh export k8s`).
- `roles.py` (each role's command, environment and health check), `placement.py` (which stages share
  memory, which edges cross containers), `resources.py` (the stage key `resources:`), `source.py` (where
  the topology lives in the image), `output.py` (the YAML text and where it goes): shared by both.
"""

from omni_mesh.export.compose import ComposeOptions, export_compose
from omni_mesh.export.k8s import K8sOptions, export_k8s
from omni_mesh.export.output import Exported, write
from omni_mesh.export.source import ExportError, ImageSource

__all__ = [
    "ComposeOptions",
    "ExportError",
    "Exported",
    "ImageSource",
    "K8sOptions",
    "export_compose",
    "export_k8s",
    "write",
]
