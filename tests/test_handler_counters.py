"""A handler's counters as a replica sends them with its heartbeats: numbers under metric names pass, the
rest is left out (with a warning), and a handler whose counters() fails still heartbeats."""

from __future__ import annotations

import logging

import pytest

from omni_mesh.handlers import hooks_of
from omni_mesh.stage.counters import handler_counters


class Reporting:
    def __init__(self, reported: object) -> None:
        self.reported = reported

    def counters(self) -> object:
        if isinstance(self.reported, Exception):
            raise self.reported
        return self.reported


def test_numbers_under_metric_names_pass_and_the_rest_is_left_out(caplog: pytest.LogCaptureFixture) -> None:
    reported = {"cache_hits_total": 3, "cache_items": 1.5, "Bad-Name": 1, "flag": True, "text": "x", 7: 1}
    with caplog.at_level(logging.WARNING, logger="omni_mesh.stage"):
        assert handler_counters(hooks_of(Reporting(reported), "enc"), "enc") == {"cache_hits_total": 3, "cache_items": 1.5}
    left_out = [r.getMessage() for r in caplog.records]
    assert len(left_out) == 4 and all("stage enc: counter" in m for m in left_out)


def test_a_handler_without_counters_or_with_broken_ones_reports_nothing() -> None:
    assert handler_counters(hooks_of(object(), "plain"), "plain") == {}
    assert handler_counters(hooks_of(Reporting(RuntimeError("boom")), "broken"), "broken") == {}
    assert handler_counters(hooks_of(Reporting([("hits_total", 1)]), "listy"), "listy") == {}
