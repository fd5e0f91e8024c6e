"""How a payload is named on one edge of the stage graph."""

from __future__ import annotations


def edge_key(from_stage: str, to_stage: str, key: str) -> str:
    """The name of one payload on one edge: two edges never collide on the same request key."""
    return f"{from_stage}->{to_stage}/{key}"


def payload_name(from_stage: str, to_stage: str, key: str) -> str:  # how errors name one payload
    return f"key {key!r} on edge {from_stage}->{to_stage}"


def cleaned_by(put_key: str, key: str) -> bool:
    """Whether `cleanup(key)` drops a payload put under `put_key`: the request's key itself, or one under
    it (`key/...`: a stage's chunks and parts of one request)."""
    return put_key == key or put_key.startswith(key + "/")
