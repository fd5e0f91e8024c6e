"""Why recent puts failed, kept for the caller who asks (vllm-omni's `put_error`).

A failed put answers `(False, 0, None)` (vllm-omni's contract); its reason is logged once and kept
here by edge key until asked for, so the answer stays a tuple and the reason is not lost.
"""

from __future__ import annotations

import logging
import threading

from omni_mesh.connectors.errors import ConnectorError, retold

log = logging.getLogger("omni_mesh.connectors")

#: Reasons nobody asks for are dropped past this many (the newest are kept).
KEEP = 256


class PutErrors:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures = 0
        self._kept: dict[str, tuple[str, ConnectorError]] = {}

    @property
    def failures(self) -> int:
        return self._failures

    def record(
        self, connector: str, from_stage: str, to_stage: str, put_key: str, cause: BaseException
    ) -> None:
        """Log the failed put of `put_key` on `from_stage->to_stage` once, count it and keep its reason."""
        said = str(cause).removeprefix(f"{connector}: ")  # the connector is named once, here
        reason = f"{connector}: put of key {put_key!r} on edge {from_stage}->{to_stage} failed: {said}"
        log.warning("%s", reason)
        with self._lock:
            self._failures += 1
            self._kept[f"{from_stage}->{to_stage}/{put_key}"] = (reason, retold(cause, reason))
            if len(self._kept) > KEEP:
                del self._kept[next(iter(self._kept))]

    def pop(self, edge_key: str) -> tuple[str, ConnectorError] | None:
        """The reason and the typed error of the last failed put of `edge_key`, once."""
        with self._lock:
            return self._kept.pop(edge_key, None)
