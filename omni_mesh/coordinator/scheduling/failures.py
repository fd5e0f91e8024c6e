"""Why a request failed, and the one mapping from that failure to what a client is answered.

A request fails with RequestFailed: its `status` is the mesh's (the REST API answers it as it is), and
`openai_body` turns it into OpenAI's error object and status for the OpenAI routes. A stage says how it
failed a request (its Error message's `kind`, never an HTTP status); `STAGE_FAILURES` is the one place a
kind becomes a status, and `stage_failure` the RequestFailed. A new kind gets its row there and, if
OpenAI names its status differently, one row in `_OPENAI`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_mesh.connectors.errors import ConnectorFull
from omni_mesh.control import Error, FailureKind

#: Retry-After (seconds) of a 503 for full memory: payloads of requests under way go once they end.
FULL_RETRY_AFTER_S = 1

#: Status of a request whose client went away (nginx's convention): nobody reads it, the access log does.
CLIENT_GONE = 499


class RequestFailed(Exception):
    """A request refused at admission or failed on its way: `status` is its HTTP status on the REST API.

    `field` names the request field at fault (422), `headers` go with the answer (429's Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        stage: str | None = None,
        *,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.stage = stage
        self.field = field
        self.headers = headers


#: What a client is answered when a stage fails its request: (status, message) by the failure's kind;
#: the message may name the stage, the replica and the stage's own `error`.
STAGE_FAILURES: dict[FailureKind, tuple[int, str]] = {
    # The stage's own deadline fired before the coordinator's monitor noticed: the same 504.
    FailureKind.DEADLINE: (504, "deadline exceeded while at stage {stage!r} (replica {replica!r})"),
    # The handler says the request's inputs or params are wrong: the client's to fix.
    FailureKind.INVALID_INPUT: (422, "stage {stage!r}: {error}"),
    # The replica could not read the work it was sent: the mesh's fault, not the stage's.
    FailureKind.UNREADABLE_WORK: (502, "stage {stage!r} could not read its work: {error}"),
    # A connector's memory is full: the same request may pass later (Retry-After).
    FailureKind.CONNECTOR_FULL: (503, "stage {stage!r} failed: {error}"),
    # A connector failed on an edge (named in the error): the data plane's fault.
    FailureKind.CONNECTOR_FAILED: (502, "stage {stage!r} failed: {error}"),
    FailureKind.CONNECTOR_REFUSED: (500, "stage {stage!r} failed: {error}"),
    FailureKind.HANDLER_FAILED: (500, "stage {stage!r} failed: {error}"),
    # What the stage sent was lost on the way here and cannot be sent again: the mesh's fault.
    FailureKind.OUTPUT_LOST: (502, "stage {stage!r} failed: {error}"),
    # The replica had no free slot: the dispatcher places the work again, so a client sees this only
    # where no other answer is left (the request's deadline is its own 504).
    FailureKind.REPLICA_FULL: (503, "stage {stage!r} replica {replica!r} was full: {error}"),
}


def stage_failure(replica_id: str, message: Error) -> RequestFailed:
    """The failure a stage's Error message means for its request."""
    status, template = STAGE_FAILURES[message.kind]
    text = template.format(stage=message.stage, replica=replica_id, error=message.error)
    if status == 503:
        return memory_full(text, message.stage)
    return RequestFailed(status, text, message.stage)


def memory_full(message: str, stage: str | None) -> RequestFailed:
    """503 with Retry-After: a connector's memory (shared memory, a pool) had no room for a payload."""
    return RequestFailed(503, message, stage, headers={"retry-after": str(FULL_RETRY_AFTER_S)})


def inputs_not_held(exc: Exception, stage: str, *, again: bool = False) -> RequestFailed:
    """The ingress connector could not hold a request's large inputs for `stage`: 503 + Retry-After
    when its memory was full, else 500."""
    what = "the inputs again" if again else "the request's inputs"
    message = f"could not hold {what}: {exc}"
    return memory_full(message, stage) if isinstance(exc, ConnectorFull) else RequestFailed(500, message, stage)


@dataclass(frozen=True)
class _OpenAIKind:
    status: int  # the status OpenAI answers for it
    type: str
    code: str | None = None


_OPENAI: dict[int, _OpenAIKind] = {
    400: _OpenAIKind(400, "invalid_request_error"),
    401: _OpenAIKind(401, "authentication_error"),
    404: _OpenAIKind(404, "invalid_request_error", "model_not_found"),
    413: _OpenAIKind(413, "invalid_request_error", "request_too_large"),
    422: _OpenAIKind(400, "invalid_request_error"),  # OpenAI calls every invalid request 400
    429: _OpenAIKind(429, "rate_limit_error", "queue_full"),
    503: _OpenAIKind(503, "server_error", "memory_full"),
    504: _OpenAIKind(504, "server_error", "timeout"),
}


def openai_kind(status: int) -> _OpenAIKind:
    return _OPENAI.get(status) or _OpenAIKind(status, "server_error" if status >= 500 else "invalid_request_error")


def openai_body(status: int, message: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    """(OpenAI's status, OpenAI's error object) for a failure of the mesh's `status`."""
    kind = openai_kind(status)
    return kind.status, {"error": {"message": message, "type": kind.type, "param": param, "code": kind.code}}
