"""The Mooncake Transfer Engine connector's side channel: a consumer asks the producer to WRITE.

    consumer  [PULL, key, msgpack {session, handle, length, segment, addr, timeout_ms[, device_addrs]}]
    producer  checks the request, writes the payload into the consumer's segment at `addr` with its
              engine (on a transfer thread), then answers [OK, key[, small pieces]] or [ERR, key, reason]
              (the small pieces: `frame_pieces.split_inline`, copied into the region by the consumer)

The consumer first waits up to connect_timeout_s for the producer's side channel to accept its
connection (nothing is sent before, so nothing can be written late), then up to transfer_timeout_s
for the answer. A request unanswered by then may still be written: its region and receive buffers
stay quarantined until the late answer arrives or ttl_s passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from omni_mesh.connectors.errors import ConnectorClosed, ConnectorError
from omni_mesh.connectors.mooncake import device_transfer
from omni_mesh.connectors.pools.held import Gone, PendingReleases
from omni_mesh.connectors.served.channel import OK, frame_text
from omni_mesh.connectors.served.connector import GONE
from omni_mesh.connectors.served.dealers import ChannelClosed, DealerPool, LateReply, NotConnected, PeerLost

PULL = b"PULL"
LOOKUP = b"LOOKUP"  # [LOOKUP, key] -> [OK, key, msgpack {session, handle, length, device}] or [GONE, key, why]
METADATA_KINDS = {
    "segment": str,
    "endpoint": str,
    "session": str,
    "handle": int,
    "addr": int,
    "length": int,
    "key": str,
}
REQUEST_KINDS = {"session": str, "handle": int, "length": int, "segment": str, "addr": int, "timeout_ms": int}


MIN_WAIT_S = 0.05  # a pull asked for at its deadline still gets this long: the producer may be quick

class PullTimedOut(ConnectorError):
    """A pull timed out: its region stays reserved until the late answer or ttl_s."""


def untyped(fields: dict, kinds: dict[str, type]) -> str | None:
    """The first of `kinds` missing from `fields` or not exactly of its type."""
    return next((name for name, kind in kinds.items() if type(fields.get(name)) is not kind), None)


def complete(metadata: Any) -> bool:
    """Whether `metadata` is what put() returned (else the payload is located by its key)."""
    return isinstance(metadata, dict) and all(name in metadata for name in ("session", "handle", "length"))


def check_metadata(owner: str, metadata: Any, key: str, where: str) -> dict:
    """The metadata put() returned, checked before anything is allocated for it."""
    if not isinstance(metadata, dict):
        raise ConnectorError(f"{owner}: get of {where} needs the metadata that put() returned")
    if "device" in metadata and not device_transfer.sizes_ok(metadata["device"]):
        raise ConnectorError(
            f"{owner}: metadata for {where} has a bad 'device' list: {metadata['device']!r}"[:300]
        )
    bad = untyped(metadata, METADATA_KINDS)
    if bad:
        raise ConnectorError(f"{owner}: metadata for {where} lacks a valid {bad!r}: {metadata!r}")
    if metadata["key"] != key:
        raise ConnectorError(f"{owner}: metadata for {where} was made for {metadata['key']!r}")
    if not metadata["endpoint"].startswith("tcp://") or metadata["length"] <= 0:
        raise ConnectorError(f"{owner}: malformed metadata for {where}: {metadata!r}")
    return metadata


def parse_request(args: list[bytes]) -> dict:
    """A PULL request's fields (producer side), type-checked: untrusted bytes. ValueError otherwise."""
    try:
        request = msgpack.unpackb(args[1], raw=False) if len(args) == 2 else None
        if not isinstance(request, dict) or untyped(request, REQUEST_KINDS):
            raise ValueError
        request["key"] = args[0].decode()
    except ValueError:  # msgpack's errors and UnicodeDecodeError are ValueErrors too
        raise ValueError("malformed pull request") from None
    return request


def pull(
    owner: str,
    cfg: Any,
    dealers: DealerPool,
    quarantine: PendingReleases,
    meta: dict,
    request: dict,
    where: str,
    release: Callable[[], None],
    deadline: float | None = None,
) -> bytes | None:
    """Send one PULL (`request`: segment, addr and device_addrs of our side) to the producer `meta`
    names and wait for its answer, never past `deadline` (the request's, time.monotonic()): the small
    pieces it carried, if any. ConnectorError on any failure; PullTimedOut when the producer may still write, after handing
    `release` (what frees the region) to `quarantine`."""
    endpoint = meta["endpoint"]
    # A request past its deadline has been answered already: a thread (and a region of the pool)
    # waiting on for transfer_timeout_s would serve nobody.
    left = cfg.transfer_timeout_s if deadline is None else max(MIN_WAIT_S, deadline - time.monotonic())
    transfer_s, connect_s = min(cfg.transfer_timeout_s, left), min(cfg.connect_timeout_s, left)
    request = {**request, "session": meta["session"], "handle": meta["handle"], "length": meta["length"]}
    request["timeout_ms"] = int(transfer_s * 1000)
    parts = [PULL, meta["key"].encode(), msgpack.packb(request)]
    try:
        reply = dealers.request(endpoint, parts, transfer_s, connect_timeout_s=connect_s, keep_late=True)
    except NotConnected:
        raise ConnectorError(
            f"{owner}: get of {where}: the producer's side channel {endpoint} did not accept a "
            f"connection within {round(connect_s, 3)}s; is the producer process alive and reachable?"
        ) from None
    except LateReply as exc:
        late, until = exc, time.monotonic() + cfg.ttl_s  # `exc` is unbound when the block ends
        quarantine.add(lambda: late.arrived() or time.monotonic() >= until, lambda: (late.close(), release()))
        why = str(exc) if isinstance(exc, PeerLost) else f"within {round(transfer_s, 3)}s (transfer_timeout_s or the deadline)"
        raise PullTimedOut(
            f"{owner}: get of {where}: the producer at {endpoint} did not deliver {meta['length']} bytes: {why}"
        ) from None
    except ChannelClosed:
        raise ConnectorClosed(f"{owner} is closed (get of {where})") from None
    except (TimeoutError, zmq.ZMQError) as exc:
        raise ConnectorError(f"{owner}: get of {where} from {endpoint}: {exc}") from None
    if reply[0].bytes == GONE:
        raise Gone(f"{owner}: get of {where}: not at the producer {endpoint} (consumed, cleaned up or expired)")
    if reply[0].bytes != OK:
        reason = frame_text(reply[2]) if len(reply) > 2 else "refused"
        raise ConnectorError(f"{owner}: get of {where} failed at the producer {endpoint}: {reason}")
    return reply[2].bytes if len(reply) > 2 else None
