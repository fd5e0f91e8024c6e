"""How a stage failed a request (control.FailureKind, on the wire) and what its client is answered: the
one table in coordinator/scheduling/failures.py. The statuses are the ones users have always seen."""

from __future__ import annotations

import pytest

from omni_mesh.control import Error, FailureKind
from omni_mesh.coordinator.scheduling.failures import (
    FULL_RETRY_AFTER_S,
    STAGE_FAILURES,
    openai_body,
    stage_failure,
)

#: kind -> (REST status, OpenAI status, what the message says), as clients have always been answered.
ANSWERS = {
    FailureKind.HANDLER_FAILED: (500, 500, "stage 'talker' failed: ValueError: boom"),
    FailureKind.INVALID_INPUT: (422, 400, "stage 'talker': ValueError: boom"),
    FailureKind.DEADLINE: (504, 504, "deadline exceeded while at stage 'talker' (replica 'talker-3')"),
    FailureKind.UNREADABLE_WORK: (502, 502, "stage 'talker' could not read its work: ValueError: boom"),
    FailureKind.CONNECTOR_FULL: (503, 503, "stage 'talker' failed: ValueError: boom"),
    FailureKind.CONNECTOR_FAILED: (502, 502, "stage 'talker' failed: ValueError: boom"),
    FailureKind.CONNECTOR_REFUSED: (500, 500, "stage 'talker' failed: ValueError: boom"),
    FailureKind.OUTPUT_LOST: (502, 502, "stage 'talker' failed: ValueError: boom"),
    FailureKind.REPLICA_FULL: (503, 503, "stage 'talker' replica 'talker-3' was full: ValueError: boom"),
}


def test_every_failure_kind_has_one_answer() -> None:
    assert set(STAGE_FAILURES) == set(FailureKind) == set(ANSWERS)


@pytest.mark.parametrize("kind", list(FailureKind), ids=[k.value for k in FailureKind])
def test_a_failure_kind_maps_to_the_status_clients_have_always_seen(kind: FailureKind) -> None:
    status, openai_status, says = ANSWERS[kind]
    failed = stage_failure("talker-3", Error("rid-1", "talker", "talker-3", "ValueError: boom", kind))
    assert (failed.status, failed.message, failed.stage) == (status, says, "talker")
    assert openai_body(failed.status, failed.message)[0] == openai_status
    # Only a full connector or replica says when to come back: the same request may pass then.
    full = (FailureKind.CONNECTOR_FULL, FailureKind.REPLICA_FULL)
    retry = {"retry-after": str(FULL_RETRY_AFTER_S)} if kind in full else None
    assert failed.headers == retry


def test_a_stage_error_text_with_braces_is_quoted_not_formatted() -> None:
    failed = stage_failure(
        "a-0", Error("rid-1", "a", "a-0", "KeyError: '{stage}' {0}", FailureKind.HANDLER_FAILED)
    )
    assert failed.message == "stage 'a' failed: KeyError: '{stage}' {0}"
