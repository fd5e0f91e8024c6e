"""The engine core: a batched thinker's model, its prompts' preparation and its running batch in a process
of their own, beside the stage's event loop (as vLLM's EngineCore beside its API server).

Why a process: the batch's forward passes and the stage's per-token work (detokenizing, framing each
chunk, sending it on) are both Python, and in one process they take turns on one GIL, so every token
the loop handles is a token the batch did not compute. Here the batch runs on a core of its own and
the stage's loop on another.

The stage (omni_mesh.engines.core_client) talks to it over two ZeroMQ ipc sockets in a directory only
this user can open: requests in on one, events out on the other. Each message is msgpack (no pickle);
a request's inputs and the talker's inputs go as omni-mesh frames (omni_mesh.codec) inside it.

In:  ["submit", rid, inputs frame, use_audio_in_video, sampling, stream, interval]: the prompt made ready
     here (media through the towers), checked (a 4xx before any generation), into the running batch;
     ["cancel", rid]. The core ends with its replica (its parent-death signal).
Out: a list of events per message, in order: ["ready"], ["tokens", rid, [ids]] (a client that streams),
     ["done", rid, reply ids, stopped, prompt tokens, max tokens, talker frame or None],
     ["failed", rid, kind, message], ["counters", {...}].
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgpack
import zmq

from omni_mesh.codec.decode import decode
from omni_mesh.codec.encode import encode
from omni_mesh.engines.batching import Batcher
from omni_mesh.engines.bridge import every, ignore
from omni_mesh.engines.kv_budget import checked_sampling, stage_budget
from omni_mesh.engines.prefill import PrefillStopped
from omni_mesh.engines.settings import Sampling, parse_engine
from omni_mesh.engines.stops import StopWatch
from omni_mesh.errors import InvalidInput

log = logging.getLogger("omni_mesh.engines")

COUNTERS_EVERY_S = 0.25  # a running batch's counters go out at most this often (and when it empties)


def failure_kind(exc: BaseException) -> str:
    """How the stage rebuilds an error raised here (core_client.rebuilt): the request's fault, a stop, or ours."""
    if isinstance(exc, InvalidInput):
        return "invalid"
    if isinstance(exc, PrefillStopped):
        return "stopped"
    return type(exc).__name__


def sampling_of(wire: dict[str, Any]) -> Sampling:
    """A Sampling from its msgpack form (tuples came as lists)."""
    values = dict(wire)
    values["stop"] = tuple(values.get("stop") or ())
    values["stop_token_ids"] = tuple(values.get("stop_token_ids") or ())
    values["logit_bias"] = tuple((int(t), float(b)) for t, b in values.get("logit_bias") or ())
    return Sampling(**values)


class Events:
    """Events for the stage, kept in order and sent as one message by flush(): the batch thread flushes
    once a round (a step's tokens for every row in one message), other threads at once."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self.lock = threading.Lock()  # the socket and the list: the batch thread, the prompt thread, the main one
        self.pending: list[list[Any]] = []

    def put(self, event: list[Any]) -> None:
        with self.lock:
            self.pending.append(event)

    def flush(self, *events: list[Any]) -> None:
        with self.lock:
            self.pending.extend(events)
            if self.pending:
                self.socket.send(msgpack.packb(self.pending, use_bin_type=True), copy=False)
                self.pending = []


class Core:
    """The model, the running batch and the requests from their submit to their end."""

    def __init__(self, spec: Any, stage: str, *, fed_by_encoder: bool, feeds_stages: bool, events: Events) -> None:
        from omni_mesh.engines.models import open_model

        self.spec, self.stage, self.feeds_stages, self.events = spec, stage, feeds_stages, events
        self.encodes = not fed_by_encoder  # its towers encode requests' media: their cache's counters
        self.model = open_model(spec)
        self.thinker = self.model.load("thinker", towers=not fed_by_encoder)
        self.eos = frozenset(int(t) for t in self.model.eos_token_ids(self.thinker))
        self.budget = stage_budget(spec, self.thinker, stage)
        engine = self.model.batch_engine(self.thinker, "thinker", for_talker=feeds_stages)
        self.batcher = Batcher(stage, engine, spec.max_batch, self.budget, after_step=self._after_round)
        self.prompter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{stage}-prompt")
        self.cancelled: dict[int, threading.Event] = {}  # rid -> its cancel flag, until it ends
        self.counted_at = 0.0

    def handle(self, message: list[Any]) -> None:
        """One message from the stage."""
        kind, *rest = message
        if kind == "submit":
            self.cancelled[rest[0]] = threading.Event()  # before its prompt is ready: a cancel may come first
            self.prompter.submit(self._submit, *rest)
        elif kind == "cancel":
            found = self.cancelled.get(rest[0])
            if found is not None:
                found.set()

    def _submit(self, rid: int, frame: bytes, in_video: bool | None, sampling_wire: dict, stream: bool,
                interval: int) -> None:
        """In the prompt thread: the request's prompt made ready and checked, then into the running batch."""
        cancelled = self.cancelled[rid]
        try:
            if cancelled.is_set():
                raise PrefillStopped("cancelled before its prompt was ready")
            ids, media = self.model.prompt(self.thinker, decode(frame), use_audio_in_video=in_video)
            tokens = int(ids.shape[-1])
            self.model.check_prompt(self.thinker, tokens)
            sampling = checked_sampling(self.spec, self.budget, sampling_of(sampling_wire), tokens)
            stops = StopWatch(self.model.tokenizer, sampling.stop, sampling.stop_token_ids)
            watch = stops.until(cancelled.is_set)
            begin = functools.partial(self.model.think_begin, self.thinker, ids, sampling, watch, media,
                                      for_talker=self.feeds_stages)
            push = every(lambda made: self.events.put(["tokens", rid, made]), interval) if stream else ignore
            future = self.batcher.submit(begin, push, watch, tokens + sampling.max_tokens)
        except Exception as exc:  # noqa: BLE001 - this request's failure: its inputs, its media, its size
            self.cancelled.pop(rid, None)
            self.events.flush(["failed", rid, failure_kind(exc), str(exc)])
            return
        future.add_done_callback(functools.partial(self._ended, rid, stops, tokens, sampling.max_tokens))

    def _ended(self, rid: int, stops: StopWatch, tokens: int, max_tokens: int, future: Future) -> None:
        """Its last event, after its tokens (in the batch thread, flushed with the round)."""
        self.cancelled.pop(rid, None)
        self.events.put(self._ending(rid, stops, tokens, max_tokens, future))
        if threading.current_thread() is not self.batcher.thread:  # it ended before this callback was added
            self.events.flush()

    def _ending(self, rid: int, stops: StopWatch, tokens: int, max_tokens: int, future: Future) -> list[Any]:
        exc = future.exception()
        if exc is not None:
            return ["failed", rid, failure_kind(exc), str(exc)]
        output = future.result()
        try:
            reply = [int(t) for t in self.model.reply_ids(output).tolist()]
            talker = bytes(encode(self.model.talker_payload(output))) if self.feeds_stages else None
        except Exception as exc:  # noqa: BLE001
            log.exception("stage %s: request %d's output could not be framed", self.stage, rid)
            return ["failed", rid, failure_kind(exc), str(exc)]
        stopped = stops.hit or (bool(reply) and reply[-1] in self.eos)
        return ["done", rid, reply, stopped, tokens, max_tokens, talker]

    def _after_round(self) -> None:
        """The batch thread's round is over: its events go out in one message, with the counters now and then."""
        now = time.monotonic()
        if now - self.counted_at >= COUNTERS_EVERY_S or not self.batcher.rows:
            self.counted_at = now
            self.events.put(["counters", self.counters()])
        self.events.flush()

    def counters(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.batcher.counters(), "tokens_total": self.batcher.tokens_total}
        cache = getattr(self.model, "towers_cache", None)
        if cache is not None and self.encodes:
            stats = cache.stats()
            out.update({"encoder_cache_hits_total": stats["hits"], "encoder_cache_misses_total": stats["misses"],
                        "encoder_cache_items": stats["items"]})
        return out


def serve(args: argparse.Namespace) -> None:
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(args.inbox)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 1000)
    outbox.connect(args.outbox)
    events = Events(outbox)
    try:
        spec = parse_engine(json.loads(args.spec), f"stage {args.stage!r}")
        core = Core(spec, args.stage, fed_by_encoder=args.fed_by_encoder, feeds_stages=args.feeds_stages, events=events)
    except Exception as exc:  # noqa: BLE001 - the stage says why its engine did not start (and exits)
        events.flush(["failed", -1, type(exc).__name__, str(exc)])
        sys.exit(1)
    events.flush(["ready"], ["counters", core.counters()])
    while True:
        core.handle(msgpack.unpackb(inbox.recv(), raw=False, use_list=True, strict_map_key=True))


def main(argv: list[str] | None = None) -> None:
    from omni_mesh.children import adopt_parent_death_signal

    adopt_parent_death_signal()  # a core outlives no stage
    parser = argparse.ArgumentParser(prog="python -m omni_mesh.engines.core")
    parser.add_argument("--stage", required=True)
    parser.add_argument("--spec", required=True, help="the stage's engine settings, JSON")
    parser.add_argument("--inbox", required=True)
    parser.add_argument("--outbox", required=True)
    parser.add_argument("--fed-by-encoder", action="store_true")
    parser.add_argument("--feeds-stages", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s core[{args.stage}] %(levelname)s %(message)s")
    serve(args)


if __name__ == "__main__":
    main()
