"""A Mooncake TE producer's payloads: what each frame is sent from, and how long it is kept.

A payload lies whole in a region of the registered pool, or in pieces (`frame_pieces`): its head and
small leaves in a region, its large leaves in their own memory, registered with the engine while the
payload lives. Device tensors travel beside the frame from their own registered memory. Payloads are
held under "key#handle" (a put never replaces another) until a write of it to a consumer succeeds,
ttl_s passes or cleanup() drops it; one being written never expires and, if dropped meanwhile, is
freed when its write ends.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_mesh import codec
from omni_mesh.connectors.config import MooncakeTransferEngineConfig
from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.mooncake import device_transfer as _device_transfer
from omni_mesh.connectors.mooncake import frame_pieces, te_write
from omni_mesh.connectors.mooncake.registrations import Registrations
from omni_mesh.connectors.pools.held import Gone, Held, HeldTable
from omni_mesh.connectors.pools.registered import RegisteredPool


@dataclass(eq=False)
class Payload(Held):
    """One payload: its pool region (`offset`, None until reserved) and what else it is sent from."""

    pieces: list[frame_pieces.Piece] | None = None  # None: the frame lies whole at `offset`
    address: int = 0  # where the pool region at `offset` lies (or the head, in an output's headroom)
    headroom: Any = None  # the _te_outputs.Output whose headroom holds the head, free again at release
    sources: list[Any] = field(default_factory=list)  # large leaves, kept alive and unchanged
    registered: list[int] = field(default_factory=list)  # their engine registrations (addresses)
    #: Device tensors sent beside the frame (DeviceLeaves), in frame order: contiguous, registered.
    device: list[torch.Tensor] = field(default_factory=list)


class Payloads:
    """The producer's payloads in `pool` (module docstring); thread-safe. Its owner, pool,
    registrations, session and config are the connector's, read by its `te_receive.Receiver` too."""

    def __init__(
        self,
        owner: str,
        engine: Any,
        pool: RegisteredPool,
        registrations: Registrations,
        session: str,
        cfg: MooncakeTransferEngineConfig,
        on_deferred: Callable[[Payload], None] | None = None,
    ) -> None:
        self.owner = owner
        self._engine = engine
        self.pool = pool
        self.registrations = registrations
        self.session = session  # every payload's token: metadata from another instance never matches
        self.cfg = cfg  # ttl_s, pool_wait_s, protocol, zero_copy_min_bytes
        # on_deferred: a payload of put_planned is stored (and counted there) by the table's next reader
        self._held = HeldTable(cfg.ttl_s, expire_claimed=False, on_replaced=self.release, on_deferred=on_deferred)

    def put(
        self, frame: codec.FramePlan, device: list[torch.Tensor], ref: tuple[str, str, int], what: str
    ) -> Payload:
        """Lay the frame into the pool, register what is sent from elsewhere and hold the payload;
        `ref` is (edge key, put_key, handle)."""
        key, put_key, handle = ref
        payload = Payload(f"{key}#{handle}", put_key, self.session, frame.nbytes, None, device=device)
        try:
            if device:
                self._register_device(payload, what)
            scattered = None
            min_bytes = self.cfg.zero_copy_min_bytes
            if min_bytes and frame.nbytes >= min_bytes:
                # Leaves in the pool (connector.empty() outputs) are registered already; with RDMA
                # only those are sent from where they lie (registering other memory per put costs).
                share = (
                    functools.partial(self.registrations.share, registered=payload.registered)
                    if self.cfg.protocol == "tcp"
                    else self.pool.contains
                )
                reserve = functools.partial(self._reserve, payload, what=what)
                scattered = frame_pieces.scatter(frame, min_bytes, share, reserve)
            if scattered is not None:
                payload.offset, payload.pieces, payload.sources = scattered
            else:
                self._reserve(payload, frame.nbytes, what)
                frame.write_at(payload.address)  # the region holds frame.nbytes mapped bytes
        except BaseException:
            self.release(payload)
            raise
        payload.touched = time.monotonic()
        self._held.add(payload)
        return payload

    def put_planned(self, planned: Any, key: str, put_key: str, handle: int) -> None:
        """Hold a payload laid out in place (`mooncake.te_outputs.Planned`: nothing to reserve or copy), made
        and stored by the table's next reader (HeldTable.defer): the put costs one append."""
        self._held.defer((self._planned_payload, planned, key, put_key, handle))

    def _planned_payload(self, planned: Any, key: str, put_key: str, handle: int) -> Payload:
        nbytes, pieces, sources, headroom = planned
        address = pieces[0][0]  # the head, in an output's headroom
        return Payload(
            f"{key}#{handle}", put_key, self.session, nbytes, None,
            pieces=pieces, sources=list(sources), address=address, headroom=headroom,
        )  # its own list of sources: release() empties it, and a laid-out put reuses the one given

    def _reserve(self, payload: Payload, nbytes: int, what: str) -> tuple[int, int]:
        payload.offset, payload.address = self.pool.reserve_placed(nbytes, self.cfg.pool_wait_s, what)
        return payload.offset, payload.address

    def _register_device(self, payload: Payload, what: str) -> None:
        """Register the memory of the tensors sent device to device (after their kernels are done)."""
        _device_transfer.settle(payload.device)
        for tensor in payload.device:
            if tensor.nbytes and not self.registrations.share(
                tensor.data_ptr(), tensor.nbytes, payload.registered
            ):
                self.pool.errors.count()
                raise ConnectorError(
                    f"{self.owner}: {what}: the engine refused to register {tensor.nbytes} bytes of "
                    f"{tensor.device} memory; set device_transfer: false to send CUDA tensors through host "
                    "memory"
                )

    def claim(self, key: str, handle: int, length: int) -> Payload:
        """The payload, reserved for one reader (a write to a consumer, or a local get); Gone when it
        is not there, ConnectorError when another reader has it or the metadata does not match."""
        ref = f"{key}#{handle}"
        payload = self._held.claim(ref, self.session, exclusive=True)
        if payload.size != length:
            self._held.unclaim(ref, self.session)
            raise ConnectorError(f"metadata does not match the payload put under handle {handle}")
        return payload

    def find(self, key: str) -> Payload | None:
        """The newest payload put under edge key `key` that nobody is reading (a get by key alone)."""
        return self._held.newest(f"{key}#")

    def finish(self, payload: Payload, consumed: bool) -> None:
        """A reader is done: free the payload if it was consumed (or dropped meanwhile), else keep it."""
        try:
            done = (
                self._held.take(payload.key, self.session)
                if consumed
                else self._held.unclaim(payload.key, self.session)
            )
        except Gone:  # dropped meanwhile: whoever dropped it freed it
            return
        if done is not None:
            self.release(done)

    def hand_over(self, payload: Payload) -> None:
        """A local get took the payload: it leaves the table, and a whole frame's region goes with it
        (freed when the getter's views die)."""
        with contextlib.suppress(Gone):  # dropped meanwhile: it is ours to release all the same
            self._held.take(payload.key, self.session)
        if payload.pieces is None:
            payload.offset = None
        self.release(payload)

    def write(self, request: dict, closing: Callable[[], bool]) -> bytes | None:
        """Write the payload a consumer's PULL names (`mooncake.te_pull.parse_request`) into its segment with
        one engine call; the small pieces that ride the answer instead (`frame_pieces.split_inline`).
        Gone or a ConnectorError saying why not. A payload whose write failed waits again, unless
        `closing()`."""
        deadline = time.monotonic() + request["timeout_ms"] / 1000
        payload = self.claim(request["key"], request["handle"], request["length"])
        targets = request.get("device_addrs", [])
        rc, inline = -1, None
        try:
            if not _device_transfer.addresses_match(targets, payload.device):
                raise ConnectorError(
                    f"the consumer's device buffers do not match the {len(payload.device)} device tensors"
                )
            if time.monotonic() < deadline:  # the consumer has not given up on it yet
                pieces, inline = frame_pieces.split_inline(payload.pieces or [(payload.address, 0, payload.size)])
                sources, dests, sizes = frame_pieces.moves(pieces, request["addr"], payload.device, targets)
                rc = te_write.write(self._engine, request["segment"], sources, dests, sizes) if sources else 0
        finally:
            self.finish(payload, consumed=rc == 0 or closing())
        if rc != 0:
            raise ConnectorError(f"the engine's write to segment {request['segment']} failed (rc={rc})")
        return inline

    def release(self, payload: Payload) -> None:
        """Give a payload's region, registrations and leaf references back."""
        if payload.offset is not None:
            self.pool.free(payload.offset)
            payload.offset = None
        self.registrations.drop(payload.registered)
        if payload.headroom is not None:  # its head is no longer sent: the headroom may take another
            payload.headroom.give_back()
            payload.headroom = None
        payload.sources.clear()
        payload.device.clear()

    def expire(self) -> int:
        return self._release_all(self._held.pop_expired(time.monotonic()))

    def clean(self, key: str) -> int:
        return self._release_all(self._held.pop_matching(key))

    def close(self) -> None:
        self._release_all(self._held.pop_all())

    def _release_all(self, payloads: list) -> int:
        for payload in payloads:
            self.release(payload)
        return len(payloads)

    def __len__(self) -> int:
        return len(self._held)
