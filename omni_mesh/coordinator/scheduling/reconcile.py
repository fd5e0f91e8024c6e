"""After a replica's control connection drops and comes back: what each side believes is in flight.

Messages in flight when the connection dropped are lost both ways (the ROUTER drops what it sends to
a peer with no connection; what the replica sent sits in a reset socket's buffer). The replica says
it is back (`Resync`); we send it `Reconcile`, the requests we believe it holds and, for each, the
seq of the next output we lack from it. That message travels after every work message sent before
it; the replica first sends again what it sent from those seqs on (stage.sent), then answers
(`Holding`), which is exact for those requests:

- one it does not hold (and sent no more of) lost its work, or its output or error on the way back
  beyond what the replica keeps: it is placed again (as for a replica that died), or, when the stage
  already streamed part of its output, fails now;
- one it holds whose stream lacks chunks gets them again from the first it lacks (the replica puts
  chunks in order and ignores ones it has);
- one it holds that we no longer run (its Abort was lost) is aborted.

An output arriving after a gap in its stage's seqs (the ones before it were lost) is dropped and the
replica asked at once (it sends them all again, in order); one arriving twice (sent again for two
questions) is dropped (`repeated`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from omni_mesh.control import Abort, Holding, Message, Output, Reconcile
from omni_mesh.coordinator.scheduling.dispatch import Dispatcher, RequestFailed, RequestState
from omni_mesh.coordinator.scheduling.registry import Replica

log = logging.getLogger("omni_mesh.coordinator")


class Reconciler:
    def __init__(self, dispatcher: Dispatcher, send: Callable[[Replica, Message], None]) -> None:
        self.dispatcher = dispatcher
        self.send = send
        self._asked: dict[str, tuple[int, set[str]]] = {}  # replica id -> (ask, the requests it named)
        self._asks = 0
        self.recovered = 0  # requests placed again, chunks sent again or aborts repeated

    def ask(self, replica: Replica) -> None:
        """The replica's connection came back: ask it which of our requests it holds, and for the
        outputs we lack from it."""
        asked = set(replica.inflight)
        self._asks += 1
        self._asked[replica.replica_id] = (self._asks, asked)
        seqs = {
            rid: state.next_seq.get(replica.stage, 0)
            for rid in asked
            if (state := self.dispatcher.requests.get(rid)) is not None
        }
        self.send(replica, Reconcile(replica.replica_id, sorted(asked), ask=self._asks, seqs=seqs))

    def settle(self, replica: Replica, message: Holding) -> None:
        """Its answer: place again what was lost, resend missing chunks, abort what ended here."""
        ask, asked = self._asked.get(replica.replica_id, (None, set()))
        if ask is None or message.ask != ask:
            return  # not an answer to our latest question (the connection dropped again meanwhile)
        del self._asked[replica.replica_id]
        held = {rid for rid in message.rids if isinstance(rid, str)}
        for rid in sorted(asked):
            if rid not in replica.inflight:
                continue  # its output or error came in meanwhile
            state = self.dispatcher.requests.get(rid)
            if state is None:
                replica.inflight.discard(rid)
            elif rid not in held:
                self._lost(state, replica)
            else:
                self._resend_chunks(state, replica, message.chunks.get(rid))
        for rid in held - asked:
            if rid not in self.dispatcher.requests:  # it ended, and the replica missed the Abort
                self.recovered += 1
                self.send(
                    replica,
                    Abort(rid, "request already ended (its abort was lost with a dropped connection)"),
                )

    def repeated(self, replica: Replica, message: Output) -> bool:
        """Whether `message` is an output of this replica's we already have: sent again for two
        questions (its stage may be done with the request: it must not read as a stranger's)."""
        state = self.dispatcher.requests.get(message.rid)
        return (
            state is not None
            and message.stage == replica.stage
            and replica.replica_id in state.touched
            and message.seq < state.next_seq.get(message.stage, 0)
        )

    def in_sequence(self, replica: Replica, message: Output) -> bool:
        """Whether `message` is the output of its stage due next. After a gap (outputs lost with a
        dropped connection) it is dropped, and the replica asked to send again from the first lost."""
        state = self.dispatcher.requests.get(message.rid)
        if state is None:
            return True  # the dispatcher tells the replica the request ended
        due = state.next_seq.get(message.stage, 0)
        if message.seq == due:
            state.next_seq[message.stage] = due + 1
            return True
        if replica.replica_id not in self._asked:  # asked already: its answer brings them all
            log.info(
                "request %s: output %d of stage %r arrived when %d was due (lost when replica %s's control "
                "connection dropped); asking for them again",
                message.rid,
                message.seq,
                message.stage,
                due,
                replica.replica_id,
                extra={"request_id": message.rid},
            )
            self.ask(replica)
        return False

    def _lost(self, state: RequestState, replica: Replica) -> None:
        stage, rid = replica.stage, state.rid
        replica.inflight.discard(rid)
        self.recovered += 1
        if stage in state.emitted or stage not in state.work:  # a stage that streamed part of its
            message = (  # output cannot start over
                f"stage {stage!r} replica {replica.replica_id!r}: the end of its streamed output was lost "
                "when its control connection dropped"
            )
            self.dispatcher.fail(state, RequestFailed(502, message, stage))
            return
        log.warning(
            "request %s: its work or result at stage %r was lost when replica %s's control connection "
            "dropped; placing it again",
            rid,
            stage,
            replica.replica_id,
            extra={"request_id": rid},
        )
        # Whatever the replica put for it (an output that never reached us) is released first: the
        # work may go to the same replica, under the same keys.
        self.send(replica, Abort(rid, "lost with a dropped control connection; placed again"))
        retried = stage in state.retried
        self.dispatcher._retry(state, stage)
        if not retried:  # a message lost on the wire is no replica's failure: the one retry stays
            state.retried.discard(stage)

    def _resend_chunks(self, state: RequestState, replica: Replica, expected: object) -> None:
        stage = replica.stage
        if not isinstance(expected, int) or state.stream_targets.get(stage) != replica.replica_id:
            return
        again = [chunk for chunk in state.sent_chunks.get(stage, []) if chunk.seq >= expected]
        if again:
            self.recovered += 1
            log.info(
                "request %s: sending %d chunk(s) again to replica %s",
                state.rid,
                len(again),
                replica.replica_id,
            )
        for chunk in again:
            self.send(replica, chunk)  # not recorded again in sent_chunks: it holds each one once
