"""A consumer's confirmations that payloads arrived, sent off the get's path.

A producer keeps a payload it served until its consumer confirms it arrived (`served.zmq_wire`): an
answer lost with a broken connection is served again to the get asked again. The confirmation costs
a round trip, so a get does not wait for it: it is queued here, and one thread sends what is queued,
one request per producer for all of its keys (`DONE key token key token ...`). A confirmation that
does not reach its producer (it is gone, or the network is) is logged: the payload then goes with its
request's clean-up, or after `ttl_s`. Until its confirmation has left, a payload counts as consumed
for this consumer (`taken`): a second get of it finds nothing, as it would once the producer let go.
"""

from __future__ import annotations

import collections
import logging
import threading

from omni_mesh.connectors.served.dealers import ChannelClosed, DealerPool

log = logging.getLogger("omni_mesh.connectors")

DONE = b"DONE"
CONFIRM_S = 1.0  # longest one confirmation request waits for its producer's answer
MAX_BATCH = 256  # keys per request: a few hundred bytes each, far below the side channel's request limit


class Confirms:
    """Queued confirmations, sent by a thread of their own (module docstring)."""

    def __init__(self, dealers: DealerPool, owner: str) -> None:
        self._dealers = dealers
        self._owner = owner
        self._queue: collections.deque[tuple[str, bytes, bytes]] = collections.deque()
        self._taken: set[tuple[str, bytes]] = set()  # (endpoint, key) queued or being sent
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add(self, endpoint: str, key: str, token: str) -> None:
        """Confirm, soon, that the payload `key` (put `token`) from `endpoint` arrived."""
        with self._lock:
            self._taken.add((endpoint, key.encode()))
        self._queue.append((endpoint, key.encode(), token.encode()))
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._stopped:
                    self._thread = threading.Thread(
                        target=self._run, name=f"{self._owner}-confirms", daemon=True
                    )
                    self._thread.start()
        self._wake.set()

    def taken(self, endpoint: str, key: str) -> bool:
        """Whether this consumer got `key` from `endpoint` and its confirmation has not left yet."""
        with self._lock:
            return (endpoint, key.encode()) in self._taken

    @property
    def pending(self) -> int:
        """Keys whose confirmation has not left yet (their producers still hold them)."""
        with self._lock:
            return len(self._taken)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            self._send_queued()

    def _send_queued(self) -> None:
        by_endpoint: dict[str, list[bytes]] = {}
        while self._queue:
            endpoint, key, token = self._queue.popleft()
            by_endpoint.setdefault(endpoint, []).extend((key, token))
        for endpoint, pairs in by_endpoint.items():
            for start in range(0, len(pairs), 2 * MAX_BATCH):
                batch = pairs[start : start + 2 * MAX_BATCH]
                try:
                    self._dealers.request(endpoint, [DONE, *batch], CONFIRM_S)
                except ChannelClosed:
                    return  # the connector is closing: its producers clean up or expire the rest
                except Exception as exc:  # the producer is gone or unreachable: it never frees them early
                    log.warning(
                        "%s: %d payload(s) from %s arrived, but the producer did not hear so (%s); it "
                        "keeps them until their clean-up or ttl_s",
                        self._owner,
                        len(batch) // 2,
                        endpoint,
                        exc,
                    )
                finally:
                    with self._lock:
                        self._taken.difference_update((endpoint, key) for key in batch[::2])

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to `timeout_s`), then stop; before the dealers close."""
        thread = self._thread
        with self._lock:
            self._stopped = True
        self._wake.set()
        if thread is not None:
            thread.join(timeout_s)
