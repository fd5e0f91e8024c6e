"""`omni-mesh up`: the coordinator and every stage replica as local processes, supervised.

Start order: coordinator, then replicas; then wait for `/ready`. A process that exits unexpectedly is
restarted with backoff and what it held is reclaimed by its connector types (`reclaim_orphans`); the
coordinator reports the restart in `/v1/stages`. Shutdown (Ctrl-C, SIGTERM, or SIGHUP when the terminal closes): the coordinator first,
so in-flight requests finish while every stage still runs; then the replicas drain and exit;
stragglers are killed; whatever any child left behind is reclaimed, so the host ends as it began.
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import uuid

import httpx

from omni_mesh.children import Child
from omni_mesh.connectors import mesh_places, reclaim_orphans
from omni_mesh.defaults import CONNECTOR_HOST_ENV, HOST_CAP_ENV
from omni_mesh.defaults import INSTANCE_ENV as INSTANCE_ENV
from omni_mesh.fdlimit import raise_nofile_limit
from omni_mesh.launcher_coordinators import CoordinatorPlan, Stopped, coordinators
from omni_mesh.launcher_scale import Scaler, host_cap
from omni_mesh.port_checks import check_ports, other_port
from omni_mesh.ports import free_port, taken_since
from omni_mesh.security import MeshKeys, insecure_requested, keys_from_environment
from omni_mesh.topology import StageSpec, Topology
from omni_mesh.topology.handler_source import handler_in_source
from omni_mesh.topology.load import import_handler
from omni_mesh.watchdog import UNRESPONSIVE_S, Watchdog

log = logging.getLogger("omni_mesh.launcher")

#: A child that exits this soon after its start, more than MAX_QUICK_RESTARTS times in a row, is
#: crash-looping: restarting it again only fills the log.
QUICK_EXIT_S = 30.0
MAX_QUICK_RESTARTS = 5
#: Start-ups tried when the control port, picked before the coordinator binds it, is taken in between.
CONTROL_PORT_ATTEMPTS = 3
#: How long the replicas of a start-up that never became ready get after SIGTERM before SIGKILL. They
#: hold no request (the mesh never served one), so there is nothing to drain; a replica still waiting to
#: register would only sit out the whole wait.
ABANDONED_START_GRACE_S = 1.0
#: Connector types whose library binds ports of its own on every interface, whatever `host` says.
WIDE_OPEN = ("MooncakeTransferEngineConnector", "MooncakeStoreConnector", "MooncakeConnector")

def mesh_environment() -> dict[str, str]:
    """The children's environment: this one, plus mesh keys. Keys the environment already names
    (a deployment's) are used as they are; otherwise a fresh pair is made for this run alone, so a
    local mesh is authenticated with no flag. OMNI_MESH_INSECURE passes through (the children log it)."""
    env = dict(os.environ)
    if insecure_requested() or keys_from_environment() is not None:
        return env
    env.update(MeshKeys.generate().to_env())
    return env


class Launcher:
    def __init__(
        self,
        topology: Topology,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        ready_timeout_s: float = 60.0,
        grace_s: float = 10.0,
        max_quick_restarts: int = MAX_QUICK_RESTARTS,
        restart_backoff_s: float = 0.5,
        coordinator_args: list[str] | None = None,
        api_key: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        control_port: int | None = None,
        unresponsive_s: float = UNRESPONSIVE_S,
        max_replicas_total: int | None = None,
        min_free_memory: int | None = None,
        connector_host: str = "127.0.0.1",
        coordinator_count: int = 1,
    ) -> None:
        if topology.path is None:
            raise ValueError("omni-mesh up needs a topology file")
        missing = topology.missing_handlers()
        if missing:
            names = ", ".join(f"{s.stage_id} {s.name!r}" for s in missing)
            raise ValueError(
                f"cannot start: stage(s) {names} have no handler; set `handler: module:function` or `engine:`"
            )
        self.topology = topology
        self.host = host
        self.port = port
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.max_quick_restarts = max_quick_restarts
        self.restart_backoff_s = restart_backoff_s  # the first restart's delay; doubled up to 10 s
        self.url = f"{'https' if ssl_certfile else 'http'}://{host}:{port}"
        self.api_key = api_key  # the coordinator inherits it through the environment (OMNI_MESH_API_KEY)
        self.ssl_certfile = ssl_certfile
        self.unresponsive_s = unresponsive_s  # 0: no watchdog on the coordinator
        tls = ["--ssl-certfile", ssl_certfile, "--ssl-keyfile", ssl_keyfile or ""] if ssl_certfile else []
        # The control plane stays on loopback: `up` runs every replica on this machine. A port given
        # (--control-port) is used as it is; one we pick may be taken before the coordinator binds it.
        self.control_port_chosen = control_port is not None or coordinator_count > 1  # several: no retry
        self.control = f"tcp://127.0.0.1:{control_port or free_port()}"
        self._stop = threading.Event()
        # Every replica runs here: connectors' `host: auto` binds loopback too (an address the topology
        # writes is its own choice), so nothing of the mesh listens beyond this machine unasked.
        env = {**mesh_environment(), CONNECTOR_HOST_ENV: connector_host}
        if connector_host == "auto":  # asked for: the connectors' own rule (the default route's address)
            del env[CONNECTOR_HOST_ENV]
        self.env, self.cap = env, host_cap(topology, max_replicas_total)
        self.shm = mesh_places(topology.name, env)  # named in env; made at start, removed at stop
        self.instance = uuid.uuid4().hex  # its coordinator says it in /ready: no other mesh's answer counts
        path = str(topology.path)
        python = [sys.executable, "-m", "omni_mesh"]
        self.coordinator = Child(
            "coordinator",
            [*python, "coordinator", path, "--host", host, "--port", str(port), "--control", self.control,
             "--grace-s", str(grace_s), *tls, *(coordinator_args or [])],
            {**env, INSTANCE_ENV: self.instance, HOST_CAP_ENV: str(self.cap)},
        )
        # Several coordinators (launcher_coordinators): each its own ports; `self.coordinator` is c0.
        self.plan = CoordinatorPlan.make(coordinator_count, control_port) if coordinator_count > 1 else None
        self.coordinators = coordinators(self.plan, self.coordinator) if self.plan else [self.coordinator]
        self.coordinator, self.stopped = self.coordinators[0], Stopped(self.coordinators)
        self.ready_urls = self.plan.urls(self.url.split(":")[0], host) if self.plan else [self.url]
        self._made: dict[str, int] = {}  # replicas made per stage: a new one gets the next index
        self.replicas = [self.make_replica(stage) for stage in topology.stages for _ in range(stage.replicas)]
        self.scaler = Scaler(topology, self.replicas, self.make_replica, self.reclaim, url=self.ready_urls[0], cap=self.cap,
                             api_key=api_key, verify=self._trust(), min_free_memory=min_free_memory)

    def make_replica(self, stage: StageSpec) -> Child:
        index = self._made[stage.name] = self._made.get(stage.name, -1) + 1
        name, path = f"{stage.name}-{index}", str(self.topology.path)
        argv = [sys.executable, "-m", "omni_mesh", "stage", path, "--stage", stage.name, "--replica", name]
        controls = ",".join(self.plan.controls) if self.plan else self.control
        return Child(name, [*argv, "--coordinator", controls], self.env, stage=stage.name)

    @property
    def children(self) -> list[Child]:
        return [*self.coordinators, *self.replicas]

    def run(self) -> int:
        """Start everything, supervise until a signal, stop everything. Returns the exit status."""
        # SIGHUP: the terminal closed. The children have sessions of their own and never see it.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: self._stop.set())
        watchdog: list[Watchdog] | None = None
        try:
            self.start()
            self.announce()
            if self.unresponsive_s > 0:
                watchdog = [
                    Watchdog(url, lambda c=c: c.process, limit_s=self.unresponsive_s, verify=self._trust())
                    for url, c in zip(self.ready_urls, self.coordinators, strict=True)
                ]
                for each in watchdog:
                    each.start()
            self.supervise()
            return 0
        except RuntimeError as exc:
            log.error("%s", exc)
            return 1
        finally:
            for each in watchdog or []:
                each.stop()
            self.scaler.close()
            self.stop()

    def start(self) -> None:
        self.check_port()
        self.check_handlers()
        self.warn_wide_open()
        self.shm.create()
        for attempt in range(1, CONTROL_PORT_ATTEMPTS + 1):
            for child in self.children:
                child.start()
            try:
                self.wait_ready()
                return
            except RuntimeError:
                port = int(self.control.rsplit(":", 1)[1])
                if (
                    attempt == CONTROL_PORT_ATTEMPTS
                    or self.control_port_chosen
                    or self.coordinator.running()
                    or not taken_since("127.0.0.1", [port])
                ):
                    raise
            log.warning("control port %d was taken before the coordinator bound it; starting again on another", port)
            self._abandon_start()
            self.use_control_port(free_port())

    def _abandon_start(self) -> None:
        """Stop the replicas of a start-up that never became ready: at once, as they hold no request
        (SIGTERM, a short wait, SIGKILL), and reclaim what the killed ones left now rather than when the
        mesh that replaces them stops."""
        self._terminate(self.replicas, ABANDONED_START_GRACE_S)
        for child in self.replicas:
            self.reclaim(child.process.pid)

    def use_control_port(self, port: int) -> None:
        """Hand the children (not yet started, or stopped) the control plane on `port`."""
        old, self.control = self.control, f"tcp://127.0.0.1:{port}"
        for child in self.children:
            child.argv = [self.control if arg == old else arg for arg in child.argv]

    def check_port(self) -> None:
        """Refuse, before starting anything, a REST port (or a chosen control port) that cannot be used:
        the CLI's own check, again for callers that build a Launcher themselves."""
        control = int(self.control.rsplit(":", 1)[1]) if self.control_port_chosen else None
        try:
            check_ports(self.host, self.port, control)
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None

    def warn_wide_open(self) -> None:
        """Say so when a connector's library listens beyond loopback: `up` cannot keep it on it."""
        for ref, spec in self.topology.connectors.items():
            if spec.name in WIDE_OPEN:
                log.warning(
                    "connector %r (%s): Mooncake's transfer engine listens on every interface, whatever `host` "
                    "says, and does not check its peers; on one machine prefer SharedMemoryConnector or "
                    "ZmqConnector (docs/security.md, 'What listens where')", ref, spec.name,
                )

    def check_handlers(self) -> None:
        """Check every stage's handler before anything starts: one ValueError naming each that fails,
        rather than a traceback from every replica of its stage. A handler its source shows is not
        imported here: the launcher stays without what handlers import (torch)."""
        problems = []
        for stage in self.topology.stages:
            if stage.handler and not handler_in_source(self.topology, stage):
                try:
                    import_handler(self.topology, stage)
                except ValueError as exc:
                    problems.append(str(exc))
                except Exception as exc:  # the module itself raised on import: one line, not a traceback
                    problems.append(f"stage {stage.name!r}: handler {stage.handler!r} raised {type(exc).__name__}: {exc}")
        if problems:
            raise ValueError("; ".join(problems) + " (nothing started)")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        last = "no answer yet"
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.Client(timeout=2.0, headers=headers, verify=self._trust()) as client:
            while time.monotonic() < deadline and not self._stop.is_set():
                for child in self.children:
                    if not child.running():
                        raise RuntimeError(f"{child.name} {child.describe_exit()} during start-up (see its log above)")
                try:
                    for url in self.ready_urls:  # every coordinator (its own port, with several)
                        response = client.get(f"{url}/ready")
                        answer = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
                        if answer.get("instance") not in (None, self.instance):
                            raise RuntimeError(f"another mesh ({answer.get('mesh')!r}) answers on {self.url}: {other_port()}")
                        if response.status_code != 200:
                            break
                    else:
                        return
                    last = "; ".join(answer.get("missing", [])) or response.text
                except httpx.HTTPError as exc:
                    last = f"coordinator not answering ({type(exc).__name__})"
                self._stop.wait(0.2)
        if not self._stop.is_set():
            raise RuntimeError(f"mesh not ready after {self.ready_timeout_s:.0f} s: {last}")

    def _trust(self) -> ssl.SSLContext | bool:
        """Over HTTPS, trust exactly the certificate we gave the coordinator: the poll goes to the
        address it binds, which the certificate need not name (it may be a public host name)."""
        if not self.ssl_certfile:
            return True
        context = ssl.create_default_context(cafile=self.ssl_certfile)
        context.check_hostname = False
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the leaf itself is the trust anchor
        return context

    def announce(self) -> None:
        sample = '{"inputs": {"prompt": "Hello, omni-mesh!"}, "timeout_s": 30}'
        # The key itself is never printed: the line tells the shell to take it from the environment.
        curl = "curl -s" + (f" --cacert {self.ssl_certfile}" if self.ssl_certfile else "")
        curl += ' -H "Authorization: Bearer $OMNI_MESH_API_KEY"' if self.api_key else ""
        docs = f"{self.url}/docs" + (" (send the key: a browser alone gets 401)" if self.api_key else "")
        print(
            f"\nomni-mesh {self.topology.name!r} is ready at {self.url}\n"
            f"  send a request:  {curl} {self.url}/v1/requests -H 'content-type: application/json' -d '{sample}'\n"
            f"  replicas:        {curl} {self.url}/v1/stages\n"
            f"  API docs:        {docs}\n"
            f"Ctrl-C stops everything.\n",
            flush=True,
        )

    def supervise(self) -> None:
        while not self._stop.wait(0.2):
            self.stopped.start()
            self.scaler.step()
            now = time.monotonic()
            for child in self.children:
                if child.given_up or child.retiring or child.running() or now < child.next_start:
                    continue
                if child.next_start == 0.0:  # it just exited: reap, then schedule a restart with backoff
                    reaped = self.reclaim(child.process.pid)
                    uptime = now - child.started_at
                    child.quick_exits = child.quick_exits + 1 if uptime < QUICK_EXIT_S else 0
                    if child.quick_exits > self.max_quick_restarts:
                        self._give_up(child)
                        continue
                    base = self.restart_backoff_s
                    delay = min(10.0, base * 2 ** min(child.quick_exits - 1, 5)) if child.quick_exits else base
                    child.next_start = now + delay
                    log.warning(
                        "%s %s after %.1f s; restarting in %.1f s (restart #%d)%s",
                        child.name, child.describe_exit(), uptime, delay, child.restarts + 1,
                        f", reclaimed {len(reaped)} connector resource(s)" if reaped else "",
                    )
                    continue
                child.restarts += 1
                child.next_start = 0.0
                child.start()

    def _give_up(self, child: Child) -> None:
        message = (
            f"giving up on {child.name}: it {child.describe_exit()} {child.quick_exits} times in a row, each within "
            f"{QUICK_EXIT_S:.0f} s of its start; fix the cause (see its log above) and start the mesh again"
        )
        if child in self.coordinators:
            raise RuntimeError(message)
        child.given_up = True
        log.error("%s; the rest of the mesh keeps running", message)

    def stop(self) -> None:
        # Coordinator first: it stops taking requests and lets in-flight ones finish (grace).
        self.stopped.stop()  # stopping coordinators are not stopped ones
        self._terminate(self.coordinators, self.grace_s + 5)
        self._terminate(self.replicas, 15.0)
        reaped = [name for child in self.children for pid in child.pids for name in self.reclaim(pid)]
        reaped += self.shm.remove()  # what is left in the mesh's own directory, and the directory
        if self.plan:
            self.plan.remove()
        if reaped:
            log.warning("reclaimed %d connector resource(s) left by stopped processes: %s", len(reaped), reaped)

    def reclaim(self, pid: int) -> list[str]:
        """What the exited process `pid` held, shared memory looked for in the mesh's own directory."""
        return reclaim_orphans(pid=pid, env=self.env)

    @staticmethod
    def _terminate(children: list[Child], timeout_s: float) -> None:
        running = [c for c in children if c.running()]
        for child in running:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in running:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", child.name, timeout_s)
                child.process.kill()
                child.process.wait()


def run_up(
    topology: Topology,
    *,
    host: str,
    port: int,
    coordinator_args: list[str] | None = None,
    api_key: str | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    ready_timeout_s: float = 60.0,
    control_port: int | None = None,
    unresponsive_s: float = UNRESPONSIVE_S,
    max_replicas_total: int | None = None,
    min_free_memory: int | None = None,
    connector_host: str = "127.0.0.1",
    coordinator_count: int = 1,
) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /ready poll is noise
    raise_nofile_limit()  # the children inherit it (and raise theirs again where they may)
    return Launcher(
        topology, host=host, port=port, coordinator_args=coordinator_args,
        api_key=api_key, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, ready_timeout_s=ready_timeout_s,
        control_port=control_port, unresponsive_s=unresponsive_s, max_replicas_total=max_replicas_total,
        min_free_memory=min_free_memory,
        connector_host=connector_host, coordinator_count=coordinator_count,
    ).run()
