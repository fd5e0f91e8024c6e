"""openYuanrong datasystem failures as the connectors' exception family (`connectors/errors.py`): the one
place they are mapped, for YuanrongConnector and YuanrongTransferEngineConnector.

A client call raises RuntimeError (and an engine call returns a Status) whose text starts with the
status's name, `code: [Out of memory], msg: [...]` (StatusCodeName in the client's status.h); the name
says which kind of ConnectorError it is.
"""

from __future__ import annotations

import re
from typing import Any

from omni_mesh.connectors.errors import (
    ConnectorError,
    ConnectorFull,
    ConnectorUnavailable,
    PayloadMissing,
    PayloadTooLarge,
)

INSTALL_HINT = "install it with `pip install 'omni-mesh[yuanrong]'` (package openyuanrong-datasystem)"
MAX_VALUE = 2**32 - 1  # mcreate takes uint32 sizes

_CODE = re.compile(r"code: \[([^\]]*)\]")
# Status names (K_* in status.h) by kind; any other is a plain ConnectorError.
_KINDS: dict[str, type[ConnectorError]] = {
    "Key not found": PayloadMissing,  # K_NOT_FOUND
    "Key not found in l2 cache": PayloadMissing,  # K_NOT_FOUND_IN_L2CACHE
    "Out of memory": ConnectorFull,  # K_OUT_OF_MEMORY: the worker's shared memory is full
    "No space available": ConnectorFull,  # K_NO_SPACE
    "Lru hard limit": ConnectorFull,  # K_LRU_HARD_LIMIT
    "The write back queue is full": ConnectorFull,  # K_WRITE_BACK_QUEUE_FULL
    "RPC unavailable": ConnectorUnavailable,  # K_RPC_UNAVAILABLE (also a request past req_timeout_ms)
    "RPC deadline exceeded": ConnectorUnavailable,  # K_RPC_DEADLINE_EXCEEDED
    "RPC cancelled": ConnectorUnavailable,  # K_RPC_CANCELLED
    "Client and Worker disconnect": ConnectorUnavailable,  # K_CLIENT_WORKER_DISCONNECT
    "The worker status is abnormal": ConnectorUnavailable,  # K_WORKER_ABNORMAL
    "The worker timeout": ConnectorUnavailable,  # K_WORKER_TIMEOUT
    "The worker is exiting": ConnectorUnavailable,  # K_SCALE_DOWN
    "Shutting down": ConnectorUnavailable,  # K_SHUTTING_DOWN
    "Not ready": ConnectorUnavailable,  # K_NOT_READY
    "The master may timeout/dead": ConnectorUnavailable,  # K_MASTER_TIMEOUT
}


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def worker_error(failure: str, what: str) -> ConnectorError:
    """A failed client call's message (its first line) as the family's kind for the status name it
    starts with (`Out of memory`; none: a plain ConnectorError), prefixed by `what` (which names the
    connector, edge, key and worker)."""
    found = _CODE.match(failure)
    return _KINDS.get(found.group(1) if found else "", ConnectorError)(f"{what}: {failure}")


def check_status(status: Any, what: str) -> None:
    """Raise a returned Status (engine calls return, not raise) as the family's kind for it unless OK."""
    if not status.is_ok():
        raise worker_error(first_line(RuntimeError(status.to_string())), what)


def too_large(what: str, nbytes: int) -> PayloadTooLarge:
    """A frame past the datasystem's value limit (no worker can ever hold it)."""
    return PayloadTooLarge(
        f"{what}: the frame is {nbytes} bytes, over the datasystem's {MAX_VALUE}-byte value limit; "
        "send it in parts or use another connector (ZmqConnector, MooncakeTransferEngineConnector)"
    )


def missing_library(owner: str, what: str, exc: BaseException) -> ConnectorUnavailable:
    return ConnectorUnavailable(f"{owner}: {what} is not available ({exc}); {INSTALL_HINT}")


def unreachable(owner: str, worker: str, waited: float, reason: str) -> ConnectorUnavailable:
    return ConnectorUnavailable(
        f"{owner}: cannot reach the datasystem worker at {worker} (after {waited:.1f}s: {reason}); start one "
        f"there with `dscli start -w --worker_address {worker} ...` or set host/port to a running worker"
    )
