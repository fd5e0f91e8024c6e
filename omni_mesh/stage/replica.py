"""`StageReplica`: one replica's lifecycle (start, drain on SIGTERM/SIGINT, close) and the dispatch
of the coordinator's messages to the parts that handle them (`link`, `runner`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omni_mesh import control
from omni_mesh.connectors import OmniConnectorBase, cleanup_tokens, create_connector, creation_rank
from omni_mesh.control import (
    Abort,
    Chunk,
    Deregister,
    Drained,
    Error,
    FailureKind,
    Heartbeat,
    Holding,
    Reconcile,
    Register,
    Registered,
    Rejected,
    Resync,
    Work,
)
from omni_mesh.handlers import hooks_of
from omni_mesh.hostinfo import process_info
from omni_mesh.stage.counters import handler_counters
from omni_mesh.stage.link import ConnectorHealth, CoordinatorLink
from omni_mesh.stage.links import GONE_S, Links
from omni_mesh.stage.loading import default_replica_id
from omni_mesh.stage.runner import Runner
from omni_mesh.topology import StageSpec, Topology, load_handler

log = logging.getLogger("omni_mesh.stage")

#: A draining replica stays this long past the latest deadline of its requests: their answers (or
#: errors) go out, and downstream fetches what it put for them, before it exits.
DRAIN_MARGIN_S = 2.0


class StageReplica:
    def __init__(
        self,
        topology: Topology,
        stage: StageSpec,
        coordinator: str,
        replica_id: str | None = None,
        *,
        host: str | None = None,
        drain_grace_s: float = 30.0,
        health_file: str | None = None,
    ) -> None:
        self.topology = topology
        self.stage = stage
        self.coordinator = coordinator
        self.host = host or socket.gethostname()
        self.replica_id = replica_id or default_replica_id(stage.name, self.host)
        self.drain_grace_s = drain_grace_s
        self.health_file = Path(health_file) if health_file else None
        self.handler = load_handler(topology, stage)
        self.hooks = hooks_of(self.handler, f"stage {stage.name!r}")  # checked once, before any connector
        self.in_edges = {topology.stage(e.src).name: e for e in topology.inputs_of(stage.stage_id)}
        self.out_edges = {topology.stage(e.dst).name: e for e in topology.outputs_of(stage.stage_id)}
        self.is_final = any(s.stage_id == stage.stage_id for s in topology.final_stages)
        self.connectors: dict[str, OmniConnectorBase] = {}
        specs = {e.connector.ref: e.connector for e in [*self.in_edges.values(), *self.out_edges.values()]}
        for spec in sorted(specs.values(), key=lambda s: creation_rank(s.name)):  # the registry's load order
            self.connectors[spec.ref] = create_connector(spec.name, spec.extra)
        self.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"{stage.name}-io")
        self.health = ConnectorHealth(self.connectors, self.replica_id, f"{stage.name}-health")
        self.malformed = 0
        self.draining = False
        self.ready = False  # registered once: a failure before it is a failure to start
        self.last_deadline = 0.0  # loop time: the latest deadline of any request we took part in
        self._stopped = asyncio.Event()
        self.links = Links(coordinator, self.replica_id)  # one per coordinator (`--coordinator A,B`)
        self.max_inflight = max(1, stage.max_inflight)  # ours to keep: no coordinator overbooks us
        self.runner = Runner(
            stage.name,
            self.replica_id,
            self.handler,
            self.hooks,
            self.connectors,
            in_edges=self.in_edges,
            out_edges=self.out_edges,
            is_final=self.is_final,
            executor=self.executor,
            send=self.links.send,
            released=self._heartbeat,
            freed=self._slot_freed,
        )

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_drain)
        tasks = [asyncio.create_task(self.runner.sweep_loop())]
        for link in self.links.all:
            tasks += [
                asyncio.create_task(self._receive_loop(link)),
                asyncio.create_task(link.heartbeats(lambda link=link: self._heartbeat([link]))),
                asyncio.create_task(link.reconnects(lambda link=link: self._resync(link), lambda link=link: self._dropped(link))),
            ]
        try:
            producers = {self.connectors[e.connector.ref] for e in self.out_edges.values()}
            for connector in producers:
                await loop.run_in_executor(self.executor, connector.warm_up)
            # A model loads before the replica says it is ready, never in a request.
            log.debug("replica %s of stage %s warming its handler", self.replica_id, self.stage.name)
            await self.hooks.warm()
            # What warm() loaded (a model: transformers' modules, its parameters) lives as long as the
            # replica: frozen out of the cyclic collector as aio.run froze the imports, or each full
            # collection walks all of it, a stall of 100+ ms in every request under way (issue 40's p99).
            gc.collect()
            gc.freeze()
            if await self._register():  # False: told to stop before the coordinator answered
                self.ready = True
                log.info("replica %s of stage %s ready", self.replica_id, self.stage.name)
            await self._stopped.wait()
        finally:
            for task in tasks:
                task.cancel()
            for link in self.links.all:
                with contextlib.suppress(Exception):
                    await link.send(Deregister(self.replica_id))
                    await link.flushed()  # sends are queued (stage.outgoing): it leaves before the socket closes
            self.close()
            # A later signal has nothing left to drain; and the loop (uvloop's outlives its close) must not
            # keep this replica and its handler alive: the handler's idle threads end once it is collected.
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, _drained_already)

    def request_drain(self) -> None:
        if not self.draining:
            self.draining = True
            log.info(
                "replica %s draining: finishing %d in-flight request(s)",
                self.replica_id,
                len(self.runner.work),
            )
            asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        await self._heartbeat()  # tell the coordinator at once so no new work arrives
        loop = asyncio.get_running_loop()
        # Every request has a deadline: waiting for the latest one (and a moment for its answer to go
        # out) never cuts a request short, however long it runs; the grace bounds the wait for the
        # coordinator's `drained` when no request needs us (or none answers).
        deadline = max(loop.time() + self.drain_grace_s, self.last_deadline + DRAIN_MARGIN_S)
        # Finishing our own work is not enough: what we put may still wait for a downstream replica
        # to fetch it, and exiting takes it along. The coordinator answers our (draining) heartbeats
        # with `drained` once every request we took part in has ended (and tells every replica so
        # when it shuts down). Unregistered, we hold nothing anybody waits for.
        while loop.time() < deadline and (
            self.runner.work or any(not link.drained for link in self.links.registered())
        ):
            await asyncio.sleep(0.05)
        self._stopped.set()

    def close(self) -> None:
        ingress = [self.runner.ingress] if self.runner.ingress else []
        for connector in [*self.connectors.values(), *ingress]:
            with contextlib.suppress(Exception):
                connector.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.health.close()
        self.links.close()

    async def _register(self) -> bool:
        """Register with every coordinator; whether one answered before we were told to stop (the
        others go on trying: a coordinator down at our start must not keep us from the rest)."""
        message = await self._register_message()
        tries = [asyncio.ensure_future(link.register(message, self._stopped)) for link in self.links.all]
        for done in asyncio.as_completed(tries):
            if await done:
                return True
        return False

    async def _register_message(self) -> Register:
        message = Register(
            **{**process_info(), "host": self.host},
            stage=self.stage.name,
            replica=self.replica_id,
            max_inflight=self.stage.max_inflight,
            edges={e.label: e.connector.name for e in [*self.in_edges.values(), *self.out_edges.values()]},
            connectors=await self.health.read(),  # the first read may take long: it is waited for
            cleanup=cleanup_tokens([e.connector.name for e in [*self.in_edges.values(), *self.out_edges.values()]]),
        )
        return message

    async def _heartbeat(self, links: list[CoordinatorLink] | None = None) -> None:
        """Tell every coordinator we are registered with (or `links`) how we are: our whole load."""
        self.links.forget(set(self.runner.work) | self.runner.sent.kept())
        heartbeat = Heartbeat(
            self.replica_id,
            len(self.runner.work),
            processed=self.runner.processed,
            errors=self.runner.errors,
            malformed=self.malformed,
            draining=self.draining,
            connectors=await self.health.latest(),
            working=list(self.runner.work),
            counters=handler_counters(self.hooks, self.stage.name),
        )
        for link in self.links.registered() if links is None else links:
            await link.send(heartbeat)
        if self.health_file is not None and not self.draining:
            self.health_file.touch()  # container health checks look at its age

    async def _resync(self, link: CoordinatorLink) -> None:
        """Our control connection dropped and is back: what was in flight either way may be lost."""
        if link.registered.is_set():
            log.info("replica %s: control connection back; reconciling what is in flight (%s)", self.replica_id,
                     link.coordinator)
            await link.send(Resync(self.replica_id))

    def _slot_freed(self) -> None:
        """A request ended here: coordinators told we were full hear at once that a slot is free."""
        refused, self.links.refused = list(self.links.refused), set()
        if refused:
            asyncio.get_running_loop().create_task(self._heartbeat(refused))

    def _dropped(self, link: CoordinatorLink) -> None:
        """With several coordinators, one whose link stays down GONE_S is gone with its requests."""
        if self.links.several:
            asyncio.get_running_loop().call_later(GONE_S, lambda: link.down and self._orphaned(link, "is unreachable"))

    def _orphaned(self, link: CoordinatorLink, why: str) -> None:
        """Cancel the work of every request that came over `link`: nobody waits for it any more."""
        rids = self.links.rids_of(link, list(self.runner.work))
        if rids:
            log.warning("replica %s: coordinator %s %s; cancelling its %d request(s)", self.replica_id,
                        link.coordinator, why, len(rids))
        for rid in rids:
            self.runner.abort(rid)

    # ------------------------------------------------------------------ messages

    async def _receive_loop(self, link: CoordinatorLink) -> None:
        while True:
            frames = await link.receive()
            try:
                message = control.unpack(frames[0])
            except control.MalformedMessage as exc:
                self.malformed += 1
                log.warning("replica %s dropped a control message: %s", self.replica_id, exc)
                if exc.rid is not None:  # say so, or that request would wait for its deadline
                    await link.send(
                        Error(exc.rid, self.stage.name, self.replica_id, str(exc), FailureKind.UNREADABLE_WORK)
                    )
                continue
            if isinstance(message, Registered):
                link.accepted(message)
            elif isinstance(message, Rejected):
                self._rejected(link, message)
            elif isinstance(message, Work):
                await self._work(link, message)
            elif isinstance(message, Chunk):
                self.runner.feed(message)
            elif isinstance(message, Drained):
                link.drained = True
            elif isinstance(message, Abort):
                if self.links.of(message.rid) is link:  # a coordinator aborts only its own requests
                    self.runner.abort(message.rid)
            elif isinstance(message, Reconcile):
                await self._reconcile(link, message)
            else:
                self.malformed += 1

    async def _work(self, link: CoordinatorLink, message: Work) -> None:
        """Start the work, or refuse it when every slot is taken (by any coordinator's requests)."""
        if message.rid not in self.runner.work and len(self.runner.work) >= self.max_inflight:
            self.links.refused.add(link)
            error = f"all {self.max_inflight} of its slots (max_inflight) are taken"
            await link.send(Error(message.rid, self.stage.name, self.replica_id, error, FailureKind.REPLICA_FULL))
            return
        self.links.origin[message.rid] = link
        self.last_deadline = max(self.last_deadline, asyncio.get_running_loop().time() + message.remaining_s)
        self.runner.start(message)
        link.drained = False  # a new request may need what we put for it

    async def _reconcile(self, link: CoordinatorLink, message: Reconcile) -> None:
        """Send again what `link`'s coordinator lacks, then say what of its requests we still hold."""
        mine = (lambda rid: self.links.of(rid) is link) if self.links.several else None
        if again := await self.runner.sent.replay(message.rids, message.seqs, mine):  # what it lacks, first
            log.info("replica %s: sent again %d message(s) lost with the connection", self.replica_id, again)
        rids, chunks = self.runner.holding()
        rids = self.links.rids_of(link, rids)
        await link.send(Holding(self.replica_id, rids, {rid: chunks[rid] for rid in rids if rid in chunks}, ask=message.ask))

    def _rejected(self, link: CoordinatorLink, message: Rejected) -> None:
        if not message.reregister:
            log.error("coordinator rejected replica %s: %s", self.replica_id, message.error)
            self._stopped.set()
            return
        log.warning("coordinator asks replica %s to register again: %s", self.replica_id, message.error)
        if link.registered.is_set():
            link.registered.clear()
            if self.links.several:  # it restarted: the requests it sent us are nobody's any more
                self._orphaned(link, "forgot us (it restarted)")
            asyncio.get_running_loop().create_task(self._register_on(link))

    async def _register_on(self, link: CoordinatorLink) -> None:
        await link.register(await self._register_message(), self._stopped)


def _drained_already() -> None:
    """A stop signal after the replica closed: it is on its way out already."""
