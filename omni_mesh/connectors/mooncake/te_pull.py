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

from typing import Any

import msgpack

from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.mooncake import device_transfer

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
