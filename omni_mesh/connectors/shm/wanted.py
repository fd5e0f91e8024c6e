"""Whether some process on this host gets SharedMemoryConnector payloads by key alone.

A tiny payload travels whole in its metadata; a copy in the pool serves only gets by key alone
(vllm-omni's chunk adapter and KV receive path). That copy, and its release by the consumer, cost
about a third of a tiny put + get, so a producer makes it only once a get by key is seen on the host:
such a get sets the WANTED byte in the header of every pool it scans, and from then on that pool's
tiny puts keep a copy (shm_tiny, which also copies in the tiny payloads put shortly before).

A producer learns of the flag from this process's watcher thread, which looks every TICK_S while a
producer still waits for it and stops when none does, or at once from a get by key in its own process
(`tick`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, Protocol

WANTED_AT = 32  # a byte of the pool header after shm_cells.GEOMETRY: 1 once a get by key scanned the pool
TICK_S = 0.05
log = logging.getLogger("omni_mesh.connectors")


class Waiter(Protocol):
    def notice_wanted(self) -> bool:
        """Act on the flag if it is set; True once this producer needs no more watching."""


# Held only around the set itself. The garbage collector may run finalizers (a connector's __del__
# closes it) at any allocation made under it: nothing a finalizer reaches may take it.
_lock = threading.Lock()
_waiting: weakref.WeakSet[Waiter] = weakref.WeakSet()
_thread: threading.Thread | None = None


def mark(mm: Any) -> None:
    """Flag a pool (its first segment) as one whose tiny payloads are wanted by key."""
    if len(mm) > WANTED_AT and not mm[WANTED_AT]:
        mm[WANTED_AT] = 1


def marked(mm: Any) -> bool:
    return len(mm) > WANTED_AT and mm[WANTED_AT] != 0


def watch(waiter: Waiter) -> None:
    """Let `waiter` notice the flag within TICK_S, until its `notice_wanted` says it is done."""
    global _thread
    with _lock:
        _waiting.add(waiter)
        if _thread is None:
            _thread = threading.Thread(target=_run, name="omni-mesh-shm-wanted", daemon=True)
            _thread.start()


def tick() -> None:
    """Every waiting producer of this process looks at its flag now."""
    with _lock:
        waiting = list(_waiting)
    for waiter in waiting:
        try:
            done = waiter.notice_wanted()
        except Exception:  # a connector closed under its copy-in, say: never the watcher's end
            log.exception("SharedMemoryConnector: copying recent tiny payloads in for gets by key failed")
            done = True
        if done:
            with _lock:
                _waiting.discard(waiter)


def _run() -> None:
    global _thread
    while True:
        time.sleep(TICK_S)
        with _lock:
            if not _waiting:
                _thread = None
                return
        tick()


def _after_fork_in_child() -> None:
    """The watcher thread does not survive a fork: the child starts its own when it needs one."""
    global _thread, _lock
    _lock = threading.Lock()
    _thread = None
    _waiting.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
