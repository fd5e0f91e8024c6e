"""The connectors' one exception family.

Inside a connector every failure is raised as a `ConnectorError`; the subclasses say what kind, so a
caller can act on it (the front door answers `ConnectorFull` with 503 and Retry-After) without reading
messages. Every message names the connector, and the edge and key where there is one. vllm-omni's
contract returns instead of raising, at its boundary alone: `OmniConnectorBase.put` maps the error
`put_or_raise` raises (what our own callers use) to `(False, 0, None)`, and `get` a poll's
PayloadMissing to None. A backend's own codes are mapped to this family in one module per
backend (`mooncake/errors.py`, `datasystem/errors.py`); helpers with exceptions of their own (the served
side channel's dealers) are caught and mapped at their connector's edge.
"""

from __future__ import annotations


class ConnectorError(RuntimeError):
    """A connector could not do what was asked; the message names the connector, edge and key."""


class ConnectorConfigError(ValueError):
    """The `extra:` mapping of a connector is wrong; the message names the connector and the key.
    (A ValueError, not a ConnectorError: it is the user's file that is wrong, found before any run.)"""


class PayloadTooLarge(ConnectorError):
    """A payload larger than the connector can ever carry (not a matter of waiting for room)."""


class ConnectorFull(ConnectorError):
    """No room now (shared memory, a store, a pool past its ceiling): the same put may work later."""


class ConnectorUnavailable(ConnectorError):
    """The backend or the peer cannot be reached, or did not start."""


class PayloadMissing(ConnectorError):
    """The payload is not there: never put, already consumed, cleaned up or expired, not there by the
    deadline, or its producer is gone."""


class GetAbandoned(PayloadMissing):
    """A wait for the payload was told to stop (`abandon_get`)."""


class ConnectorClosed(ConnectorError):
    """The connector was closed: nothing more goes through it."""


class SharedMemoryFull(ConnectorFull):
    """The shared-memory filesystem (`directory`) has no room for a segment of `asked` bytes."""

    def __init__(self, directory: str, asked: int, free: int, detail: str = "") -> None:
        self.directory, self.asked, self.free = directory, asked, free
        super().__init__(
            f"shared memory in {directory} is full: {asked} bytes asked, {free} free{detail}; free space "
            "there, raise the container's shm_size, or lower memory_pool_size / max_pool_size"
        )


def retold(cause: BaseException, message: str) -> ConnectorError:
    """`cause` told again with `message` (which says where), keeping its kind where the kind can be
    built from a message alone (else the nearest: ConnectorFull stays worth a retry)."""
    kind = type(cause) if isinstance(cause, ConnectorError) else ConnectorError
    try:
        told = kind(message)
    except TypeError:
        told = ConnectorFull(message) if isinstance(cause, ConnectorFull) else ConnectorError(message)
    told.__cause__ = cause
    return told
