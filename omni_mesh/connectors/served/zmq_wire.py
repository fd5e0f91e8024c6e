"""ZmqConnector's wire: how a payload goes from the producer's pool to the consumer.

    GET key token [offer]  ->  OK key frame                      (small, or no mesh keys: in the reply)
                           ->  OK key P header part...           (the parts form: empty() outputs)
                           ->  OK key S description [P]          (sealed, on the bulk socket: served.seal)

    DONE key token ...     ->  OK key                            (they arrived: the producer lets go of them)

Without mesh keys, and for payloads under BULK_MIN_BYTES, the bytes ride in the side channel's reply
(CURVE-protected with keys). With keys, larger ones leave CURVE (one core, ~0.25 GB/s) for the bulk
socket: the offer, a fresh session key that CURVE carries secretly, seals them there. A consumer
decodes views over what it received (no copy). A mixin of `ServedConnector` and `PoolProducer`.

The producer keeps a payload it served until the consumer confirms it arrived (DONE, queued as the
get returns and sent off its path, several keys at once: `served.confirms`): an answer lost with a
connection that broke on its way is served again when the consumer asks again on a new one. A consumer
that never confirms (it died after its get) leaves the payload to its request's clean-up (an abort), or
to `ttl_s`; a retry of its work on another replica finds it.
"""

from __future__ import annotations

from typing import Any

from omni_mesh.codec import FrameError, decode, decode_parts
from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.pools.held import Gone, Held
from omni_mesh.connectors.served import seal
from omni_mesh.connectors.served.bulk_client import BulkError, pull
from omni_mesh.connectors.served.channel import OK, Reply, frame_text
from omni_mesh.connectors.served.confirms import Confirms
from omni_mesh.connectors.served.connector import GONE, NoAnswer
from omni_mesh.connectors.served.late_gets import LateGets

PARTS = b"P"  # the reply's third frame when the payload follows in the parts form
SEALED = b"S"  # ... when it follows on the bulk socket (the fourth: the transfer's description)
#: With mesh keys, payloads from this size on leave CURVE for the bulk socket (sealed, served.seal);
#: smaller ones ride in the CURVE reply, where one round trip beats the bulk socket's two.
BULK_MIN_BYTES = 256 * 1024


class ZmqWire:
    """Serving a GET (producer) and fetching a payload (consumer) (module docstring)."""

    def _serve(self, args: list[bytes]) -> Reply:
        """GET key token -> OK key frame (runs on the server thread)."""
        key, token = args[0], frame_text(args[1])
        # The offer is read before the payload is taken: a malformed one consumes nothing.
        session = (
            seal.Session.from_offer(bytes(args[2])) if len(args) > 2 and self._bulk is not None else None
        )
        try:
            held = self._held.claim(frame_text(key), token)  # kept until the consumer confirms (DONE)
        except Gone as exc:  # not (or no more) there: the consumer's get() answers None
            return [GONE, key, str(exc).encode()], None
        with self._lock:
            if held.released:  # cleaned up by a stage thread since we found it: its memory may be gone
                return [GONE, key, b"no payload under this key: cleaned up"], None
            self._in_flight += 1
            held.sends += 1
        if type(held.buffer) is list:
            frames = [PARTS, *held.buffer]  # the parts form: header, then each leaf from where it lies
        elif held.offset is None:
            frames = [memoryview(held.buffer)[: held.size]]
        else:
            frames = [self._region(held.offset, held.size)]

        def sent() -> None:
            with self._lock:
                self._in_flight -= 1
                held.sends -= 1
                free = held.released and not held.sends
            if free:  # let go of (confirmed, cleaned up, expired) while this reply was still sent from it
                self._free(held)

        if session is not None and held.size >= BULK_MIN_BYTES:  # CURVE brought the offer: a mesh member's
            form = frames[:1] if frames[0] is PARTS else []
            desc = self._bulk.offer(session, self._algorithm, frame_text(key), frames[len(form) :], sent)
            return [OK, key, SEALED, desc, *form], None
        return [OK, key, *frames], sent

    _confirms: Confirms  # the consumer's, made by the connector

    def _confirmed(self, args: list[bytes]) -> Reply:
        """DONE key token ...: the consumer has those payloads; they go (once no reply is sent from them)."""
        if not args or len(args) % 2:
            raise ValueError("DONE takes pairs of key and token")
        for key, token in zip(args[::2], args[1::2], strict=True):
            try:
                held = self._held.take(frame_text(key), frame_text(token))
            except Gone:  # already freed (cleaned up, expired) or confirmed before
                continue
            self._release(held)
        return [OK, args[0]], None

    def _release(self, held: Held) -> None:
        """Let go of `held`, or, while a reply is still sent from it, once the last one is."""
        with self._lock:
            held.released = True
            if held.sends:
                return
        self._free(held)

    def _free(self, held: Held) -> None:
        super()._release(held)  # type: ignore[misc]  # PoolProducer's: its slot and regions

    def cleanup(self, key: str) -> None:
        # Served payloads too (claimed until confirmed): a reply still sent from one frees it after.
        for held in self._held.pop_matching(key, retire_claimed=False):
            self._release(held)

    def _fetch(
        self, endpoint: str, key: str, metadata: dict, timeout_s: float, where: str, *, poll: bool = False
    ) -> tuple[Any, int]:
        """GET key token -> the frame, decoded as views over the received message; then DONE, queued."""
        if self._confirms.taken(endpoint, key):  # we have it already; the producer hears so soon
            raise Gone(f"{where}: no payload under this key: already consumed (by this consumer)")
        got = self._get_payload(endpoint, key, metadata, timeout_s, where, poll=poll)
        self._confirms.add(endpoint, key, str(metadata.get("token", "")))
        return got

    def _get_payload(
        self, endpoint: str, key: str, metadata: dict, timeout_s: float, where: str, *, poll: bool
    ) -> tuple[Any, int]:
        late = (
            f"no answer within {timeout_s:.3g}s; the producing process is gone, its host is unreachable, "
            "or the payload is still in transit (raise get_timeout_s)"
        )
        token = str(metadata.get("token", ""))
        parts = [b"GET", key.encode(), token.encode()]
        session = None
        if self._bulk_links is not None:  # a large payload may come sealed on the bulk socket
            # A poll's request still waiting for its answer is resumed, not sent again: its session
            # is the one its answer was sealed for. Every new request offers a fresh one.
            resumed = self._late.has(key, endpoint)
            session = self._late_sessions.pop(key, None) if resumed else None
            session = session or seal.Session.fresh()
            parts.append(session.offer())
        # The answer carries the payload: a poll that gives up keeps waiting for it in the background.
        try:
            reply = self._ask(
                endpoint, parts, timeout_s, where, late, late_key=key, keep_late=poll, again_if_broken=True
            )
        except NoAnswer:
            if poll and session is not None:
                self._keep_session(key, session)
            raise
        if len(reply) in (4, 5) and reply[2].bytes == SEALED:
            parts_form = len(reply) == 5 and reply[4].bytes == PARTS
            deadline_s = max(
                timeout_s, self.config.get_timeout_s
            )  # the payload left the producer: wait for it
            return self._pull(endpoint, key, session, reply[3].bytes, parts_form, deadline_s, where)
        parts_form = len(reply) >= 4 and reply[2].bytes == PARTS
        if len(reply) != 3 and not parts_form:
            self._error()
            raise ConnectorError(f"{where}: malformed reply")
        try:
            if parts_form:  # views over the received messages, each alive as long as its views
                buffers = [frame.buffer for frame in reply[4:]]
                obj = decode_parts(reply[3].bytes, buffers)
                return obj, len(reply[3].buffer) + sum(buffer.nbytes for buffer in buffers)
            frame = reply[2]
            obj = decode(frame.buffer)  # views over the received message; it lives as long as they do
        except FrameError as exc:
            self._error()
            raise ConnectorError(f"{where}: corrupt frame: {exc}") from None
        return obj, len(frame.buffer)

    def _keep_session(self, key: str, session: seal.Session) -> None:
        """The session of a poll left waiting (LateGets), for the get that resumes it."""
        sessions = self._late_sessions
        with self._lock:
            sessions[key] = session
            while len(sessions) > 2 * LateGets.MAX:  # those of requests LateGets dropped since
                del sessions[next(iter(sessions))]

    def _pull(
        self,
        endpoint: str,
        key: str,
        session: seal.Session | None,
        desc: bytes,
        parts_form: bool,
        timeout_s: float,
        where: str,
    ) -> tuple[Any, int]:
        """The payload the producer answered SEALED for: pulled from its bulk socket, opened, decoded."""
        if session is None or self._bulk_links is None:  # a late answer to an old request of the key
            self._error()
            raise ConnectorError(f"{where}: a sealed answer to a request that offered no session")
        try:
            buffers = pull(self._bulk_links, endpoint, session, key, desc, timeout_s)
        except BulkError as exc:
            self._error()
            raise ConnectorError(
                f"{where}: refused the payload's bytes: {exc}; nothing was returned"
            ) from None
        except Exception as exc:
            raise self._dealer_failure(
                exc, f"{where} (bulk socket)", "the payload's bytes stopped coming"
            ) from None
        size = sum(len(b) for b in buffers)
        try:
            obj = decode_parts(bytes(buffers[0]), buffers[1:]) if parts_form else decode(buffers[0])
        except FrameError as exc:
            self._error()
            raise ConnectorError(f"{where}: corrupt frame: {exc}") from None
        return obj, size
