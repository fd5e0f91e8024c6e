"""The stage's side of its engine core (omni_mesh.engines.core): it starts the core process, hands it
requests and routes what comes back (a round's tokens, a request's end) to each request's handler on
the event loop.

The sockets are ZeroMQ ipc endpoints in a fresh directory of mode 0700: no other user can reach them.
If the core process dies, every request waiting on it fails with what happened, and the replica drains
and exits (SIGTERM to itself) so that its launcher starts a new one: a stage without its core is no stage.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from omni_mesh.children import PARENT_PID_ENV
from omni_mesh.codec.decode import decode
from omni_mesh.codec.encode import encode
from omni_mesh.engines.prefill import PrefillStopped
from omni_mesh.engines.settings import EngineSpec, Sampling
from omni_mesh.errors import InvalidInput

log = logging.getLogger("omni_mesh.engines")


@dataclass
class ThinkerEnd:
    """A thinker request's end, wherever it ran (the core sends it; the in-process paths build it)."""

    reply: list[int]
    stopped: bool  # a stop string, a stop token or the model's eos ended it
    prompt_tokens: int
    max_tokens: int  # as engine.max_model_len left it
    talker: dict | None  # the talker's inputs, where a stage reads them


def rebuilt(stage: str, kind: str, message: str) -> BaseException:
    """The error the core raised, as the stage's runtime reads it (core.failure_kind): InvalidInput is a
    4xx, a stopped prefill a cancel, anything else a failure of this stage naming the core's error type."""
    if kind == "invalid":
        return InvalidInput(message)
    if kind == "stopped":
        return PrefillStopped(message)
    return RuntimeError(f"stage {stage!r}'s engine core: {kind}: {message}")


class EngineCore:
    """One stage replica's engine core: start() it, then submit() and cancel() requests."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.rids = itertools.count()
        self.running: dict[int, asyncio.Future] = {}  # rid -> its ThinkerEnd, until it comes
        self.pushes: dict[int, Callable[[list[int]], None]] = {}  # rid -> where its streamed tokens go
        self.latest: dict[str, Any] = {}  # the core's last counters
        self.gone: str | None = None  # why the core is no more
        self.process: asyncio.subprocess.Process | None = None
        self.tasks: list[asyncio.Task] = []

    async def start(self, spec: EngineSpec, *, fed_by_encoder: bool, feeds_stages: bool) -> None:
        """Start the core and wait until its model is loaded; RuntimeError with the core's own reason when
        it cannot start."""
        self.directory = tempfile.mkdtemp(prefix="omni-mesh-core-")  # mode 0700: this user's alone
        atexit.register(shutil.rmtree, self.directory, True)  # the replica's exit leaves no sockets behind
        # The process's context, which lives until exit: a context of our own, collected at the replica's
        # exit in one cycle with its sockets, could be finalized first and wait forever for them to close.
        context = zmq.asyncio.Context.instance()
        self.events = context.socket(zmq.PULL)
        self.requests = context.socket(zmq.PUSH)
        for socket in (self.events, self.requests):
            socket.setsockopt(zmq.LINGER, 0)  # nothing to deliver once the replica goes: the core goes with it
        self.events.bind(f"ipc://{self.directory}/events")
        self.requests.bind(f"ipc://{self.directory}/requests")
        argv = ["--stage", self.stage, "--spec", json.dumps(dataclasses.asdict(spec)),
                "--inbox", f"ipc://{self.directory}/requests", "--outbox", f"ipc://{self.directory}/events"]
        argv += ["--fed-by-encoder"] * fed_by_encoder + ["--feeds-stages"] * feeds_stages
        # Spawned from the event loop's thread, which lives as long as the replica: the core's death
        # signal follows the thread that started it.
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "omni_mesh.engines.core", *argv, env={**os.environ, PARENT_PID_ENV: str(os.getpid())},
        )
        first = asyncio.ensure_future(self.events.recv())
        exited = asyncio.ensure_future(self.process.wait())
        await asyncio.wait([first, exited], return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            first.cancel()
            raise RuntimeError(f"stage {self.stage!r}: its engine core exited with status {exited.result()} while "
                               "loading the model (its log above says why)")
        exited.cancel()
        events = self._unpack(first.result())
        kind, *rest = events[0]
        if kind != "ready":
            raise RuntimeError(f"stage {self.stage!r}: its engine core could not start: {rest[1]}: {rest[2]}")
        self._dispatch(events[1:])
        self.tasks = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._watch())]
        log.info("stage %s: engine core pid %d ready", self.stage, self.process.pid)

    def submit(self, inputs: Any, use_audio_in_video: bool | None, sampling: Sampling, *,
               push: Callable[[list[int]], None] | None, interval: int) -> tuple[int, asyncio.Future]:
        """(rid, the Future of its ThinkerEnd): the core makes the request's prompt ready, checks it (an
        InvalidInput through the Future, before any generation) and runs it in its batch. `push` gets its
        tokens as they are made (`interval` at a time); None: the client reads no stream."""
        rid = next(self.rids)
        future = asyncio.get_running_loop().create_future()
        if self.gone is not None:
            future.set_exception(RuntimeError(self.gone))
            return rid, future
        self.running[rid] = future
        if push is not None:
            self.pushes[rid] = push
        self._send(["submit", rid, bytes(encode(inputs)), use_audio_in_video, dataclasses.asdict(sampling),
                    push is not None, interval])
        return rid, future

    def cancel(self, rid: int) -> None:
        """Stop the request (its prefill within a piece, its row before the next step); its Future still ends."""
        if rid in self.running:
            self._send(["cancel", rid])

    def counters(self) -> dict[str, Any]:
        return dict(self.latest)

    def _send(self, message: list[Any]) -> None:
        if self.gone is None:
            self.requests.send(msgpack.packb(message, use_bin_type=True), copy=False)

    @staticmethod
    def _unpack(message: bytes) -> list[list[Any]]:
        return msgpack.unpackb(message, raw=False, use_list=True, strict_map_key=True)

    async def _receive(self) -> None:
        while True:
            message = await self.events.recv()
            try:
                self._dispatch(self._unpack(message))
            except Exception:  # noqa: BLE001 - one bad message must not leave every later request waiting
                log.exception("stage %s: a message from its engine core could not be read", self.stage)

    def _dispatch(self, events: list[list[Any]]) -> None:
        for kind, *rest in events:
            if kind == "tokens":
                push = self.pushes.get(rest[0])
                if push is not None:
                    push(rest[1])
            elif kind == "counters":
                self.latest = rest[0]
            elif kind == "done":
                rid, reply, stopped, prompt_tokens, max_tokens, talker = rest
                try:
                    inputs = None if talker is None else decode(talker)
                except Exception as exc:  # noqa: BLE001 - this request's output, framed wrong
                    self._settle(rid, RuntimeError(f"stage {self.stage!r}: the talker's inputs from its engine core: {exc}"))
                    continue
                self._settle(rid, ThinkerEnd(reply, stopped, prompt_tokens, max_tokens, inputs))
            elif kind == "failed":
                self._settle(rest[0], rebuilt(self.stage, rest[1], rest[2]))

    def _settle(self, rid: int, outcome: Any) -> None:
        self.pushes.pop(rid, None)
        future = self.running.pop(rid, None)
        if future is None or future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    async def _watch(self) -> None:
        """The core's exit: every waiting request fails with it, and the replica stops (its launcher restarts it)."""
        assert self.process is not None
        code = await self.process.wait()
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        self.gone = f"stage {self.stage!r}: its engine core (pid {self.process.pid}) {how}"
        log.error("%s: failing %d request(s) and stopping the replica", self.gone, len(self.running))
        for future in self.running.values():
            if not future.done():
                future.set_exception(RuntimeError(self.gone))
        self.running.clear()
        self.pushes.clear()
        self._let_go()
        os.kill(os.getpid(), signal.SIGTERM)

    def _let_go(self) -> None:
        """The sockets closed and the directory removed (the core is gone or going)."""
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self.events.close(linger=0)
        self.requests.close(linger=0)
        shutil.rmtree(self.directory, ignore_errors=True)
