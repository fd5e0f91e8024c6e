"""`EnginePullConnector`: the base of the transfer-engine connectors (Yuanrong TE, Mori).

The producer lays the frame into its registered memory pool and returns metadata naming its ZeroMQ
side channel and the slot (endpoint, key, token, offset, size). The consumer claims the payload over the side channel (so it cannot expire or
be cleaned up mid-read), pulls the bytes into its own registered pool with the engine, releases the
payload (the producer frees the slot) and decodes. Subclasses supply the engine.

Config fields every subclass has: host, zmq_port, memory_pool_size, ttl_s, get_timeout_s (checked by their
types in config/classes.py: Port, PositiveSize, Positive, NonNegative).
"""

from __future__ import annotations

import contextlib
import time
from abc import abstractmethod
from typing import Any

import torch

from omni_mesh.codec import FrameError, decode, plan
from omni_mesh.connectors.errors import ConnectorError, retold
from omni_mesh.connectors.keys import edge_key
from omni_mesh.connectors.pools.held import Gone, PendingReleases
from omni_mesh.connectors.served.channel import ERR, OK, Handler, Reply, frame_text
from omni_mesh.connectors.served.connector import GONE, ServedConnector


class EnginePullConnector(ServedConnector):
    """Pull-based transfers: the consumer's engine reads the producer's pool slot (module docstring)."""

    port_field = "zmq_port"
    metadata_fields = ("endpoint", "token", "offset", "size")
    by_key = False  # a pull needs the slot's offset and size: only put()'s metadata has them

    _pool: torch.Tensor  # the registered pool (uint8, host or device memory): `_open_backend` makes it

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._orphans = PendingReleases()  # local slots of transfers unfinished at their deadline

    # ---- what a subclass provides

    @abstractmethod
    def _open_backend(self) -> None:
        """Import the backend, start the engine, allocate and register a memory_pool_size pool (`_pool`)."""

    def _synchronize(self) -> None:  # noqa: B027 - a device pool's subclass waits for its copies
        """Wait until the copies into a device pool are done."""

    @abstractmethod
    def _engine_metadata(self) -> dict[str, Any]:
        """Small msgpack-able fields a remote consumer needs to reach this pool with the engine."""

    @abstractmethod
    def _pull(self, metadata: dict[str, Any], local_offset: int, size: int, deadline: float) -> Any:
        """Copy `size` bytes from the producer's slot into our pool at `local_offset`.

        Returns None when done, or an unfinished transfer handle (past the deadline) that
        `_transfer_done(handle)` can be asked about later. Raises ConnectorError with the engine's
        reason on failure (the caller adds connector, edge, key and endpoint).
        """

    def _transfer_done(self, handle: Any) -> bool:
        return True

    # ---- producer side

    def _serving_handlers(self) -> dict[bytes, Handler]:
        return {b"CLAIM": self._on_claim, b"RELEASE": self._on_release}

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[int, dict | None]:
        frame = plan(data)
        self._start_server()
        key = edge_key(from_stage, to_stage, put_key)
        offset = self._slots.allocate(frame.nbytes)
        if offset is None:
            self._error()
            raise ConnectorError(
                f"{self._name}: put {from_stage}->{to_stage} key {put_key!r}: the memory pool is full "
                f"({frame.nbytes} bytes needed, {self._slots.size - self._slots.in_use} of {self._slots.size} "
                f"free, {len(self._held)} payloads waiting); raise memory_pool_size or consume faster"
            )
        pool = self._pool
        try:
            if pool.device.type == "cpu":
                frame.write_into(pool.numpy(), offset)
            else:  # through a host staging buffer
                staging = torch.empty(frame.nbytes, dtype=torch.uint8)
                frame.write_into(staging.numpy())
                pool[offset : offset + frame.nbytes].copy_(staging)
                self._synchronize()  # the bytes must be on the device before a consumer can pull them
        except BaseException:
            self._slots.free(offset)
            raise
        held = self._hold(key, put_key, frame.nbytes, offset)
        metadata = {
            "endpoint": self.endpoint,
            "key": key,
            "token": held.token,
            "offset": offset,
            "size": frame.nbytes,
        }
        metadata.update(self._engine_metadata())
        return frame.nbytes, metadata

    def _on_claim(self, args: list[bytes]) -> Reply:
        try:
            self._held.claim(frame_text(args[0]), frame_text(args[1]))
        except ConnectorError as exc:
            return [GONE, args[0], str(exc).encode()], None
        return [OK, args[0]], None

    def _on_release(self, args: list[bytes]) -> Reply:
        try:
            held = self._held.take(frame_text(args[0]), frame_text(args[1]))
        except Gone as exc:
            return [ERR, args[0], str(exc).encode()], None
        self._release(held)
        return [OK, args[0]], None

    # ---- consumer side

    def _fetch(
        self, endpoint: str, key: str, metadata: dict, timeout_s: float, where: str, *, poll: bool = False
    ) -> tuple[Any, int]:
        """Claim, pull, release and decode the payload (`poll` changes nothing: a claimed payload is
        pulled to the end, up to `timeout_s`)."""
        size = int(metadata["size"])
        deadline = time.monotonic() + timeout_s
        request = [key.encode(), str(metadata["token"]).encode()]
        self._side_request(endpoint, b"CLAIM", request, deadline, where)
        offset = self._local_slot(size, deadline, where)
        unfinished = None
        try:
            try:
                unfinished = self._pull(metadata, offset, size, deadline)
            except ConnectorError as exc:  # the engine's reason, here with edge, key and endpoint
                self._error()
                raise retold(exc, f"{where}: {exc}") from exc  # keeps its kind (ConnectorUnavailable, ...)
            if unfinished is not None:
                self._error()
                raise ConnectorError(f"{where}: the transfer did not finish by the deadline")
            # Objects that do not reference the pool: views over our own host copy.
            region = self._pool[offset : offset + size]
            obj = decode(region.numpy().copy() if region.device.type == "cpu" else region.cpu().numpy())
        except FrameError as exc:
            self._error()
            raise ConnectorError(f"{where}: corrupt frame: {exc}") from None
        finally:
            if unfinished is None:
                self._slots.free(offset)
            else:  # the engine may still write there: free the slot once it has finished
                self._orphans.add(lambda: self._transfer_done(unfinished), lambda: self._slots.free(offset))
        # The payload is ours now: a lost release only delays the producer's free to its ttl_s.
        with contextlib.suppress(ConnectorError):
            self._side_request(endpoint, b"RELEASE", request, max(deadline, time.monotonic() + 1.0), where)
        return obj, size

    def _side_request(self, endpoint: str, op: bytes, args: list[bytes], deadline: float, where: str) -> None:
        timeout = max(0.0, deadline - time.monotonic())
        late = (
            f"no answer to {op.decode()} within {timeout:.1f}s; the producing process is gone "
            "or its host is unreachable"
        )
        self._ask(endpoint, [op, *args], timeout, where, late)

    def _local_slot(self, size: int, deadline: float, where: str) -> int:
        while True:
            self._orphans.reap()
            offset = self._slots.allocate(size)
            if offset is not None:
                return offset
            if time.monotonic() >= deadline:
                self._error()
                raise ConnectorError(
                    f"{where}: no room for {size} bytes in this consumer's memory pool "
                    f"({self._slots.size - self._slots.in_use} of {self._slots.size} free) before the deadline; "
                    "raise memory_pool_size"
                )
            time.sleep(0.002)  # other gets finish and free their slots
