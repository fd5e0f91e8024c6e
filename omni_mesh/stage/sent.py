"""What a replica told the coordinator about each request, kept to tell it again after its control
connection dropped.

A message in flight when the connection dropped is lost (the replica's socket buffer goes with the
reset connection). After a reconnect the coordinator's `Reconcile` names, per request it waits on,
the seq of the next output it lacks from us (`seqs`); we send again everything from there (`replay`):
the streamed chunks, the end of a stream, a single output, or the error that ended the request. A
stage that already streamed part of its output cannot start over, so this is the only way its
request survives the drop.

A request's messages are kept until its deadline (past it the coordinator has ended it), its abort,
or a `Reconcile` that no longer names it (the coordinator has all of them); at most `limit_bytes` in
all: past it, the requests that ended here longest ago are forgotten first. Asked for messages it has
forgotten, the replica fails the request with an error that says so (502), rather than leaving it to
its deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from omni_mesh.control import Error, FailureKind, Output

#: The most bytes of sent messages (final outputs ride along) a replica keeps to send again: one
#: final output of the control plane's largest frame (control.MAX_FRAME_BYTES) always fits.
KEPT_BYTES = 64 * 1024 * 1024
_MESSAGE_BYTES = 512  # what a message adds beside its frames (metadata only), for the budget


@dataclass
class _Sent:
    deadline: float  # loop time: the request's deadline
    messages: list[tuple[int, Output | Error, tuple[Any, ...]]] | None = field(default_factory=list)
    count: int = 0  # outputs sent: the seq of the next one
    size: int = 0  # bytes kept for it
    ended: bool = False  # its last output or its error was sent


class SentLog:
    """The messages a replica sent about each request, in order (module docstring). Sending and
    sending again take turns (a lock), so a request's messages never overtake each other."""

    def __init__(
        self, stage: str, replica_id: str, send: Callable[..., Awaitable[None]], limit_bytes: int = KEPT_BYTES
    ) -> None:
        self.stage, self.replica_id = stage, replica_id
        self._send = send  # a control message (and frames) to the coordinator
        self.limit_bytes = limit_bytes
        self._sent: dict[str, _Sent] = {}  # in the order requests first sent something
        self._bytes = 0
        self._lock = asyncio.Lock()
        self.replayed = 0  # messages sent again

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    async def send(self, message: Output | Error, *extra: Any, deadline: float) -> None:
        """Send `message` (an output with its frames, or an error) and keep it until it cannot be lost."""
        async with self._lock:
            await self._send(message, *extra)  # packing may refuse it (MessageTooLarge): then not kept
            sent = self._sent.setdefault(message.rid, _Sent(deadline))
            seq = message.seq if isinstance(message, Output) else sent.count
            size = _MESSAGE_BYTES + sum(len(frame) for frame in extra)
            if sent.messages is not None:
                sent.messages.append((seq, message, extra))
                sent.size += size
                self._bytes += size
            if isinstance(message, Output):
                sent.count = seq + 1
            sent.ended = isinstance(message, Error) or message.last
            self._make_room(keep=message.rid)

    async def replay(
        self, rids: list[str], seqs: dict[str, int], mine: Callable[[str], bool] | None = None
    ) -> int:
        """Answer a `Reconcile`: send again, per request, the messages from the seq it lacks; forget
        the requests it does not name (the coordinator has every message of them), among those `mine`
        says are the asking coordinator's (with several coordinators). How many it sent."""
        named, before = set(rids), self.replayed
        async with self._lock:
            for rid in [rid for rid in self._sent if rid not in named and (mine is None or mine(rid))]:
                self.forget(rid)
            for rid, due in seqs.items():
                sent = self._sent.get(rid)
                if sent is None or not isinstance(due, int):
                    continue  # nothing sent for it yet (the Holding says whether it is held)
                if sent.messages is None:
                    if due < sent.count or sent.ended:
                        self.replayed += 1
                        await self._send(self._forgotten(rid, due))
                    continue
                for seq, message, extra in sent.messages:
                    if seq >= due:
                        self.replayed += 1
                        await self._send(message, *extra)
        return self.replayed - before

    def kept(self) -> set[str]:
        """The requests it keeps messages of."""
        return set(self._sent)

    def forget(self, rid: str) -> None:
        """Let go of what was kept for `rid` (it was aborted, or the coordinator has all of it)."""
        sent = self._sent.pop(rid, None)
        if sent is not None:
            self._bytes -= sent.size

    def expire(self, now: float) -> None:
        """Let go of the requests past their deadline (loop time `now`): they have ended."""
        for rid in [rid for rid, sent in self._sent.items() if sent.deadline <= now]:
            self.forget(rid)

    def _make_room(self, keep: str) -> None:
        """Forget messages, the requests that ended here first and the oldest first, until the kept
        bytes are within the limit (never those of `keep`, the request just sent for)."""
        if self._bytes <= self.limit_bytes:
            return
        order = [rid for rid, sent in self._sent.items() if sent.ended] + [
            rid for rid, sent in self._sent.items() if not sent.ended
        ]
        for rid in order:
            if self._bytes <= self.limit_bytes:
                return
            sent = self._sent[rid]
            if rid == keep or sent.messages is None:
                continue
            self._bytes -= sent.size
            sent.messages, sent.size = None, 0

    def _forgotten(self, rid: str, due: int) -> Error:
        return Error(
            rid,
            self.stage,
            self.replica_id,
            f"stage {self.stage!r} replica {self.replica_id!r}: its output {due} was lost when its control "
            f"connection dropped, and is no longer kept to send again (over {self.limit_bytes} bytes kept)",
            FailureKind.OUTPUT_LOST,
        )
