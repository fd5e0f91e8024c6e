"""A request while it runs: where it is, what it waits for, what it produced (dispatch.py moves it)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from omni_mesh.control import Chunk, Work
from omni_mesh.coordinator.scheduling import events


@dataclass
class RequestState:
    rid: str
    params: dict
    deadline: float  # event-loop time
    stream: bool
    future: asyncio.Future
    created: float = field(default_factory=time.perf_counter)
    at: dict[str, str] = field(default_factory=dict)  # stage -> replica working on it
    queued: dict[str, float] = field(default_factory=dict)  # stage -> when it started waiting
    touched: set[str] = field(default_factory=set)  # replicas to abort on failure
    done: set[str] = field(default_factory=set)
    gathered: dict[str, dict[str, tuple[list, bool]]] = field(default_factory=dict)  # dst -> src -> (items, streamed)
    gathering: dict[tuple[str, str], list] = field(default_factory=dict)  # (dst, src) -> streamed chunk items
    stream_targets: dict[str, str | None] = field(default_factory=dict)  # dst -> replica (None: queued)
    stream_buffer: dict[str, list[Chunk]] = field(default_factory=dict)  # dst -> chunks before dispatch
    sent_chunks: dict[str, list[Chunk]] = field(default_factory=dict)  # dst -> chunks sent (replayed on retry)
    work: dict[str, Work] = field(default_factory=dict)  # stage -> the work message routed to it
    emitted: set[str] = field(default_factory=set)  # stages that produced output (no retry after that)
    next_seq: dict[str, int] = field(default_factory=dict)  # stage -> seq of its next output (reconcile.py)
    retried: set[str] = field(default_factory=set)
    outputs: dict[str, Any] = field(default_factory=dict)
    chunks: dict[str, list] = field(default_factory=dict)
    events: asyncio.Queue[events.Event] | None = None  # a streamed request's, for its reader
    timings: dict[str, dict] = field(default_factory=dict)
    large_inputs: Any = None  # inputs held by the ingress connector (put again for a retried entry stage)
    first_chunk_s: float | None = None  # admission to the first streamed final output

    def location(self) -> str:
        if self.at:
            return ", ".join(f"stage {s!r} (replica {r!r})" for s, r in self.at.items())
        if self.queued:
            return ", ".join(f"stage {s!r} (waiting for a free replica)" for s in self.queued)
        return "the coordinator"
