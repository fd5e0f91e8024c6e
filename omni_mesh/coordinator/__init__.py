"""The coordinator: REST API, replica registry and request dispatch."""

from omni_mesh.coordinator.http.app import create_app, serve
from omni_mesh.coordinator.scheduling.service import Coordinator

__all__ = ["Coordinator", "create_app", "serve"]
