"""stage/sent.py: what a replica sent the coordinator, kept to send again after its control connection
dropped (the end-to-end case, with connections cut by the kernel, is in test_control_reconnect.py)."""

from __future__ import annotations

from typing import Any

from omni_mesh import control
from omni_mesh.control import Error, FailureKind, Output
from omni_mesh.stage.sent import SentLog

FAR = 1e12  # a deadline that does not come


class Wire:
    """The replica's link as the log sees it: each message packed (as the link does) and recorded."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    async def send(self, message: control.Message, *extra: Any) -> None:
        control.pack(message)
        self.sent.append((message, *extra))

    def take(self) -> list[tuple[str, int | None]]:
        taken = [(m.rid, m.seq if isinstance(m, Output) else None) for m, *_ in self.sent]
        self.sent.clear()
        return taken


def _out(rid: str, seq: int, last: bool = False) -> Output:
    return Output(rid, "s", "s-0", {}, seq, last, end=last)


async def test_it_sends_again_from_the_seq_asked_for_in_order_with_the_frames() -> None:
    wire = Wire()
    log = SentLog("s", "s-0", wire.send)
    for seq in range(3):
        await log.send(_out("r", seq), b"frame%d" % seq, deadline=FAR)
    await log.send(_out("r", 3, last=True), deadline=FAR)
    wire.take()
    await log.replay(["r"], {"r": 1})
    assert wire.sent[0][1:] == (b"frame1",)
    assert wire.take() == [("r", 1), ("r", 2), ("r", 3)]
    await log.replay(["r"], {"r": 4})
    assert wire.take() == [], "the coordinator has all of them"
    assert log.replayed == 3


async def test_an_error_is_sent_again_after_the_outputs_before_it() -> None:
    wire = Wire()
    log = SentLog("s", "s-0", wire.send)
    await log.send(_out("r", 0), deadline=FAR)
    await log.send(Error("r", "s", "s-0", "boom", FailureKind.HANDLER_FAILED), deadline=FAR)
    wire.take()
    await log.replay(["r"], {"r": 0})
    assert wire.take() == [("r", 0), ("r", None)]
    await log.replay(["r"], {"r": 1})
    assert wire.take() == [("r", None)]


async def test_requests_the_coordinator_no_longer_names_aborted_or_past_their_deadline_are_let_go() -> None:
    wire = Wire()
    log = SentLog("s", "s-0", wire.send)
    for rid, deadline in (("kept", FAR), ("done", FAR), ("aborted", FAR), ("late", 5.0)):
        await log.send(_out(rid, 0, last=True), b"x" * 1000, deadline=deadline)
    log.forget("aborted")
    log.expire(now=10.0)
    wire.take()
    await log.replay(["kept", "aborted", "late"], {"kept": 0, "aborted": 0, "late": 0})
    assert wire.take() == [("kept", 0)]
    await log.replay(["kept"], {"kept": 0})
    assert wire.take() == [("kept", 0)]
    assert 1000 < log.kept_bytes < 2000, (
        "only `kept` is held: `done` went with the question that did not name it"
    )


async def test_past_its_budget_it_forgets_ended_requests_first_and_says_so_when_asked() -> None:
    """Over the byte budget, the requests that ended here go first (the oldest first); one still
    running keeps what it sent. Asked for what it forgot, it fails that request (502), saying so."""
    wire = Wire()
    log = SentLog("s", "s-0", wire.send, limit_bytes=12_000)
    await log.send(_out("running", 0), b"r" * 3000, deadline=FAR)
    await log.send(_out("old", 0, last=True), b"o" * 3000, deadline=FAR)
    await log.send(_out("new", 0, last=True), b"n" * 3000, deadline=FAR)
    assert log.kept_bytes <= 12_000
    await log.send(_out("running", 1), b"r" * 3000, deadline=FAR)
    assert log.kept_bytes <= 12_000
    wire.take()
    await log.replay(["running", "old", "new"], {"running": 0, "old": 0, "new": 0})
    sent = wire.sent
    assert [(m.rid, type(m).__name__) for m, *_ in sent] == [
        ("running", "Output"),
        ("running", "Output"),
        ("old", "Error"),
        ("new", "Output"),
    ]
    error = sent[2][0]
    assert error.kind is FailureKind.OUTPUT_LOST and "output 0 was lost" in error.error and "no longer kept" in error.error


async def test_a_message_the_control_plane_refuses_is_not_kept() -> None:
    wire = Wire()
    log = SentLog("s", "s-0", wire.send)
    huge = Output("r", "s", "s-0", {"t": {"meta": "m" * control.MAX_MESSAGE_BYTES}}, 0, True)
    try:
        await log.send(huge, deadline=FAR)
    except control.MessageTooLarge:
        pass
    else:
        raise AssertionError("an oversized message was sent")
    assert log.kept_bytes == 0
    await log.replay(["r"], {"r": 0})
    assert wire.take() == []
