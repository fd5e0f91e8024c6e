"""The stage's side of its engine core (omni_mesh.engines.core): it starts the core process, hands it
requests and routes what comes back (a prompt's length, a round's tokens, the end) to each request's
handler on the event loop.

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
class CoreOutput:
    """A request's end, as the core sends it: the reply's ids, whether a stop ended it, the talker's inputs."""

    reply: list[int]
    stop_hit: bool
    talker: dict | None


def rebuilt(stage: str, kind: str, message: str) -> BaseException:
    """The error the core raised, as the stage's runtime reads it (core.failure_kind): InvalidInput is a
    4xx, a stopped prefill a cancel, anything else a failure of this stage naming the core's error type."""
    if kind == "invalid":
        return InvalidInput(message)
    if kind == "stopped":
        return PrefillStopped(message)
    return RuntimeError(f"stage {stage!r}'s engine core: {kind}: {message}")


class EngineCore:
    """One stage replica's engine core: start() it, then prompt(), join() and cancel() requests."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.rids = itertools.count()
        self.prompts: dict[int, asyncio.Future] = {}  # rid -> its prompt's length, until it comes
        self.running: dict[int, asyncio.Future] = {}  # rid -> its CoreOutput, until it comes
        self.pushes: dict[int, Callable[[list[int]], None]] = {}  # rid -> where its streamed tokens go
        self.latest: dict[str, Any] = {}  # the core's last counters
        self.facts: dict[str, Any] = {}
        self.gone: str | None = None  # why the core is no more
        self.process: asyncio.subprocess.Process | None = None
        self.tasks: list[asyncio.Task] = []

    async def start(self, spec: EngineSpec, *, fed_by_encoder: bool, feeds_stages: bool) -> dict[str, Any]:
        """Start the core and wait until its model is loaded; its facts (context, eos ids, KV budget).
        RuntimeError with the core's own reason when it cannot start."""
        self.directory = tempfile.mkdtemp(prefix="omni-mesh-core-")  # mode 0700: this user's alone
        atexit.register(shutil.rmtree, self.directory, True)  # the replica's exit leaves no sockets behind
        self.context = zmq.asyncio.Context()
        # Nothing to wait for at exit (the core dies with the replica): no linger, or collecting the
        # context at the replica's exit would block on its sockets.
        self.context.setsockopt(zmq.LINGER, 0)
        self.events = self.context.socket(zmq.PULL)
        self.events.bind(f"ipc://{self.directory}/events")
        self.requests = self.context.socket(zmq.PUSH)
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
        self.facts = rest[0]
        self._dispatch(events[1:])
        self.tasks = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._watch())]
        log.info("stage %s: engine core pid %d ready", self.stage, self.process.pid)
        return self.facts

    async def prompt(self, inputs: Any, use_audio_in_video: bool | None) -> tuple[int, int]:
        """(rid, the prompt's tokens): the core made the request's prompt ready (media encoded there) and
        keeps it for join(); a request that then does not start must be forget()-ten."""
        if self.gone is not None:
            raise RuntimeError(self.gone)
        rid = next(self.rids)
        future = asyncio.get_running_loop().create_future()
        self.prompts[rid] = future
        self._send(["prompt", rid, bytes(encode(inputs)), use_audio_in_video])
        try:
            return rid, await future
        finally:
            if self.prompts.pop(rid, None) is not None and not future.done():
                future.cancel()  # cancelled while the core prepared it: its answer is forgotten (_receive)

    def join(self, rid: int, sampling: Sampling, *, kv_tokens: int, push: Callable[[list[int]], None] | None,
             interval: int) -> asyncio.Future:
        """The prompted request into the running batch; the Future of its CoreOutput. `push`: gets its tokens
        as they are made (`interval` at a time), None: the client reads no stream."""
        future = asyncio.get_running_loop().create_future()
        if self.gone is not None:
            future.set_exception(RuntimeError(self.gone))
            return future
        self.running[rid] = future
        if push is not None:
            self.pushes[rid] = push
        self._send(["start", rid, dataclasses.asdict(sampling), push is not None, interval, kv_tokens])
        return future

    def cancel(self, rid: int) -> None:
        """Stop the request (its prefill within a piece, its row before the next step); its Future still ends."""
        if rid in self.running:
            self._send(["cancel", rid])

    def forget(self, rid: int) -> None:
        """A prompted request that will not start (refused before it did): the core lets its prompt go."""
        self._send(["forget", rid])

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
            elif kind == "prompted":
                self._settle_prompt(rest[0], rest[1], None)
            elif kind == "done":
                rid, reply, stop_hit, talker = rest
                try:
                    inputs = None if talker is None else decode(talker, copy=True)
                except Exception as exc:  # noqa: BLE001 - this request's output, framed wrong
                    self._settle(rid, RuntimeError(f"stage {self.stage!r}: the talker's inputs from its engine core: {exc}"))
                    continue
                self._settle(rid, CoreOutput(reply, stop_hit, inputs))
            elif kind == "failed":
                rid, error = rest[0], rebuilt(self.stage, rest[1], rest[2])
                if rid in self.prompts:
                    self._settle_prompt(rid, None, error)
                else:
                    self._settle(rid, error)

    def _settle_prompt(self, rid: int, tokens: int | None, error: BaseException | None) -> None:
        future = self.prompts.get(rid)
        if future is None or future.done():  # its request was cancelled meanwhile
            if error is None:
                self.forget(rid)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(tokens)

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
        log.error("%s: failing %d request(s) and stopping the replica", self.gone, len(self.prompts) + len(self.running))
        for future in [*self.prompts.values(), *self.running.values()]:
            if not future.done():
                future.set_exception(RuntimeError(self.gone))
        self.prompts.clear()
        self.running.clear()
        self._let_go()
        os.kill(os.getpid(), signal.SIGTERM)

    def _let_go(self) -> None:
        """The sockets closed and the directory removed (the core is gone or going)."""
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self.context.destroy(linger=0)
        shutil.rmtree(self.directory, ignore_errors=True)
