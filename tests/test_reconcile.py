"""Reconciling after a replica's control connection dropped (coordinator/scheduling/reconcile.py), in one process
with the dispatcher harness of test_dispatcher.py (no sockets: the end-to-end cases, with connections
cut by the kernel, are in test_control_reconnect.py). Each case is one way a message is lost."""

from __future__ import annotations

from test_dispatcher import Mesh, chain, item

from omni_mesh.control import Abort, Chunk, Holding, Output, Reconcile, Work
from omni_mesh.coordinator.scheduling.reconcile import Reconciler
from omni_mesh.coordinator.scheduling.request_state import RequestState


def _reconciler(mesh: Mesh) -> Reconciler:
    return Reconciler(mesh.dispatcher, mesh.send)


def _ask(mesh: Mesh, reconciler: Reconciler, replica_id: str) -> Reconcile:
    reconciler.ask(mesh.registry.replicas[replica_id])
    (question,) = mesh.take(Reconcile, replica_id)
    return question


def _streaming() -> tuple[Mesh, Reconciler, RequestState, Work]:
    """A chain a -> b, a request at a-0: (mesh, reconciler, the request, its work at a)."""
    mesh = Mesh(chain("a", "b"))
    mesh.add("a", "a-0")
    mesh.add("b", "b-0")
    reconciler = _reconciler(mesh)
    state = mesh.dispatcher.submit({}, {}, 10.0, False)
    return mesh, reconciler, state, mesh.work_for("a-0")


async def test_work_the_replica_does_not_hold_is_placed_again_and_its_leftovers_released() -> None:
    """Its work (or its output) was lost: the replica is told to let go of the request and the work is
    placed again, the same message; the request then completes."""
    mesh = Mesh(chain("a"))
    mesh.add("a", "a-0")
    reconciler = _reconciler(mesh)
    state = mesh.dispatcher.submit({"p": 1}, {}, 10.0, False)
    first = mesh.work_for("a-0")
    question = _ask(mesh, reconciler, "a-0")
    assert question.rids == [state.rid]
    reconciler.settle(mesh.registry.replicas["a-0"], Holding("a-0", [], ask=question.ask))
    assert [m.rid for m in mesh.take(Abort, "a-0")] == [state.rid]
    again = mesh.work_for("a-0")
    assert again.rid == first.rid and again.inputs == {"p": 1}
    mesh.output("a-0", again, {}, final={"ok": 1})
    assert await state.future == {"ok": 1}


async def test_work_placed_again_after_a_drop_keeps_its_retry_for_a_replica_that_dies() -> None:
    """Work lost with a dropped connection and placed again has not used up its one retry: when the
    replica it then went to dies, it is retried on another, not failed."""
    mesh = Mesh(chain("a"))
    mesh.add("a", "a-0")
    mesh.add("a", "a-1")
    reconciler = _reconciler(mesh)
    state = mesh.dispatcher.submit({"p": 1}, {}, 10.0, False)
    (placed,) = [r for r, m in mesh.sent if isinstance(m, Work)]
    mesh.take(Work)
    question = _ask(mesh, reconciler, placed)
    reconciler.settle(mesh.registry.replicas[placed], Holding(placed, [], ask=question.ask))
    (again,) = [r for r, m in mesh.sent if isinstance(m, Work)]
    mesh.take(Work)
    dead = mesh.registry.replicas[again]
    mesh.registry.remove(again)
    mesh.dispatcher.replica_lost(dead, "died (pid 1)")
    assert not state.future.done(), state.future.exception() if state.future.done() else None
    (survivor,) = [r for r, m in mesh.sent if isinstance(m, Work)]
    assert survivor != again
    mesh.output(survivor, mesh.work_for(survivor), {}, final={"ok": 1})
    assert await state.future == {"ok": 1}


async def test_an_answer_to_an_older_question_changes_nothing() -> None:
    """The connection dropped twice: the first answer may predate work sent since, so only the answer
    to the latest question counts, and work the replica holds is never placed twice."""
    mesh = Mesh(chain("a"))
    mesh.add("a", "a-0")
    reconciler = _reconciler(mesh)
    mesh.dispatcher.submit({}, {}, 10.0, False)
    mesh.work_for("a-0")
    older = _ask(mesh, reconciler, "a-0")
    newer = _ask(mesh, reconciler, "a-0")
    reconciler.settle(mesh.registry.replicas["a-0"], Holding("a-0", [], ask=older.ask))
    assert not mesh.take(Work) and not mesh.take(Abort)
    reconciler.settle(mesh.registry.replicas["a-0"], Holding("a-0", newer.rids, ask=newer.ask))
    assert not mesh.take(Work) and not mesh.take(Abort)


async def test_a_request_the_replica_holds_that_ended_is_aborted() -> None:
    """Its Abort was lost: the replica lists a request we no longer run, and is told again."""
    mesh = Mesh(chain("a"))
    mesh.add("a", "a-0")
    reconciler = _reconciler(mesh)
    question = _ask(mesh, reconciler, "a-0")
    reconciler.settle(mesh.registry.replicas["a-0"], Holding("a-0", ["gone"], ask=question.ask))
    assert [m.rid for m in mesh.take(Abort, "a-0")] == ["gone"]


async def test_a_stream_gets_the_chunks_it_lacks_again() -> None:
    """Chunks relayed during the drop were lost: those from the first it lacks are sent again."""
    mesh = Mesh(chain("a", "b"))
    mesh.add("a", "a-0")
    mesh.add("b", "b-0")
    reconciler = _reconciler(mesh)
    mesh.dispatcher.submit({}, {}, 10.0, False)
    work = mesh.work_for("a-0")
    for seq in range(3):
        mesh.output("a-0", work, {"b": item(f"k{seq}")}, seq=seq, last=False)
    assert mesh.work_for("b-0").stream_from == "a"
    assert [c.seq for c in mesh.take(Chunk, "b-0")] == [0, 1, 2]
    question = _ask(mesh, reconciler, "b-0")
    reconciler.settle(mesh.registry.replicas["b-0"], Holding("b-0", [work.rid], {work.rid: 1}, ask=question.ask))
    assert [c.seq for c in mesh.take(Chunk, "b-0")] == [1, 2]
    assert not mesh.take(Work) and not mesh.take(Abort)


async def test_a_stage_whose_streamed_output_lost_its_end_fails_at_once() -> None:
    """A stage that streamed part of its output cannot start over: the replica no longer holds the
    request and sent nothing more when asked (it kept none of it), so the request fails now, 502."""
    mesh, reconciler, state, work = _streaming()
    replica = mesh.registry.replicas["a-0"]
    assert reconciler.in_sequence(replica, Output(work.rid, "a", "a-0", {"b": item("k0")}, 0, False))
    mesh.output("a-0", work, {"b": item("k0")}, seq=0, last=False)
    question = _ask(mesh, reconciler, "a-0")
    assert question.seqs == {work.rid: 1}, "the question names the output it lacks"
    reconciler.settle(replica, Holding("a-0", [], ask=question.ask))
    assert state.future.done() and state.future.exception().status == 502
    assert "control connection dropped" in state.future.exception().message


async def test_outputs_after_a_gap_are_asked_for_again_and_a_second_copy_is_dropped() -> None:
    """Chunks 1 and 2 of a stream were lost with the connection: chunk 3 arrives after a gap. It is
    dropped and the replica asked at once for everything from 1; sent again, in order, they are taken,
    a copy of one we have (sent for a second question) is recognised, and the request completes."""
    mesh, reconciler, state, work = _streaming()
    replica = mesh.registry.replicas["a-0"]

    def arrives(seq: int, **more: bool) -> bool:
        last, end = more.get("last", False), more.get("end", False)
        message = Output(work.rid, "a", "a-0", {"b": item(f"k{seq}")}, seq, last, end=end)
        if reconciler.repeated(replica, message) or not reconciler.in_sequence(replica, message):
            return False
        mesh.dispatcher.on_output(replica, message, None)
        return True

    assert arrives(0)
    assert not arrives(3)
    (question,) = mesh.take(Reconcile, "a-0")
    assert question.rids == [work.rid] and question.seqs == {work.rid: 1}
    assert not arrives(4), "a second gap while asked already asks no more"
    assert not mesh.take(Reconcile)
    for seq in (1, 2, 3, 4):
        assert arrives(seq)
    assert not arrives(2), "a copy of an output we have"
    assert arrives(5, last=True, end=True)
    reconciler.settle(replica, Holding("a-0", [], ask=question.ask))
    assert not state.future.done() and not mesh.take(Abort), "nothing was lost: nothing placed again"
    stream = [c.seq for c in mesh.take(Chunk, "b-0")]
    assert stream == [0, 1, 2, 3, 4, 5]
