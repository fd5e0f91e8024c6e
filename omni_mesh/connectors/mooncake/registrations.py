"""Memory a transfer engine reads from or writes into beyond its registered pool.

A producer sends large leaves and device tensors from their own memory: each is registered for the
payloads that send it. The engine refuses overlapping registrations, so memory that several payloads
send (one tensor put twice) is registered once and counted, and unregistered with its last payload.
A consumer registers receive buffers for one get. Memory inside the pool is registered already.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class Registrations:
    """The engine's registrations beyond `pool` (address, size); thread-safe. After `close()` nothing
    more is registered, and registrations still listed are dropped (the engine is going away)."""

    def __init__(self, engine: Any, in_pool: Callable[[int, int], bool]) -> None:
        self._engine = engine
        self._in_pool = in_pool  # (address, length) -> whether the pool's own registrations cover it
        self._shared: dict[int, list[int]] = {}  # address -> [length, payloads sending from it]
        self._lock = threading.Lock()

    def share(self, address: int, length: int, registered: list[int]) -> bool:
        """Make [address, address + length) readable by the engine for one more payload, noting the
        address in `registered`. False if the engine refused it or it overlaps registered memory of
        another length (then the caller copies it into the pool instead)."""
        if self._in_pool(address, length):
            return True  # a view over the pool (a get() result put again)
        with self._lock:
            if self._engine is None:
                return False
            entry = self._shared.get(address)
            if entry is not None:
                if entry[0] != length:
                    return False
                entry[1] += 1
            elif self._engine.register_memory(address, length) != 0:
                return False
            else:
                self._shared[address] = [length, 1]
        registered.append(address)
        return True

    def drop(self, registered: list[int]) -> None:
        """One payload is done with the memory in `registered` (emptied)."""
        with self._lock:
            for address in registered:
                entry = self._shared.get(address)
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._shared[address]
                    if self._engine is not None:
                        self._engine.unregister_memory(address)
        registered.clear()

    def receive(self, buffers: list[torch.Tensor]) -> list[int] | None:
        """Register one get's receive buffers; their addresses, or None (nothing left registered) if
        the engine refused one."""
        registered: list[int] = []
        for buffer in buffers:
            if not buffer.nbytes:
                continue
            with self._lock:
                refused = (
                    self._engine is None
                    or self._engine.register_memory(buffer.data_ptr(), buffer.nbytes) != 0
                )
            if refused:
                self.release(registered)
                return None
            registered.append(buffer.data_ptr())
        return registered

    def release(self, addresses: list[int]) -> None:
        """Unregister receive buffers."""
        with self._lock:
            if self._engine is not None:
                for address in addresses:
                    self._engine.unregister_memory(address)

    def close(self) -> None:
        with self._lock:
            engine, self._engine = self._engine, None
            shared, self._shared = self._shared, {}
        if engine is not None:
            for address in shared:
                engine.unregister_memory(address)

    def __len__(self) -> int:
        with self._lock:
            return len(self._shared)
