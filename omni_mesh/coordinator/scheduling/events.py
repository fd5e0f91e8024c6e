"""What a streamed request's reader is told, in order: chunks of final outputs, then Done or Failed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_mesh.coordinator.scheduling.failures import RequestFailed


@dataclass(frozen=True)
class Chunk:
    """One streamed output of a final stage."""

    stage: str
    value: Any


@dataclass(frozen=True)
class Done:
    """The request completed; `outputs` as a non-streamed answer would hold them."""

    outputs: Any


@dataclass(frozen=True)
class Failed:
    error: RequestFailed


Event = Chunk | Done | Failed
