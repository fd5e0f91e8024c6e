"""Failed puts (`OmniConnectorBase.put_or_raise`): each is logged once, counted for `health()`, and
raised again naming where it failed; vllm-omni's `put` answers `(False, 0, None)` for it instead."""

from __future__ import annotations

import logging
import threading

from omni_mesh.connectors.errors import ConnectorError, retold
from omni_mesh.connectors.keys import payload_name

log = logging.getLogger("omni_mesh.connectors")


class PutErrors:
    def __init__(self, connector: str) -> None:
        self._connector = connector
        self._lock = threading.Lock()
        self.failures = 0  # for health()

    def record(self, from_stage: str, to_stage: str, put_key: str, cause: BaseException) -> ConnectorError:
        """Log and count the failed put of `put_key` on `from_stage->to_stage`; the error to raise."""
        said = str(cause).removeprefix(f"{self._connector}: ")  # the connector is named once, here
        reason = f"{self._connector}: put of {payload_name(from_stage, to_stage, put_key)} failed: {said}"
        log.warning("%s", reason)
        with self._lock:
            self.failures += 1
        return retold(cause, reason)
