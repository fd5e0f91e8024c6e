"""The one place the error family meets vllm-omni's return values (OmniConnectorBase): a put that
fails answers (False, 0, None) and keeps its typed error; a poll whose payload is not there
(PayloadMissing) answers None, while every other failure still raises. Shown on a third-party
connector written against the base (as a user's would be) and on the built-in InProcessConnector.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from omni_mesh.connectors import (
    ConnectorError,
    ConnectorUnavailable,
    OmniConnectorBase,
    PayloadMissing,
    PayloadTooLarge,
    create_connector,
)
from omni_mesh.connectors.config import InProcessConfig


class Dictionary(OmniConnectorBase):
    """A connector of one dict: `_put` raises for what it cannot hold, `_poll` for what it has not."""

    config_class = InProcessConfig
    LIMIT = 8

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(config)
        self.held: dict[str, bytes] = {}
        self.down = False

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[int, dict | None]:
        frame = self.serialize_obj(data)
        if len(frame) > self.LIMIT * 1024:
            raise PayloadTooLarge(
                f"Dictionary: {len(frame)} bytes for {put_key!r} on {from_stage}->{to_stage}"
            )
        self.held[f"{from_stage}->{to_stage}/{put_key}"] = frame
        return len(frame), {}

    def _poll(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None
    ) -> tuple[Any, int] | None:
        if self.down:
            raise ConnectorUnavailable(f"Dictionary: down, get of {get_key!r}")
        name = f"{from_stage}->{to_stage}/{get_key}"
        if name not in self.held:
            raise PayloadMissing(f"Dictionary: no {get_key!r} on {from_stage}->{to_stage}")
        frame = self.held.pop(name)
        return self.deserialize_obj(frame), len(frame)

    def cleanup(self, key: str) -> None:
        self.held.clear()

    def health(self) -> dict:
        return {"status": "healthy", **self._put_health()}

    def close(self) -> None:
        self.held.clear()


def test_a_failed_put_answers_false_zero_none_and_keeps_its_kind() -> None:
    connector = Dictionary()
    assert connector.put("a", "b", "big/0", b"x" * 9000) == (False, 0, None)
    with pytest.raises(PayloadTooLarge, match="'big/1'"):
        connector.put_or_raise("a", "b", "big/1", b"x" * 9000)
    assert connector.health()["put_failures"] == 2


def test_a_poll_of_a_payload_not_there_is_none_and_other_failures_raise() -> None:
    connector = Dictionary()
    assert connector.get("a", "b", "never/0") is None  # PayloadMissing inside: vllm-omni's None
    ok, size, _ = connector.put("a", "b", "there/0", [1, 2, 3])
    assert ok and connector.get("a", "b", "there/0") == ([1, 2, 3], size)
    assert connector.get("a", "b", "there/0") is None  # consumed
    connector.down = True
    with pytest.raises(ConnectorUnavailable, match="down"):
        connector.get("a", "b", "never/0")


def test_a_wait_past_its_deadline_is_payload_missing_naming_edge_and_key() -> None:
    connector = Dictionary()
    with pytest.raises(PayloadMissing, match=r"Dictionary: get of key 'late/0' on edge a->b"):
        connector.get_with_deadline("a", "b", "late/0", deadline=time.monotonic() + 0.05)


def test_a_connector_without_a_get_says_so() -> None:
    class Nothing(Dictionary):
        _poll = OmniConnectorBase._poll

    with pytest.raises(NotImplementedError, match="Nothing implements neither get"):
        Nothing().get("a", "b", "k")


def test_the_in_process_connector_polls_through_the_base() -> None:
    connector = create_connector("InProcessConnector", {"namespace": "errors-test"})
    try:
        assert type(connector).get is OmniConnectorBase.get  # no get of its own: the base maps for it
        assert connector.get("a", "b", "never/0") is None
        ok, size, metadata = connector.put("a", "b", "k/0", {"x": 1})
        assert ok and connector.get("a", "b", "k/0", metadata) == ({"x": 1}, size)
    finally:
        connector.close()


class VllmOmniStyle(OmniConnectorBase):
    """A connector written to vllm-omni's contract: it overrides `put` and `get`, and says no more."""

    config_class = InProcessConfig

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        return (True, 3, {"k": put_key}) if data != "refused" else (False, 0, None)

    def get(self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None) -> Any:
        return None

    def cleanup(self, key: str) -> None:
        pass

    def health(self) -> dict:
        return {"status": "healthy", **self._put_health()}

    def close(self) -> None:
        pass


def test_put_or_raise_raises_where_put_answers_false_even_for_a_vllm_omni_style_put() -> None:
    """Our own callers (stage runtime, ingress) call put_or_raise: the typed error, no side table."""
    assert Dictionary().put_or_raise("a", "b", "k/0", [1]) == (len(Dictionary.serialize_obj([1])), {})
    connector = VllmOmniStyle()
    assert connector.put_or_raise("a", "b", "k/1", "fine") == (3, {"k": "k/1"})
    with pytest.raises(ConnectorError, match=r"VllmOmniStyle: put of key 'k/2' on edge a->b failed: put\(\) returned"):
        connector.put_or_raise("a", "b", "k/2", "refused")
    assert connector.health()["put_failures"] == 1
