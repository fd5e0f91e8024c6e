"""The bulk port's door: which connections may cost the producer a thread (`served.bulk_server`).

One thread (a selector) accepts every connection and reads each one's pull without blocking. Until a
connection sends a pull that claims an offered session with its proof, it is a *stranger*: it holds a
socket, never a thread, and strangers are few and short-lived:

- at most MAX_STRANGERS at once and MAX_STRANGERS_PER_SOURCE from one address; past either cap the
  oldest is closed to make room (an honest consumer sends its pull as it connects: it is the newest);
- each must send its whole pull within `stranger_wait_s` of being accepted;
- a pull already there when its connection is accepted is read at once (the consumer's usual case).

A connection whose pull proves its session is a *consumer's*: one of at most MAX_STREAMS worker threads
streams its transfer, then it waits here (no thread) up to `idle_s` for its next pull. Consumers'
connections are counted apart (MAX_LINKS): strangers never take their room. When consumers' are full,
the one idle longest is closed (its consumer opens another). Every socket is this thread's, except while
a worker streams on it; workers hand theirs back (`_back`), so the bookkeeping has one owner.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from queue import Empty, SimpleQueue
from typing import Any

log = logging.getLogger("omni_mesh.connectors")

MAX_STRANGERS = 64  # connections that have not proved themselves, held at once
MAX_STRANGERS_PER_SOURCE = 16  # ... from one address
MAX_LINKS = 256  # consumers' connections (streaming or idle between pulls)
MAX_STREAMS = 64  # transfers streamed at once (threads); more proven pulls wait for one
#: Connections accepted per turn of the loop: fewer than a source's cap, so a consumer accepted in one
#: turn has its pull read before the next turn's strangers could push it out.
ACCEPT_BATCH = 8
TICK_S = 0.5  # how often `tick` runs (the server expires transfers nobody pulled)


class _Link:
    """One connection: where it comes from, the pull read so far, and until when it may wait."""

    __slots__ = ("sock", "source", "pull", "got", "proven", "deadline")

    def __init__(self, sock: socket.socket, source: str, pull_bytes: int) -> None:
        self.sock, self.source = sock, source
        self.pull = bytearray(pull_bytes)
        self.got = 0
        self.proven = False
        self.deadline = 0.0


class BulkDoor:
    """The selector thread of a bulk port (module docstring). `claim(pull)` returns the transfer a
    pull proves (None: a stranger's or a replay), `stream(sock, transfer)` sends it (in a worker),
    `refuse(what)` counts a refused connection, `tick(now)` runs every TICK_S."""

    def __init__(
        self,
        listener: socket.socket,
        owner: str,
        pull_bytes: int,
        waits: tuple[float, float],
        claim: Callable[[bytes], Any],
        stream: Callable[[socket.socket, Any], None],
        refuse: Callable[[str], None],
        tick: Callable[[float], None],
    ) -> None:
        self._listener, self._owner, self._pull_bytes = listener, owner, pull_bytes
        self._stranger_wait_s, self._idle_s = waits
        self._claim, self._stream, self._refuse, self._tick = claim, stream, refuse, tick
        self._selector = selectors.DefaultSelector()
        self._strangers: dict[_Link, None] = {}  # oldest first (dicts keep insertion order)
        self._by_source: dict[str, list[_Link]] = {}  # the strangers of each address, oldest first
        self._idle: dict[_Link, None] = {}  # consumers' connections between pulls, longest idle first
        self._proven = 0  # consumers' connections: idle, streaming or waiting for a worker
        self._streaming: set[_Link] = set()  # handed to a worker (stop() shuts them to wake it)
        self._back: SimpleQueue[tuple[_Link, bool]] = SimpleQueue()  # from workers: (link, still good)
        self._lock = threading.Lock()  # _streaming, _stopping
        self._stopping = False
        self._waker, self._wakeup = socket.socketpair()
        self._waker.setblocking(False)
        self._workers = ThreadPoolExecutor(MAX_STREAMS, thread_name_prefix=f"{owner}-bulk-stream")
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"{owner}-bulk", daemon=True)

    def start(self) -> None:
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wakeup, selectors.EVENT_READ)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            streaming = list(self._streaming)
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)
        for link in streaming:  # wakes its worker out of a blocking send
            with contextlib.suppress(OSError):
                link.sock.shutdown(socket.SHUT_RDWR)
        self._workers.shutdown(wait=False)  # a queued transfer still runs, fails at once and is released

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._waker.send(b"w")

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        next_tick = time.monotonic()
        try:
            while not self._stopping:
                waits = [next(iter(held)).deadline for held in (self._strangers, self._idle) if held]
                wait = min([next_tick, *waits])  # the oldest of each is the first to run out
                for key, _ in self._selector.select(max(0.0, wait - time.monotonic())):
                    if key.data is not None:
                        self._read(key.data)
                    elif key.fileobj is self._listener:
                        self._accept()
                    else:
                        with contextlib.suppress(OSError):
                            self._wakeup.recv(4096)
                self._take_back()
                now = time.monotonic()
                self._expire(now)
                if now >= next_tick:
                    next_tick = now + TICK_S
                    self._tick(now)
        except BaseException as exc:  # surfaced by the owner's health()
            if not self._stopping:
                self.error = exc
                log.exception("%s: the bulk port's thread stopped", self._owner)
        finally:
            self._close_all()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the backlog waits for the next turn
                log.warning("%s: the bulk port could not accept: %s", self._owner, exc)
                return
            sock.setblocking(False)
            link = _Link(sock, str(address[0]), self._pull_bytes)
            if self._read(link):  # its pull is not all there yet: it waits as a stranger
                self._admit(link)

    def _admit(self, link: _Link) -> None:
        mine = self._by_source.get(link.source, [])
        if len(mine) >= MAX_STRANGERS_PER_SOURCE:
            self._drop(mine[0], f"a stranger from {link.source} (the oldest of {len(mine)} from there)")
        if len(self._strangers) >= MAX_STRANGERS:
            self._drop(next(iter(self._strangers)), f"a stranger (the oldest of {MAX_STRANGERS} at once)")
        link.deadline = time.monotonic() + self._stranger_wait_s
        self._strangers[link] = None
        self._by_source.setdefault(link.source, []).append(link)
        self._selector.register(link.sock, selectors.EVENT_READ, link)

    def _read(self, link: _Link) -> bool:
        """Read what has come of `link`'s pull; whether it is to wait for more."""
        try:
            n = link.sock.recv_into(memoryview(link.pull)[link.got :])
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:  # reset
            n = 0
        if n == 0:  # a consumer closing its idle connection is no stranger
            self._drop(link, None if link.proven and not link.got else self._unfinished(link))
            return False
        link.got += n
        if link.got < len(link.pull):
            return True
        self._pulled(link)
        return False

    def _pulled(self, link: _Link) -> None:
        self._forget(link)
        pull, link.got = bytes(link.pull), 0
        if not link.proven and self._proven >= MAX_LINKS:
            if not self._idle:
                self._drop(link, f"a consumer's connection past the {MAX_LINKS} served at once")
                return
            self._drop(next(iter(self._idle)), None)  # the one idle longest: its consumer opens another
        transfer = self._claim(pull)
        if transfer is None:
            self._drop(link, "a pull without a valid session proof (a stranger, or a replay)")
            return
        if not link.proven:
            link.proven = True
            self._proven += 1
        with self._lock:
            self._streaming.add(link)
        self._workers.submit(self._serve, link, transfer)

    def _serve(self, link: _Link, transfer: Any) -> None:
        """In a worker: one transfer, then the connection goes back to the door (or is closed)."""
        good = False
        try:
            link.sock.setblocking(True)
            self._stream(link.sock, transfer)
            good = True
        except OSError:  # the consumer went away or stalled: what it would have had is dropped
            pass
        except Exception:  # one transfer's failure must not stop the others: its consumer times out
            log.exception("%s: a transfer failed on the bulk socket; it is dropped", self._owner)
        finally:
            with self._lock:
                self._streaming.discard(link)
                stopping = self._stopping
                if not stopping:
                    self._back.put((link, good))
            if stopping:
                link.sock.close()
            else:
                self._wake()

    def _take_back(self) -> None:
        while True:
            try:
                link, good = self._back.get_nowait()
            except Empty:
                return
            if not good:
                self._drop(link, None)
                continue
            link.sock.setblocking(False)
            link.deadline = time.monotonic() + self._idle_s
            self._idle[link] = None  # a pull already there is read on the next turn
            self._selector.register(link.sock, selectors.EVENT_READ, link)

    def _expire(self, now: float) -> None:
        for held in (self._strangers, self._idle):
            while held and (link := next(iter(held))).deadline <= now:
                self._drop(link, None if link.proven and not link.got else self._unfinished(link))

    # ---------------------------------------------------------------- bookkeeping

    @staticmethod
    def _unfinished(link: _Link) -> str:
        return "a truncated pull" if link.got else "a connection that sent no pull"

    def _forget(self, link: _Link) -> None:
        """`link` out of the tables and the selector (it is about to stream, or to close)."""
        if self._strangers.pop(link, 0) is None:  # it was there (held with the value None)
            mine = self._by_source[link.source]
            mine.remove(link)
            if not mine:
                del self._by_source[link.source]
        self._idle.pop(link, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(link.sock)

    def _drop(self, link: _Link, refused: str | None) -> None:
        self._forget(link)
        link.sock.close()
        if link.proven:
            self._proven -= 1
        if refused is not None:
            self._refuse(refused)

    def _close_all(self) -> None:
        for link in [*self._strangers, *self._idle]:
            self._drop(link, None)
        with self._lock:  # links workers handed back before stop(): closed here
            while True:
                try:
                    link, _ = self._back.get_nowait()
                except Empty:
                    break
                link.sock.close()
        for sock in (self._listener, self._waker, self._wakeup):
            sock.close()
        self._selector.close()
