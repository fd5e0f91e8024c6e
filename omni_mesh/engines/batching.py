"""Continuous batching in a stage's model thread: up to `max_batch` requests decode together, one
forward pass per step for all of them; a request joins the running batch between two steps (its prompt
prefilled on its own, in pieces) and leaves it the step it ends (a stop, its max_tokens, a cancel).

Model-agnostic: an `Engine` prefills one request into a `Row`, steps a list of rows one token each and
builds a finished row's output; this module owns the thread, the queue, the stops and the counters.
Each request keeps its own sampling (processors, seed), stops and limits: nothing is shared between
rows but the forward pass.

Why not transformers' continuous batching (`generation/continuous_batching/`, 5.25): its requests are
lists of token ids (`add_request(input_ids=...)`), its positions are 1-D (`range(past, past + q)`),
and it hands back tokens, not hidden states. The thinkers need 3-D rope positions and a prefill that
may carry media embeddings; the talker reads the thinker's hidden states of every step. A loop of our
own over the model's forward, with each request's KV cache stacked into a left-padded batch (restacked
only when a request joins or leaves), serves all of that with the model's own code.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni_mesh.engines.kv_budget import KvBudget, fits

log = logging.getLogger("omni_mesh.engines")


@dataclass
class Job:
    """One request handed to the batch: `begin()` (in the model thread) prefills it into a Row."""

    begin: Callable[[], Any]
    push: Callable[[int], None]
    stopped: Callable[[], bool]  # the request was cancelled (client gone, deadline) or hit a stop
    future: Future = field(default_factory=Future)
    kv_tokens: int = 0  # the KV cache it may come to hold (omni_mesh.engines.kv_budget)


@dataclass
class Row:
    """A request in the running batch: what the engine keeps for it (`state`), its reply so far and
    the next token to feed."""

    job: Job
    state: Any
    max_tokens: int
    eos: frozenset[int]
    reply: list[int] = field(default_factory=list)
    saw: Callable[[int], None] | None = None  # a StopWatch's: shown each token before the stop check

    def take(self, token: int) -> bool:
        """The row's new token; True when the row ends with it."""
        self.reply.append(token)
        if self.saw is not None:
            self.saw(token)
        self.job.push(token)
        return token in self.eos or len(self.reply) >= self.max_tokens or self.job.stopped()


class Engine(Protocol):
    def join(self, job: Job, state: Any) -> tuple[Row, int | None]:
        """The request's row, its prompt prefilled (`state`: what `job.begin()` returned), and its first
        token; None: the first token comes with the next step (the prompt's last token is one of its rows)."""

    def step(self, rows: list[Row]) -> list[int]:
        """One token for each row (its last token fed)."""

    def finish(self, row: Row) -> Any:
        """The finished row's output (the handler's result)."""


class Batcher:
    """One stage's running batch: `submit()` from any thread; a thread of its own steps the batch."""

    def __init__(self, name: str, engine: Engine, max_batch: int, budget: KvBudget | None = None,
                 after_step: Callable[[], None] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"stage {name!r}: max_batch must be >= 1, got {max_batch}")
        self.name = name
        self.engine = engine
        self.max_batch = max_batch
        self.queue: collections.deque[Job] = collections.deque()
        self.rows: list[Row] = []
        self.wake = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None
        # what counters() reports (omni_mesh.stage.counters: per stage in /metrics and /v1/stages)
        self.tokens_total = 0
        self.steps_total = 0
        self.rows_stepped_total = 0
        self.budget = budget  # None: rows join while there are fewer than max_batch
        self.kv_used = (0, 0)  # (tokens, bytes) the batch's KV cache holds, padding included: measured each step
        self.kv_peak = 0  # the most tokens it held since the replica started (sizing a budget: how close it came)
        # called in the batch thread after each round (admit, step): an engine core sends a round's tokens at once
        self.after_step = after_step

    def submit(
        self, begin: Callable[[], Any], push: Callable[[int], None], stopped: Callable[[], bool], kv_tokens: int = 0,
    ) -> Future:
        """Queue a request (reserving `kv_tokens` of the budget while it runs); its Future gets the engine's
        output (or the error that ended it)."""
        job = Job(begin, push, stopped, kv_tokens=kv_tokens)
        with self.wake:
            if self.closed:
                raise RuntimeError(f"stage {self.name!r}: its batch is closed")
            self.queue.append(job)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=f"{self.name}-batch", daemon=True)
                self.thread.start()
            self.wake.notify()
        return job.future

    def counters(self) -> dict[str, int | float]:
        return {
            "batch_running": len(self.rows),
            "batch_queued": len(self.queue),
            "batch_max": self.max_batch,
            "batch_steps_total": self.steps_total,
            "batch_rows_stepped_total": self.rows_stepped_total,  # / steps: the mean batch size
            **self.kv_counters(),
        }

    def kv_counters(self) -> dict[str, int]:
        """The KV cache's use (measured: padding included), what the running rows reserved, and the budget."""
        tokens, size = self.kv_used
        out = {"kv_cache_used_tokens": tokens, "kv_cache_used_bytes": size,
               "kv_cache_reserved_tokens": sum(row.job.kv_tokens for row in list(self.rows)),
               "kv_cache_peak_used_tokens": self.kv_peak}
        if self.budget is not None:
            out.update({"kv_cache_budget_tokens": self.budget.tokens, "kv_cache_budget_bytes": self.budget.bytes})
        return out

    def close(self) -> None:
        with self.wake:
            self.closed = True
            self.wake.notify()

    def _run(self) -> None:
        import torch

        with torch.inference_mode():  # per thread (the handler's no_grad does not reach this one); no autograd bookkeeping per op
            while True:
                with self.wake:
                    while not self.closed and not self.queue and not self.rows:
                        self.wake.wait()
                    if self.closed:
                        break
                self._admit()
                self._drop_stopped()
                if self.rows:
                    self._step()
                self._measure()
                if self.after_step is not None:
                    self.after_step()
        for row in self.rows:
            _fail(row.job, RuntimeError(f"stage {self.name!r}: closed"))

    def _admit(self) -> None:
        """Queued requests into the batch while there is room: each prefilled alone, its first token made."""
        while len(self.rows) < self.max_batch:
            with self.wake:
                if not self.queue or not self._fits(self.queue[0]):
                    break  # first come, first served: a large request is not passed by smaller ones
                job = self.queue.popleft()
            if job.stopped():  # cancelled while it waited: it never takes a place
                _fail(job, _cancelled())
                continue
            try:
                row, token = self.engine.join(job, job.begin())
            except BaseException as exc:  # noqa: BLE001 - this request's failure (bad input, stopped prefill)
                _fail(job, exc)
                continue
            if token is None:
                self.rows.append(row)
                continue
            self.tokens_total += 1
            if row.take(token):
                self._end(row)
            else:
                self.rows.append(row)

    def _fits(self, job: Job) -> bool:
        """Whether `job` may join the running batch within the KV budget (omni_mesh.engines.kv_budget)."""
        if self.budget is None:
            return True
        return fits([row.job.kv_tokens for row in self.rows], job.kv_tokens, self.budget.tokens)

    def _measure(self) -> None:
        """What the batch's KV cache holds now, for kv_counters() (read between steps, in this thread); an
        empty batch lets its cache go (rows that ended in the same step leave it behind otherwise)."""
        if not self.rows and hasattr(self.engine, "release"):
            self.engine.release()
        usage = getattr(self.engine, "kv_usage", None)
        self.kv_used = usage(self.rows) if usage is not None else (0, 0)
        self.kv_peak = max(self.kv_peak, self.kv_used[0])

    def _drop_stopped(self) -> None:
        """Rows whose request was cancelled between steps leave before the next forward; requests
        cancelled while they wait leave the queue (their handler waits for that)."""
        with self.wake:
            gone = [job for job in self.queue if job.stopped()]
            for job in gone:
                self.queue.remove(job)
        for job in gone:
            _fail(job, _cancelled())
        stopped = [row for row in self.rows if row.job.stopped()]
        for row in stopped:
            self.rows.remove(row)
            self._end(row)

    def _step(self) -> None:
        rows = list(self.rows)
        try:
            tokens = self.engine.step(rows)
        except BaseException as exc:  # noqa: BLE001 - the batch's forward failed: every row in it did
            log.exception("stage %s: a batched step of %d rows failed", self.name, len(rows))
            self.rows.clear()
            for row in rows:
                _fail(row.job, exc)
            return
        self.steps_total += 1
        self.rows_stepped_total += len(rows)
        self.tokens_total += len(rows)
        for row, token in zip(rows, tokens, strict=True):
            if row.take(token):
                self.rows.remove(row)
                self._end(row)

    def _end(self, row: Row) -> None:
        try:
            output = self.engine.finish(row)
        except BaseException as exc:  # noqa: BLE001
            _fail(row.job, exc)
            return
        if not row.job.future.done():
            row.job.future.set_result(output)


class Rate:
    """A count's rate per second between two reads at least `every` seconds apart (a heartbeat reads it)."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.last = (time.monotonic(), 0, 0.0)  # (when, the count then, the rate up to then)

    def __call__(self, count: int) -> float:
        now = time.monotonic()
        when, before, rate = self.last
        if now - when >= self.every:
            rate = (count - before) / (now - when)
            self.last = (now, count, rate)
        return round(rate, 1)


def _fail(job: Job, exc: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(exc)


def _cancelled() -> BaseException:
    from omni_mesh.engines.prefill import PrefillStopped

    return PrefillStopped("cancelled before it joined the batch")
