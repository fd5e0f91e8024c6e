"""The test session's one openYuanrong datasystem worker (tests/conftest.py's `datasystem_worker` fixture).

Starting a worker takes ~6-8 s and stopping one a few more, and an idle worker still burns about a
tenth of a core, so the modules that only need *a* worker share this one: it starts when the first
test calls `get()` and conftest stops it right after the last test that names the fixture (and runs
those modules one after another). Tests keep apart by their keys: each module writes under its own
`key_prefix` or keys and checks only those. `omni-mesh bench connector --start-worker` still starts
its own, and its test checks exactly that.
"""

from __future__ import annotations

import contextlib

from omni_mesh.local_services.datasystem_worker import Worker, running_worker


class SharedWorker:
    """A worker started on first use; a start that failed fails every later `get()` the same way."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._worker: Worker | None = None
        self._failure: Exception | None = None

    def get(self) -> Worker:
        if self._failure is not None:
            raise self._failure
        if self._worker is None:
            stack = contextlib.ExitStack()
            try:
                self._worker = stack.enter_context(running_worker())
            except Exception as exc:
                self._failure = exc
                raise
            self._stack = stack
        return self._worker

    @property
    def running(self) -> bool:
        return self._worker is not None

    def stop(self) -> None:
        """Stop the worker if one runs (a later `get()` would start another)."""
        stack, self._stack, self._worker = self._stack, None, None
        if stack is not None:
            stack.close()
