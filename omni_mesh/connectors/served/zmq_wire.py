"""ZmqConnector's wire: how a payload goes from the producer's pool to the consumer.

    GET key token [offer]  ->  OK key frame                      (small, or no mesh keys: in the reply)
                           ->  OK key P header part...           (the parts form: empty() outputs)
                           ->  OK key S description [P]          (sealed, on the bulk socket: served.seal)

    DONE key token ...     ->  OK key                            (they arrived: the producer lets go of them)

Without mesh keys, and for payloads under BULK_MIN_BYTES, the bytes ride in the side channel's reply
(CURVE-protected with keys). With keys, larger ones leave CURVE (one core, ~0.25 GB/s) for the bulk
socket: the offer, a fresh session key that CURVE carries secretly, seals them there. A consumer
decodes views over what it received (no copy). Both ends import this module: the producer answers
with a `Serving` (over its `HeldTable` and `ProducerPool`), the consumer reads answers with `read_reply`.

The producer keeps a payload it served until the consumer confirms it arrived (DONE, sent off the
get's path: `served.confirms`, which says why); one never confirmed (its consumer died after its get)
goes with its request's clean-up or after `ttl_s`, and a retry of the work on another replica finds it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from omni_mesh.codec import FrameError, decode, decode_parts
from omni_mesh.connectors.pools.held import Gone, Held, HeldTable
from omni_mesh.connectors.served import seal
from omni_mesh.connectors.served.bulk_server import BulkServer
from omni_mesh.connectors.served.channel import OK, Reply, frame_text
from omni_mesh.connectors.served.connector import GONE
from omni_mesh.connectors.served.producer_pool import ProducerPool

if TYPE_CHECKING:
    import zmq

PARTS = b"P"  # the reply's third frame when the payload follows in the parts form
SEALED = b"S"  # ... when it follows on the bulk socket (the fourth: the transfer's description)
#: With mesh keys, payloads from this size on leave CURVE for the bulk socket (sealed, served.seal);
#: smaller ones ride in the CURVE reply, where one round trip beats the bulk socket's two.
BULK_MIN_BYTES = 256 * 1024


class Serving:
    """The producer's answers to GET and DONE, and when the payloads they are sent from go.

    A payload is let go of once its consumer confirmed it (or it was cleaned up or expired), and
    freed in `pool` once no reply is sent from it any more. `bulk` is the bulk socket (mesh keys
    only) that large payloads leave on, sealed with `algorithm`.
    """

    def __init__(self, held: HeldTable, pool: ProducerPool, algorithm: str) -> None:
        self._held = held
        self._pool = pool
        self._algorithm = algorithm
        self.bulk: BulkServer | None = None
        self.in_flight = 0  # replies being sent
        self._lock = threading.Lock()  # a payload's `sends` and `released`, and `in_flight`

    def serve(self, args: list[bytes]) -> Reply:
        """GET key token [offer] -> OK key frame (runs on the server thread)."""
        key, token = args[0], frame_text(args[1])
        # The offer is read before the payload is taken: a malformed one consumes nothing.
        session = seal.Session.from_offer(bytes(args[2])) if len(args) > 2 and self.bulk is not None else None
        try:
            held = self._held.claim(frame_text(key), token)  # kept until the consumer confirms (DONE)
        except Gone as exc:  # not (or no more) there: the consumer's get() answers None
            return [GONE, key, str(exc).encode()], None
        with self._lock:
            if held.released:  # cleaned up by a stage thread since we found it: its memory may be gone
                return [GONE, key, b"no payload under this key: cleaned up"], None
            self.in_flight += 1
            held.sends += 1
        if type(held.buffer) is list:
            frames = [PARTS, *held.buffer]  # the parts form: header, then each leaf from where it lies
        elif held.offset is None:
            frames = [memoryview(held.buffer)[: held.size]]
        else:
            frames = [self._pool.region(held.offset, held.size)]

        def sent() -> None:
            with self._lock:
                self.in_flight -= 1
                held.sends -= 1
                free = held.released and not held.sends
            if free:  # let go of (confirmed, cleaned up, expired) while this reply was still sent from it
                self._pool.release(held)

        if session is not None and held.size >= BULK_MIN_BYTES:  # CURVE brought the offer: a mesh member's
            form = frames[:1] if frames[0] is PARTS else []
            desc = self.bulk.offer(session, self._algorithm, frame_text(key), frames[len(form) :], sent)
            return [OK, key, SEALED, desc, *form], None
        return [OK, key, *frames], sent

    def confirmed(self, args: list[bytes]) -> Reply:
        """DONE key token ...: the consumer has those payloads; they go (once no reply is sent from them)."""
        if not args or len(args) % 2:
            raise ValueError("DONE takes pairs of key and token")
        for key, token in zip(args[::2], args[1::2], strict=True):
            try:
                held = self._held.take(frame_text(key), frame_text(token))
            except Gone:  # already freed (cleaned up, expired) or confirmed before
                continue
            self.release(held)
        return [OK, args[0]], None

    def release(self, held: Held) -> None:
        """Let go of `held`, or, while a reply is still sent from it, once the last one is."""
        with self._lock:
            held.released = True
            if held.sends:
                return
        self._pool.release(held)


def request(key: str, token: str, session: seal.Session | None) -> list[bytes]:
    """The consumer's GET (with an offer of `session` where a large payload may come sealed)."""
    parts = [b"GET", key.encode(), token.encode()]
    if session is not None:
        parts.append(session.offer())
    return parts


def sealed(reply: list[zmq.Frame]) -> tuple[bytes, bool] | None:
    """(the transfer's description, whether in the parts form) of an answer SEALED, else None."""
    if len(reply) in (4, 5) and reply[2].bytes == SEALED:
        return reply[3].bytes, len(reply) == 5 and reply[4].bytes == PARTS
    return None


def read_reply(reply: list[zmq.Frame]) -> tuple[Any, int]:
    """(object, size) of an answer carrying the payload: views over the received messages, each
    alive as long as its views. FrameError for a malformed answer or a corrupt frame."""
    if len(reply) >= 4 and reply[2].bytes == PARTS:
        buffers = [frame.buffer for frame in reply[4:]]
        return decode_parts(reply[3].bytes, buffers), len(reply[3].buffer) + sum(b.nbytes for b in buffers)
    if len(reply) != 3:
        raise FrameError("malformed reply")
    return decode(reply[2].buffer), len(reply[2].buffer)


def read_pulled(buffers: list[Any], parts_form: bool) -> tuple[Any, int]:
    """(object, size) of a payload pulled from the bulk socket (FrameError for a corrupt frame)."""
    obj = decode_parts(bytes(buffers[0]), buffers[1:]) if parts_form else decode(buffers[0])
    return obj, sum(len(b) for b in buffers)
