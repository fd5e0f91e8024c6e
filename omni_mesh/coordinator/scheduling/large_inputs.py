"""Request inputs too large for a work message, held for the entry stages in the ingress connector.

A request's inputs over `INLINE_MAX_BYTES` (packed) are put into the coordinator's ingress connector
once per entry stage before the request is queued (omni_mesh.ingress); the work carries a reference.
While they are put they count as waiting for their stages (`arriving`), so concurrent large requests
cannot overshoot a queue's limit (Dispatcher.full_stage) nor hide from the autoscaler.
"""

from __future__ import annotations

from typing import Any

import msgpack

from omni_mesh.connectors import ConnectorError
from omni_mesh.coordinator.scheduling.failures import inputs_not_held
from omni_mesh.ingress import INLINE_MAX_BYTES, Ingress


class LargeInputs:
    def __init__(self, ingress: Ingress | None, entries: list[str]) -> None:
        self.ingress = ingress  # None: every request's inputs ride inline
        self.entries = entries
        #: entry stage -> admitted requests whose inputs are still going into the ingress connector
        self.arriving: dict[str, int] = {name: 0 for name in entries}

    def inline(self, inputs: Any) -> bool:
        """Whether `inputs` ride in the entry stages' work messages (else: hold them first)."""
        return self.ingress is None or len(msgpack.packb(inputs)) <= INLINE_MAX_BYTES

    async def hold(self, rid: str, inputs: Any) -> dict[str, dict]:
        """{entry stage: inputs_ref} for Dispatcher.submit, called right after (no await between: it
        takes over the count); RequestFailed when the connector cannot hold them (nothing is kept)."""
        assert self.ingress is not None
        for name in self.entries:
            self.arriving[name] += 1
        try:
            refs = {}
            for name in self.entries:
                try:
                    refs[name] = await self.ingress.put(rid, name, inputs)
                except ConnectorError as exc:  # nothing admitted yet: what is held goes with the rid
                    self.ingress.release(rid)
                    raise inputs_not_held(exc, name) from None
            return refs
        finally:
            for name in self.entries:
                self.arriving[name] -= 1

    async def hold_again(self, rid: str, stage: str, inputs: Any) -> dict:
        """The inputs again for a retried entry stage (its first replica took them): its inputs_ref."""
        assert self.ingress is not None
        try:
            return await self.ingress.put(rid, stage, inputs)
        except Exception as exc:
            raise inputs_not_held(exc, stage, again=True) from None

    def release(self, rid: str) -> None:
        if self.ingress is not None:
            self.ingress.release(rid)

    def health(self) -> dict[str, Any] | None:
        """The ingress connector's counters (None without one)."""
        return self.ingress.health() if self.ingress is not None else None
