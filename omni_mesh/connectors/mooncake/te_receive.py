"""The Mooncake TE connector's consumer side: one get, from metadata to the decoded payload.

    by key alone   metadata missing or partial: the producer it names (or the config's sender
                   fields) is asked, over the side channel, for the rest (`te_pull.LOOKUP`)
    remote         a region of the payload's length is reserved in this process's pool, and receive
                   buffers registered for its device tensors; the producer is asked to write into
                   them (`te_pull.PULL`); the frame is decoded as views over the region
    local          producer and consumer are the same instance: the producer's region is handed
                   over (or, for a frame in pieces, assembled into a fresh one), no transfer

A pull that timed out leaves its region and buffers quarantined until the late answer or ttl_s
(`te_pull`); every other failure frees them at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack
import torch
import zmq

from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.errors import ConnectorClosed, ConnectorError
from omni_mesh.connectors.mooncake import device_transfer, frame_pieces, te_pull
from omni_mesh.connectors.mooncake.te_payloads import Payloads
from omni_mesh.connectors.pools.held import Gone, PendingReleases
from omni_mesh.connectors.served.channel import OK, frame_text
from omni_mesh.connectors.served.connector import GONE, POLL_S, producer_endpoint
from omni_mesh.connectors.served.dealers import ChannelClosed, DealerPool, LateReply, NotConnected, PeerLost

MIN_WAIT_S = 0.05  # a pull asked for at its deadline still gets this long: the producer may be quick


class PullTimedOut(ConnectorError):
    """A pull timed out: its region stays reserved until the late answer or ttl_s."""


class Receiver:
    """The gets of one connector instance, into its `pool` (module docstring); thread-safe."""

    def __init__(
        self,
        payloads: Payloads,
        *,
        device_leaves: device_transfer.DeviceLeavesPolicy,
        dealers: DealerPool,
        quarantine: PendingReleases,
        counters: Counters,
        segment: str,
        endpoint: str,
    ) -> None:
        self._payloads = payloads  # this instance's own puts: a get of one is handed over locally
        self._owner = payloads.owner
        self._cfg = payloads.cfg
        self._pool = payloads.pool
        self._registrations = payloads.registrations
        self._device_leaves = device_leaves
        self._dealers = dealers
        self._quarantine = quarantine
        self._counters = counters
        # This instance as its peers know it: where producers write, and whose puts are its own.
        self._segment, self._endpoint, self._session = segment, endpoint, payloads.session

    def get(
        self, key: str, where: str, metadata: Any, *, poll: bool, deadline: float | None = None
    ) -> tuple[Any, int] | None:
        """The payload under edge `key`, or None when the producer has no such payload (any more) or,
        by key alone and polling, does not answer within a second. A transfer is waited for up to
        transfer_timeout_s, and never past `deadline` (time.monotonic(): the request's own)."""
        if not te_pull.complete(metadata):
            metadata = self._lookup(metadata, key, where, poll)
            if metadata is None:
                return None
        meta = te_pull.check_metadata(self._owner, metadata, key, where)
        try:
            if meta["session"] == self._session:
                return self._get_local(meta, where)
            return self._get_remote(meta, where, deadline)
        except Gone:
            return None

    def _lookup(self, metadata: Any, key: str, where: str, poll: bool) -> dict | None:
        """Full metadata for a get by key alone, from the producer named by partial metadata or the
        config's sender fields; None when it has no such payload (or, polling, does not answer)."""
        owner = self._owner
        fields = metadata if isinstance(metadata, dict) else {}
        if fields.get("key", key) != key:
            raise ConnectorError(f"{owner}: metadata for {where} was made for {fields['key']!r}")
        endpoint = fields.get("endpoint") if isinstance(fields.get("endpoint"), str) else None
        endpoint = endpoint or producer_endpoint(fields, self._cfg)
        if endpoint is None:
            if self._payloads.find(key) is not None:
                endpoint = self._endpoint  # put here: this instance is the producer
            else:
                return None
        wait = min(POLL_S, self._cfg.connect_timeout_s)
        try:
            reply = self._dealers.request(
                endpoint, [te_pull.LOOKUP, key.encode()], wait, connect_timeout_s=wait
            )
        except (TimeoutError, zmq.ZMQError, NotConnected) as exc:
            if poll:
                return None
            raise ConnectorError(
                f"{owner}: get of {where}: the producer {endpoint} did not answer: {exc}"
            ) from None
        except ChannelClosed:
            raise ConnectorClosed(f"{owner} is closed (get of {where})") from None
        if reply[0].bytes == GONE:
            return None
        if reply[0].bytes != OK or len(reply) != 3:
            raise ConnectorError(f"{owner}: get of {where}: the producer {endpoint} refused the lookup")
        found = msgpack.unpackb(reply[2].bytes, raw=False)
        if not isinstance(found, dict):
            raise ConnectorError(f"{owner}: get of {where}: malformed lookup answer from {endpoint}")
        return {"segment": "", "endpoint": endpoint, "addr": 0, "key": key, **found}

    def _get_remote(self, meta: dict, where: str, deadline: float | None) -> tuple[Any, int]:
        pool, length = self._pool, meta["length"]
        offset = pool.reserve(length, self._cfg.pool_wait_s, f"get of {where}")
        device: list[torch.Tensor] = []
        receiving: list[int] = []

        def release() -> None:  # nothing can land in the region and buffers any more
            pool.free(offset)
            self._registrations.release(receiving)
            device.clear()

        try:
            device += self._receive_buffers(meta, where, receiving)
            request = {"segment": self._segment, "addr": pool.address_of(offset)}
            if device:
                request["device_addrs"] = [buffer.data_ptr() for buffer in device]
            inline = self._pull(meta, request, where, release, deadline)
            if inline is not None:
                try:
                    frame_pieces.place_inline(inline, pool.address_of(offset), length)
                except ValueError as exc:
                    raise ConnectorError(
                        f"{self._owner}: get of {where}: the producer {meta['endpoint']} answered with {exc}"
                    ) from None
        except PullTimedOut:
            self._counters.add("errors")
            raise  # `release` runs at the late answer or ttl_s
        except Gone:
            release()
            raise
        except BaseException:
            release()
            self._counters.add("errors")
            raise
        self._registrations.release(receiving)
        data = pool.decode(offset, length, where, copy=self._cfg.copy_on_get, device=device)
        self._counters.add_many(gets=1, bytes_got=length, device_tensors=len(device))
        return data, length

    def _pull(
        self, meta: dict, request: dict, where: str, release: Callable[[], None], deadline: float | None
    ) -> bytes | None:
        """Send one PULL (`request`: segment, addr and device_addrs of our side) to the producer `meta`
        names and wait for its answer, never past `deadline` (the request's, time.monotonic()): the small
        pieces it carried, if any. ConnectorError on any failure; PullTimedOut when the producer may still
        write, after handing `release` (what frees the region) to the quarantine."""
        owner, cfg, endpoint = self._owner, self._cfg, meta["endpoint"]
        # A request past its deadline has been answered already: a thread (and a region of the pool)
        # waiting on for transfer_timeout_s would serve nobody.
        left = cfg.transfer_timeout_s if deadline is None else max(MIN_WAIT_S, deadline - time.monotonic())
        transfer_s, connect_s = min(cfg.transfer_timeout_s, left), min(cfg.connect_timeout_s, left)
        request = {**request, "session": meta["session"], "handle": meta["handle"], "length": meta["length"]}
        request["timeout_ms"] = int(transfer_s * 1000)
        parts = [te_pull.PULL, meta["key"].encode(), msgpack.packb(request)]
        try:
            reply = self._dealers.request(
                endpoint, parts, transfer_s, connect_timeout_s=connect_s, keep_late=True
            )
        except NotConnected:
            raise ConnectorError(
                f"{owner}: get of {where}: the producer's side channel {endpoint} did not accept a "
                f"connection within {round(connect_s, 3)}s; is the producer process alive and reachable?"
            ) from None
        except LateReply as exc:
            late, until = exc, time.monotonic() + cfg.ttl_s  # `exc` is unbound when the block ends
            self._quarantine.add(
                lambda: late.arrived() or time.monotonic() >= until, lambda: (late.close(), release())
            )
            limit = f"within {round(transfer_s, 3)}s (transfer_timeout_s or the deadline)"
            why = str(exc) if isinstance(exc, PeerLost) else limit
            raise PullTimedOut(
                f"{owner}: get of {where}: the producer at {endpoint} did not deliver {meta['length']} "
                f"bytes: {why}"
            ) from None
        except ChannelClosed:
            raise ConnectorClosed(f"{owner} is closed (get of {where})") from None
        except (TimeoutError, zmq.ZMQError) as exc:
            raise ConnectorError(f"{owner}: get of {where} from {endpoint}: {exc}") from None
        if reply[0].bytes == GONE:
            raise Gone(
                f"{owner}: get of {where}: not at the producer {endpoint} (consumed, cleaned up or expired)"
            )
        if reply[0].bytes != OK:
            reason = frame_text(reply[2]) if len(reply) > 2 else "refused"
            raise ConnectorError(f"{owner}: get of {where} failed at the producer {endpoint}: {reason}")
        return reply[2].bytes if len(reply) > 2 else None

    def _receive_buffers(self, meta: dict, where: str, registered: list[int]) -> list[torch.Tensor]:
        """Buffers for the payload's device tensors, if it has any, registered into `registered`."""
        sizes = meta.get("device", [])
        if not sizes:
            return []
        try:
            buffers = self._device_leaves.receive_buffers(sizes)
        except RuntimeError as exc:  # out of device memory
            raise ConnectorError(
                f"{self._owner}: get of {where}: no memory for {sum(sizes)} device bytes: {exc}"
            ) from None
        addresses = self._registrations.receive(buffers)
        if addresses is None:
            raise ConnectorError(
                f"{self._owner}: get of {where}: the engine refused to register a receive buffer on "
                f"{buffers[0].device}"
            )
        registered += addresses
        return buffers

    def _get_local(self, meta: dict, where: str) -> tuple[Any, int]:
        """Producer and consumer are this instance: hand the producer's region over, no transfer."""
        try:
            payload = self._payloads.claim(meta["key"], meta["handle"], meta["length"])
        except Gone:  # get() answers None
            raise
        except ConnectorError as exc:
            self._counters.add("errors")
            raise ConnectorError(f"{self._owner}: get of {where}: {exc}") from None
        length, offset, pool = payload.size, payload.offset, self._pool
        # The producer's own device tensors are handed over as they are (copy_on_get clones them).
        device = [t.reshape(-1).view(torch.uint8) for t in payload.device]
        if payload.pieces is not None:  # assemble the frame from its pieces in a fresh region
            try:
                offset = pool.reserve(length, self._cfg.pool_wait_s, f"get of {where}")
                frame_pieces.assemble(payload.pieces, pool.address_of(offset))
            finally:
                self._payloads.finish(payload, consumed=True)
        else:
            self._payloads.hand_over(payload)
        data = pool.decode(offset, length, where, copy=self._cfg.copy_on_get, device=device)
        self._counters.add_many(gets=1, bytes_got=length, local_gets=1, device_tensors=len(device))
        return data, length
