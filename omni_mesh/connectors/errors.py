"""The connectors' exception family: what a caller may tell apart without reading messages.

ConnectorError stays a RuntimeError: callers written before this module catch RuntimeError.
"""

from __future__ import annotations


class ConnectorError(RuntimeError):
    """A connector could not do what was asked; the message names the connector, edge and key."""


class ConnectorFull(ConnectorError):
    """The memory a connector stores payloads in has no room now; the same put may succeed later
    (the coordinator answers 503 with Retry-After)."""


class SharedMemoryFull(ConnectorFull):
    """The shared-memory filesystem (`directory`) has no room for a segment of `asked` bytes."""

    def __init__(self, directory: str, asked: int, free: int, detail: str = "") -> None:
        self.directory, self.asked, self.free = directory, asked, free
        super().__init__(
            f"shared memory in {directory} is full: {asked} bytes asked, {free} free{detail}; free space "
            "there, raise the container's shm_size, or lower memory_pool_size / max_pool_size"
        )
