"""How a payload is named on one edge of the stage graph."""

from __future__ import annotations


def edge_key(from_stage: str, to_stage: str, key: str) -> str:
    """The name of one payload on one edge: two edges never collide on the same request key."""
    return f"{from_stage}->{to_stage}/{key}"


def payload_name(from_stage: str, to_stage: str, key: str) -> str:  # how errors name one payload
    return f"key {key!r} on edge {from_stage}->{to_stage}"
