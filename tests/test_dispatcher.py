"""The coordinator's scheduler and control-message handling in one process: no sockets, no stages.

The dispatcher is a state machine driven by control messages; these tests feed it typed messages
(`omni_mesh.control`) as replicas would send them and read what it sends back through a recording
`send`. Covered here, with no process started: routing (chain, least loaded, queueing, several final
stages, draining replicas), retry (a lost replica, once, not after output, a stream replayed), fan-in
(plain and streamed inputs), streaming (relay, buffering), expiry (running and queued requests, late
outputs), stage errors and their statuses, and draining (released only once no request needs it). The coordinator's identity rules (a replica is its connection) are checked the same way, with
its socket replaced by the recorder.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omni_mesh import codec
from omni_mesh.control import (
    Abort,
    Chunk,
    Deregister,
    Drained,
    Error,
    FailureKind,
    Heartbeat,
    Message,
    Output,
    Register,
    Registered,
    Rejected,
    Work,
)
from omni_mesh.coordinator.scheduling import events as request_events
from omni_mesh.coordinator.scheduling.dispatch import Dispatcher, RequestFailed
from omni_mesh.coordinator.scheduling.registry import MIN_ROUTING_ID_BYTES, Registry, Replica
from omni_mesh.coordinator.scheduling.service import Coordinator
from omni_mesh.topology import Topology, parse_topology


def chain(*names: str, max_inflight: int = 1) -> Topology:
    stages = [{"stage_id": i, "name": n, "max_inflight": max_inflight} for i, n in enumerate(names)]
    for i in range(1, len(names)):
        stages[i]["engine_input_source"] = [i - 1]
    return parse_topology({"name": "t", "stages": stages})


def graph(edges: list[tuple[int, int]], names: list[str]) -> Topology:
    stages = [{"stage_id": i, "name": n} for i, n in enumerate(names)]
    return parse_topology({"name": "g", "stages": stages, "edges": [{"from": s, "to": d} for s, d in edges]})


class Mesh:
    """A Dispatcher over a Registry, with replicas registered by hand and a recording `send`."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.registry = Registry(topology)
        self.sent: list[tuple[str, Message]] = []
        self.failing: set[str] = set()  # replica ids whose sends raise
        self.fail_next_work = 0  # how many more work messages fail to send
        self.dispatcher = Dispatcher(topology, self.registry, self.send)

    def send(self, replica: Replica, message: Message) -> None:
        if replica.replica_id in self.failing or (isinstance(message, Work) and self.fail_next_work > 0):
            self.fail_next_work -= isinstance(message, Work)
            raise ValueError("cannot pack this message")
        self.sent.append((replica.replica_id, message))

    def add(self, stage: str, replica_id: str, max_inflight: int = 1) -> Replica:
        edges = {e.label: e.connector.name for e in self.topology.edges}
        message = Register(stage, replica_id, 1000 + len(self.registry.replicas), "host", max_inflight, edges)
        replica, _ = self.registry.register(message, routing_id(replica_id.encode()))
        return replica

    def take(self, kind: type[Message], replica_id: str | None = None) -> list[Message]:
        """The messages of `kind` sent so far (to `replica_id`), removed from the record."""
        taken = [(r, m) for r, m in self.sent if isinstance(m, kind) and replica_id in (None, r)]
        self.sent = [item for item in self.sent if item not in taken]
        return [m for _, m in taken]

    def work_for(self, replica_id: str) -> Work:
        work = self.take(Work, replica_id)
        assert len(work) == 1, work
        return work[0]

    def output(self, replica_id: str, work: Work, edges: dict, *, final: Any = None, seq: int = 0,
               last: bool = True, end: bool = False) -> None:
        replica = self.registry.replicas[replica_id]
        frame = bytes(codec.encode(final)) if final is not None else None
        message = Output(work.rid, work.stage, replica_id, edges, seq, last, end=end, final=frame is not None)
        self.dispatcher.on_output(replica, message, frame)


def item(key: str) -> dict:
    return {"key": key, "meta": {"m": key}}


async def test_a_request_flows_down_the_chain_and_completes() -> None:
    mesh = Mesh(chain("a", "b"))
    mesh.add("a", "a-0")
    mesh.add("b", "b-0")
    state = mesh.dispatcher.submit({"p": 1}, {"k": "v"}, 10.0, False)
    work = mesh.work_for("a-0")
    assert work.is_entry and work.inputs == {"p": 1} and work.params == {"k": "v"} and 9 < work.remaining_s <= 10
    mesh.output("a-0", work, {"b": item("x")})
    work_b = mesh.work_for("b-0")
    assert work_b.sources == {"a": [item("x")]} and not work_b.is_entry
    mesh.output("b-0", work_b, {}, final={"answer": 42})
    assert await state.future == {"answer": 42}
    assert not mesh.dispatcher.requests and mesh.dispatcher.completed == 1
    assert not mesh.registry.replicas["a-0"].inflight and not mesh.registry.replicas["b-0"].inflight


async def test_work_waits_in_the_queue_for_a_free_slot_and_goes_to_the_least_loaded() -> None:
    mesh = Mesh(chain("a"))
    mesh.add("a", "a-0")
    mesh.add("a", "a-1")
    states = [mesh.dispatcher.submit({}, {}, 10.0, False) for _ in range(3)]
    first = mesh.take(Work)
    assert len(first) == 2 and {w.rid for w in first} == {states[0].rid, states[1].rid}
    assert [rid for rid, _ in mesh.dispatcher.queues["a"]] == [states[2].rid]
    replica = next(r for r in mesh.registry.replicas.values() if first[0].rid in r.inflight)
    mesh.output(replica.replica_id, first[0], {}, final={"ok": 1})
    assert mesh.work_for(replica.replica_id).rid == states[2].rid  # the freed slot took the queued one
    assert not mesh.dispatcher.queues["a"]


async def test_ties_take_turns_within_each_stage_whatever_the_other_stages_pick() -> None:
    mesh = Mesh(chain("encoder", "thinker"))
    mesh.add("encoder", "encoder-0")
    mesh.add("encoder", "encoder-1")
    mesh.add("thinker", "thinker-0")
    picked = []
    for _ in range(4):  # each request's encoder pick, then its thinker's, every replica idle again between
        picked.append(mesh.registry.pick("encoder").replica_id)
        assert mesh.registry.pick("thinker").replica_id == "thinker-0"
    assert picked == ["encoder-0", "encoder-1", "encoder-0", "encoder-1"]


async def test_a_lost_replica_s_work_is_retried_once_then_fails_naming_the_stage() -> None:
    mesh = Mesh(chain("a"))
    a0, a1 = mesh.add("a", "a-0"), mesh.add("a", "a-1")
    state = mesh.dispatcher.submit({}, {}, 10.0, False)
    first = mesh.take(Work)[0]
    holder, other = (a0, a1) if state.rid in a0.inflight else (a1, a0)
    mesh.registry.remove(holder.replica_id)
    mesh.dispatcher.replica_lost(holder, "died (pid 1)")
    retried = mesh.work_for(other.replica_id)
    assert retried.rid == first.rid and retried.inputs == first.inputs
    mesh.registry.remove(other.replica_id)
    mesh.dispatcher.replica_lost(other, "died (pid 2)")
    with pytest.raises(RequestFailed) as failed:
        await state.future
    assert failed.value.status == 502 and "'a'" in failed.value.message and "died" in failed.value.message


async def test_no_retry_after_a_stage_emitted_output() -> None:
    mesh = Mesh(chain("a", "b"))
    mesh.add("a", "a-0")
    b0, _ = mesh.add("b", "b-0"), mesh.add("b", "b-1")
    state = mesh.dispatcher.submit({}, {}, 10.0, False)
    mesh.output("a-0", mesh.work_for("a-0"), {"b": item("x")})
    holder = next(r for r in mesh.registry.of_stage("b") if state.rid in r.inflight)
    mesh.output(holder.replica_id, mesh.take(Work)[0], {}, final={"part": 1}, last=False)  # a streamed chunk
    mesh.dispatcher.replica_lost(holder, "died")
    with pytest.raises(RequestFailed):
        await state.future
    assert b0 is not None


async def test_fan_in_waits_for_every_input_then_sends_one_work() -> None:
    mesh = Mesh(graph([(0, 1), (0, 2), (1, 3), (2, 3)], ["split", "left", "right", "join"]))
    for name in ("split", "left", "right", "join"):
        mesh.add(name, f"{name}-0")
    state = mesh.dispatcher.submit({}, {}, 10.0, False)
    mesh.output("split-0", mesh.work_for("split-0"), {"left": item("l"), "right": item("r")})
    mesh.output("left-0", mesh.work_for("left-0"), {"join": item("L")})
    assert not mesh.take(Work, "join-0"), "join started with one input missing"
    mesh.output("right-0", mesh.work_for("right-0"), {"join": item("R")})
    join = mesh.work_for("join-0")
    assert join.sources == {"left": [item("L")], "right": [item("R")]}
    mesh.output("join-0", join, {}, final=[1, 2])
    assert await state.future == [1, 2]


async def test_streamed_chunks_are_relayed_in_order_and_buffered_until_dispatch() -> None:
    mesh = Mesh(chain("talker", "code2wav"))
    mesh.add("talker", "talker-0")
    mesh.add("code2wav", "code2wav-0")
    state = mesh.dispatcher.submit({}, {}, 10.0, True)
    work = mesh.work_for("talker-0")
    for seq in range(3):
        mesh.output("talker-0", work, {"code2wav": item(f"c{seq}")}, seq=seq, last=False)
    mesh.output("talker-0", work, {}, seq=3, last=True, end=True)
    downstream = mesh.work_for("code2wav-0")
    assert downstream.stream_from == "talker"
    chunks = mesh.take(Chunk, "code2wav-0")
    assert [c.key for c in chunks] == ["c0", "c1", "c2", ""] and chunks[-1].end
    for seq in range(2):
        mesh.output("code2wav-0", downstream, {}, final={"audio": seq}, seq=seq, last=False)
    mesh.output("code2wav-0", downstream, {}, seq=2, last=True, end=True)
    events = []
    while not state.events.empty():
        events.append(state.events.get_nowait())
    assert events == [
        request_events.Chunk("code2wav", {"audio": 0}),
        request_events.Chunk("code2wav", {"audio": 1}),
        request_events.Done([{"audio": 0}, {"audio": 1}]),
    ]
    assert await state.future == [{"audio": 0}, {"audio": 1}]


async def test_the_deadline_fails_the_request_and_aborts_every_replica_it_touched() -> None:
    mesh = Mesh(chain("a", "b"))
    mesh.add("a", "a-0")
    mesh.add("b", "b-0")
    state = mesh.dispatcher.submit({}, {}, 0.05, False)
    mesh.output("a-0", mesh.work_for("a-0"), {"b": item("x")})
    await asyncio.sleep(0.08)
    mesh.dispatcher.expire()
    with pytest.raises(RequestFailed) as failed:
        await state.future
    assert failed.value.status == 504 and "'b'" in failed.value.message
    assert {m.rid for m in mesh.take(Abort, "a-0")} == {state.rid} == {m.rid for m in mesh.take(Abort, "b-0")}


async def test_a_failed_send_releases_the_slot_and_fails_only_that_request() -> None:
    mesh = Mesh(chain("a"))
    mesh.add("a", "a-0")
    mesh.failing.add("a-0")
    poisoned = mesh.dispatcher.submit({}, {}, 10.0, False)
    with pytest.raises(RequestFailed) as failed:
        await poisoned.future
    assert failed.value.status == 500 and "'a'" in failed.value.message
    assert not mesh.registry.replicas["a-0"].inflight, "the slot stayed taken"
    mesh.failing.clear()
    good = mesh.dispatcher.submit({}, {}, 10.0, False)
    mesh.output("a-0", mesh.work_for("a-0"), {}, final="fine")
    assert await good.future == "fine"


async def test_a_queued_request_whose_send_fails_does_not_take_the_queue_down() -> None:
    mesh = Mesh(chain("a"))
    mesh.add("a", "a-0")
    first = mesh.dispatcher.submit({}, {}, 10.0, False)
    queued = [mesh.dispatcher.submit({}, {}, 10.0, False) for _ in range(2)]
    work = mesh.work_for("a-0")
    mesh.fail_next_work = 1
    mesh.output("a-0", work, {}, final=1)  # frees the slot: the next queued send fails
    assert await first.future == 1
    with pytest.raises(RequestFailed):
        await queued[0].future
    mesh.output("a-0", mesh.work_for("a-0"), {}, final=2)
    assert await queued[1].future == 2


async def test_a_stage_error_fails_the_request_and_frees_the_slot() -> None:
    mesh = Mesh(chain("a"))
    replica = mesh.add("a", "a-0")
    state = mesh.dispatcher.submit({}, {}, 10.0, False)
    work = mesh.work_for("a-0")
    mesh.dispatcher.on_error(replica, Error(work.rid, "a", "a-0", "ValueError: boom", FailureKind.HANDLER_FAILED))
    with pytest.raises(RequestFailed) as failed:
        await state.future
    assert failed.value.status == 500 and "boom" in failed.value.message and not replica.inflight


async def test_holds_says_whether_a_running_request_touched_a_replica() -> None:
    mesh = Mesh(chain("a", "b"))
    mesh.add("a", "a-0")
    mesh.add("b", "b-0")
    state = mesh.dispatcher.submit({}, {}, 10.0, False)
    mesh.output("a-0", mesh.work_for("a-0"), {"b": item("x")})
    assert mesh.dispatcher.holds("a-0")  # b has not fetched a's output yet
    mesh.output("b-0", mesh.work_for("b-0"), {}, final=0)
    await state.future
    assert not mesh.dispatcher.holds("a-0")


async def test_a_request_with_several_final_stages_answers_with_each_by_name() -> None:
    mesh = Mesh(graph([(0, 1), (0, 2)], ["thinker", "text", "audio"]))
    for name in ("thinker", "text", "audio"):
        mesh.add(name, f"{name}-0")
    state = mesh.dispatcher.submit({}, {}, 10.0, False)
    mesh.output("thinker-0", mesh.work_for("thinker-0"), {"text": item("t"), "audio": item("a")})
    mesh.output("audio-0", mesh.work_for("audio-0"), {}, final="wav")
    assert not state.future.done(), "answered before every final stage finished"
    mesh.output("text-0", mesh.work_for("text-0"), {}, final="hello")
    assert await state.future == {"text": "hello", "audio": "wav"}


async def test_a_draining_replica_gets_no_new_work_and_a_queue_waits_for_a_live_one() -> None:
    mesh = Mesh(chain("a"))
    a0, a1 = mesh.add("a", "a-0"), mesh.add("a", "a-1")
    mesh.registry.heartbeat(a0, Heartbeat("a-0", 0, draining=True))
    states = [mesh.dispatcher.submit({}, {}, 10.0, False) for _ in range(2)]
    assert [w.rid for w in mesh.take(Work, "a-1")] == [states[0].rid]
    assert not mesh.take(Work, "a-0") and [rid for rid, _ in mesh.dispatcher.queues["a"]] == [states[1].rid]
    mesh.output("a-1", mesh.dispatcher.requests[states[0].rid].work["a"], {}, final=0)
    assert mesh.work_for("a-1").rid == states[1].rid and not mesh.take(Work, "a-0")
    assert a1.inflight == {states[1].rid} and not a0.inflight


async def test_a_retried_stream_receives_every_chunk_the_lost_replica_had() -> None:
    mesh = Mesh(chain("talker", "code2wav"))
    mesh.add("talker", "talker-0")
    c0, c1 = mesh.add("code2wav", "code2wav-0"), mesh.add("code2wav", "code2wav-1")
    state = mesh.dispatcher.submit({}, {}, 10.0, True)
    work = mesh.work_for("talker-0")
    for seq in range(2):
        mesh.output("talker-0", work, {"code2wav": item(f"c{seq}")}, seq=seq, last=False)
    holder, other = (c0, c1) if state.rid in c0.inflight else (c1, c0)
    assert [c.key for c in mesh.take(Chunk, holder.replica_id)] == ["c0", "c1"]
    mesh.take(Work, holder.replica_id)
    mesh.registry.remove(holder.replica_id)
    mesh.dispatcher.replica_lost(holder, "died (pid 7)")
    retried = mesh.work_for(other.replica_id)
    assert retried.stream_from == "talker"
    mesh.output("talker-0", work, {"code2wav": item("c2")}, seq=2, last=False)
    mesh.output("talker-0", work, {}, seq=3, last=True, end=True)
    chunks = mesh.take(Chunk, other.replica_id)
    assert [(c.key, c.seq) for c in chunks] == [("c0", 0), ("c1", 1), ("c2", 2), ("", 3)] and chunks[-1].end
    mesh.output(other.replica_id, retried, {}, final={"audio": 0}, seq=0, last=False)
    mesh.output(other.replica_id, retried, {}, seq=1, last=True, end=True)
    assert await state.future == [{"audio": 0}]


async def test_fan_in_of_a_streamed_input_gets_its_chunks_as_one_list() -> None:
    mesh = Mesh(graph([(0, 2), (1, 2)], ["talker", "vision", "mix"]))
    for name in ("talker", "vision", "mix"):
        mesh.add(name, f"{name}-0")
    state = mesh.dispatcher.submit({}, {}, 10.0, False)
    talker = mesh.work_for("talker-0")
    for seq in range(2):
        mesh.output("talker-0", talker, {"mix": item(f"t{seq}")}, seq=seq, last=False)
    mesh.output("talker-0", talker, {}, seq=2, last=True, end=True)
    assert not mesh.take(Work, "mix-0") and not mesh.take(Chunk), "a fan-in stage must not start on a partial stream"
    mesh.output("vision-0", mesh.work_for("vision-0"), {"mix": item("v")})
    mix = mesh.work_for("mix-0")
    assert mix.sources == {"talker": [item("t0"), item("t1")], "vision": [item("v")]}
    assert mix.streamed == ["talker"] and not mix.stream_from
    mesh.output("mix-0", mix, {}, final="mixed")
    assert await state.future == "mixed"


async def test_a_queued_request_past_its_deadline_leaves_the_queue_naming_where_it_waited() -> None:
    mesh = Mesh(chain("a"))
    mesh.add("a", "a-0")
    busy = mesh.dispatcher.submit({}, {}, 10.0, False)
    waiting = mesh.dispatcher.submit({}, {}, 0.05, False)
    await asyncio.sleep(0.08)
    mesh.dispatcher.expire()
    with pytest.raises(RequestFailed) as failed:
        await waiting.future
    assert failed.value.status == 504 and "waiting for a free replica" in failed.value.message
    assert failed.value.stage == "a" and not mesh.dispatcher.queues["a"]
    assert not mesh.take(Abort), "a request no replica saw needs no abort"
    mesh.output("a-0", mesh.work_for("a-0"), {}, final="done")
    assert await busy.future == "done" and not mesh.take(Work), "the expired request was dispatched after all"


@pytest.mark.parametrize(
    ("error", "status", "says"),
    [
        (Error("", "a", "a-0", "too slow", FailureKind.DEADLINE), 504, "deadline exceeded while at stage 'a'"),
        (Error("", "a", "a-0", "prompt is empty", FailureKind.INVALID_INPUT), 422, "stage 'a': prompt is empty"),
        (Error("", "a", "a-0", "bad frame", FailureKind.UNREADABLE_WORK), 502, "could not read its work"),
    ],
)
async def test_a_stage_error_maps_to_the_status_the_client_sees(error: Error, status: int, says: str) -> None:
    mesh = Mesh(chain("a"))
    replica = mesh.add("a", "a-0")
    state = mesh.dispatcher.submit({}, {}, 10.0, False)
    error.rid = mesh.work_for("a-0").rid
    mesh.dispatcher.on_error(replica, error)
    with pytest.raises(RequestFailed) as failed:
        await state.future
    assert failed.value.status == status and says in failed.value.message and not replica.inflight


async def test_output_for_a_request_that_already_ended_is_answered_with_an_abort() -> None:
    mesh = Mesh(chain("a"))
    mesh.add("a", "a-0")
    state = mesh.dispatcher.submit({}, {}, 0.01, False)
    work = mesh.work_for("a-0")
    await asyncio.sleep(0.03)
    mesh.dispatcher.expire()
    mesh.take(Abort)
    mesh.output("a-0", work, {}, final="late")
    (abort,) = mesh.take(Abort, "a-0")
    assert abort.rid == state.rid and mesh.dispatcher.completed == 0 and mesh.dispatcher.failed == 1


@pytest.mark.parametrize("bad", ["chunk", "frame"])
async def test_a_malformed_chunk_or_an_unreadable_output_fails_with_502_naming_the_stage(bad: str) -> None:
    mesh = Mesh(chain("a", "b"))
    a0 = mesh.add("a", "a-0")
    mesh.add("b", "b-0")
    state = mesh.dispatcher.submit({}, {}, 10.0, bad == "chunk")
    work = mesh.work_for("a-0")
    if bad == "chunk":
        mesh.output("a-0", work, {"b": {"no": "key"}}, seq=0, last=False)
    else:
        message = Output(work.rid, "a", "a-0", {}, 0, True, final=True)
        mesh.dispatcher.on_output(a0, message, b"not a frame")
    with pytest.raises(RequestFailed) as failed:
        await state.future
    assert failed.value.status == 502 and failed.value.stage == "a" and "'a'" in failed.value.message
    assert {m.rid for m in mesh.take(Abort, "a-0")} == {state.rid}


async def test_a_full_queue_is_reported_for_new_requests_only() -> None:
    topology = parse_topology({"name": "q", "stages": [{"stage_id": 0, "name": "a", "max_queued": 1}]})
    mesh = Mesh(topology)
    mesh.add("a", "a-0")
    assert mesh.dispatcher.full_stage() is None
    mesh.dispatcher.submit({}, {}, 10.0, False)  # takes the slot
    assert mesh.dispatcher.full_stage() is None
    mesh.dispatcher.submit({}, {}, 10.0, False)  # waits
    assert mesh.dispatcher.full_stage() == ("a", 1)


async def test_max_queued_0_takes_a_free_slot_and_refuses_only_what_would_wait() -> None:
    topology = parse_topology({"name": "q", "stages": [{"stage_id": 0, "name": "a", "max_queued": 0}]})
    mesh = Mesh(topology)
    mesh.add("a", "a-0")
    assert mesh.dispatcher.full_stage() is None  # a free slot: "never queue" is not "never serve"
    mesh.dispatcher.submit({}, {}, 10.0, False)  # takes the slot
    assert mesh.dispatcher.full_stage() == ("a", 0)


async def test_requests_still_putting_large_inputs_count_as_waiting_beyond_the_free_slots() -> None:
    topology = parse_topology({"name": "q", "stages": [{"stage_id": 0, "name": "a", "max_queued": 1}]})
    mesh = Mesh(topology)
    mesh.add("a", "a-0")  # one free slot
    mesh.dispatcher.arriving["a"] = 1  # will take the slot
    assert mesh.dispatcher.full_stage() is None
    mesh.dispatcher.arriving["a"] = 2  # one takes the slot, one will wait: the queue's one place
    assert mesh.dispatcher.full_stage() == ("a", 1)


# ------------------------------------------------------------------ the coordinator's identity rules


def routing_id(name: bytes) -> bytes:
    """A connection's routing id as long as the coordinator requires (registry.MIN_ROUTING_ID_BYTES)."""
    return name.ljust(MIN_ROUTING_ID_BYTES, b".")


class Wire:
    """A Coordinator whose socket is replaced: what it would send, by connection identity."""

    def __init__(self, topology: Topology) -> None:
        self.coordinator = Coordinator(topology, "tcp://127.0.0.1:0", keys=None)
        self.out: list[tuple[bytes, Message]] = []
        self.coordinator._reply = lambda identity, message: self.out.append((identity, message))  # type: ignore[method-assign]

    def receive(self, identity: bytes, message: Message, frame: bytes | None = None) -> None:
        self.coordinator._handle(routing_id(identity), message, frame)

    def replies(self, identity: bytes) -> list[Message]:
        return [m for i, m in self.out if i == routing_id(identity)]

    def register(self, identity: bytes, stage: str, replica: str, pid: int = 1) -> None:
        edges = {e.label: e.connector.name for e in self.coordinator.topology.edges}
        self.receive(identity, Register(stage, replica, pid, "host", 1, edges))


async def test_a_replica_id_belongs_to_its_connection() -> None:
    wire = Wire(chain("a"))
    wire.register(b"real", "a", "a-0")
    assert isinstance(wire.replies(b"real")[-1], Registered)
    wire.register(b"thief", "a", "a-0", pid=2)
    refused = wire.replies(b"thief")[-1]
    assert isinstance(refused, Rejected) and refused.reregister and "live connection" in refused.error
    wire.receive(b"thief", Heartbeat("a-0", 0, draining=True))
    wire.receive(b"thief", Deregister("a-0"))
    replica = wire.coordinator.registry.replicas["a-0"]
    assert replica.identity == routing_id(b"real") and not replica.draining
    assert wire.coordinator.forged.count == 3


async def test_outputs_count_only_from_the_replica_that_was_sent_the_request() -> None:
    wire = Wire(chain("a", "b"))
    wire.register(b"A", "a", "a-0")
    wire.register(b"B", "b", "b-0")
    state = wire.coordinator.dispatcher.submit({}, {}, 10.0, False)
    forged = Output(state.rid, "b", "b-0", {}, 0, True, final=True)
    wire.receive(b"A", forged, bytes(codec.encode("forged")))  # another connection's name
    wire.receive(b"B", forged, bytes(codec.encode("forged")))  # b-0 was not sent this request
    assert not state.future.done()
    assert isinstance(wire.replies(b"B")[-1], Abort)
    wire.receive(b"A", Output(state.rid, "a", "a-0", {"b": item("x")}, 0, True))
    wire.receive(b"B", forged, bytes(codec.encode("true")))
    assert await state.future == "true"


async def test_messages_from_an_unknown_replica_ask_it_to_register_or_release() -> None:
    wire = Wire(chain("a"))
    wire.receive(b"ghost", Heartbeat("a-9", 0))
    wire.receive(b"ghost", Error("rid", "a", "a-9", "late", FailureKind.HANDLER_FAILED))
    reregister, release = wire.replies(b"ghost")
    assert isinstance(reregister, Rejected) and reregister.reregister
    assert isinstance(release, Abort) and release.rid == "rid"
    wire.receive(b"ghost", Drained("a-9"))  # only the coordinator sends this
    assert wire.coordinator.malformed == 1


async def test_a_draining_replica_is_released_only_once_no_running_request_needs_it() -> None:
    wire = Wire(chain("a", "b"))
    wire.register(b"A", "a", "a-0")
    wire.register(b"B", "b", "b-0")
    state = wire.coordinator.dispatcher.submit({}, {}, 10.0, False)
    wire.receive(b"A", Output(state.rid, "a", "a-0", {"b": item("x")}, 0, True))
    wire.receive(b"A", Heartbeat("a-0", 0, draining=True))
    assert not [m for m in wire.replies(b"A") if isinstance(m, Drained)], "released while b still needs a's output"
    assert wire.coordinator.registry.pick("a") is None  # and it takes no new work meanwhile
    wire.receive(b"B", Output(state.rid, "b", "b-0", {}, 0, True, final=True), bytes(codec.encode("ok")))
    assert await state.future == "ok"
    wire.receive(b"A", Heartbeat("a-0", 0, draining=True))
    assert isinstance(wire.replies(b"A")[-1], Drained)


async def test_a_connection_under_a_guessable_routing_id_cannot_register() -> None:
    """The control socket hands a routing id over to a new connection that presents it (a replica's
    dropped connection coming back): one ZeroMQ made (a zero byte and a counter) or a short one could be
    guessed and taken over, so a replica must bring its own random one."""
    wire = Wire(chain("a"))
    edges = {e.label: e.connector.name for e in wire.coordinator.topology.edges}
    for identity in (b"\x00\x00\x00\x00\x01", b"short-id"):
        wire.coordinator._handle(identity, Register("a", "a-0", 1, "host", 1, edges), None)
        refused = [m for i, m in wire.out if i == identity][-1]
        assert isinstance(refused, Rejected) and not refused.reregister, refused
        assert "'a-0'" in refused.error and "routing id" in refused.error
    assert "a-0" not in wire.coordinator.registry.replicas
