"""A SharedMemoryConnector's mappings of other producers' segments (the consumer side).

A producer's pool segments (its first and those it grew by) are mapped once and cached; a one-off
segment is not kept: the views' release finalizer holds its mapping, so it is unmapped (and its
memory returned) once they die and the producer unlinks it. A cached segment its producer has
unlinked (closed, reaped, or given back after idling) is dropped when another one is mapped and at
`health()`; live views keep their mapping through their finalizer.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.shm.segments import open_segment, shm_dir
from omni_mesh.connectors.shm.slots import Segment

#: Maps a segment by name for one get: its mapping, or None when it is gone.
Mapper = Callable[[str], "mmap.mmap | None"]


class Mappings:
    """Mapped segments by name; `own` is the producer side's own segments (never mapped twice)."""

    def __init__(self, own: dict[str, Segment], lock: threading.Lock) -> None:
        self._own = own
        self._lock = lock
        self._mapped: dict[str, mmap.mmap] = {}

    def get(self, name: str) -> mmap.mmap | None:
        """The cached mapping of `name` or our own segment of that name, if any (the fast path of
        every get: nothing is mapped and no message is built)."""
        mm = self._mapped.get(name)
        if mm is None:
            own = self._own.get(name)
            return None if own is None else own.mm
        return mm

    def add_locked(self, name: str, mm: mmap.mmap) -> None:
        self._mapped[name] = mm

    def drop_locked(self, name: str) -> None:
        self._mapped.pop(name, None)

    def map(self, name: str, where: str) -> mmap.mmap | None:
        """The mapping of segment `name`, made now if need be; None when it is gone. A name that is
        not ours or cannot be mapped is a ConnectorError naming `where` (the get)."""
        own = self._own.get(name)
        if own is not None:
            return own.mm
        mm = self._mapped.get(name)
        if mm is None:
            try:
                mm = open_segment(name)
            except FileNotFoundError:
                return None  # the producer is gone or the payload was reclaimed
            except (ValueError, OSError) as exc:
                raise ConnectorError(
                    f"SharedMemoryConnector: cannot map segment for {where}: {exc}"
                ) from None
            if "_x" not in name:  # a pool segment (first or grown): map it once
                with self._lock:
                    self.forget_unlinked_locked()
                    self._mapped[name] = mm
        return mm

    def mapper(self, where: str) -> Mapper:
        return lambda name: self._mapped.get(name) or self.map(name, where)

    def forget_unlinked_locked(self) -> None:
        for name in [name for name in self._mapped if not (shm_dir() / name).exists()]:
            del self._mapped[name]

    def clear_locked(self) -> None:
        self._mapped.clear()  # mappings with live views stay alive until those views die
