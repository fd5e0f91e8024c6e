"""Several coordinators serve one mesh (issue 42): `omni-mesh up --coordinators 2` on a no-op three-stage
mesh. One coordinator killed (SIGKILL) or stopped (SIGSTOP, 15 s) under 32 clients that retry once on a
connection error: nothing fails after the retry, new connections are answered within 1 s, the coordinator
is back within 10 s, no replica re-registers with the survivor or restarts, and the work of the dead
one's requests is cancelled. Two coordinators never overbook a replica (`max_inflight: 1`, counted by
the replica itself). Real processes, real sockets, real HTTP."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.meshkit import Mesh, running_mesh, wait_for
from support.replies import sse_events

from omni_mesh.launcher_coordinators import DIR_PREFIX, STOPPED_S, CoordinatorPlan

HANDLERS = Path(__file__).parent / "support" / "coordinator_handlers.py"
CLIENTS = 32
HEARTBEAT_S = 0.5  # counters reach /v1/stages with the replica's heartbeats, this much later at most
SUPERVISE_S = 0.2  # how often `up` looks at its children


def topology(max_inflight: int = 8) -> dict:
    def stage(i: int, name: str) -> dict:
        spec: dict[str, Any] = {
            "stage_id": i,
            "name": name,
            "handler": "coordinator_handlers:Counted",
            "max_inflight": max_inflight,
        }
        return {**spec, "engine_input_source": [i - 1]} if i else spec

    return {"name": "coordinators", "stages": [stage(0, "a"), stage(1, "b"), stage(2, "c")]}


def _mesh(tmp_path: Path, max_inflight: int = 8) -> contextlib.AbstractContextManager[Mesh]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(HANDLERS, tmp_path / HANDLERS.name)
    return running_mesh(tmp_path, topology(max_inflight), "--coordinators", "2")


def every_coordinator_ready(mesh: Mesh) -> dict[str, dict]:
    """/v1/coordinators once both coordinators answer /ready on their own ports (the shared port's
    /ready, which start_mesh waits for, is whichever coordinator the kernel picked)."""

    def ready() -> dict[str, dict] | None:
        entries = coordinators(mesh.url)
        if sorted(entries) != ["c0", "c1"] or any(e["health"] != "healthy" for e in entries.values()):
            return None
        with contextlib.suppress(httpx.HTTPError):
            if all(httpx.get(f"{own_url(e)}/ready", timeout=2).status_code == 200 for e in entries.values()):
                return entries
        return None

    return wait_for(ready, 60, "both coordinators ready")


def coordinators(url: str) -> dict[str, dict]:
    answer = httpx.get(f"{url}/v1/coordinators", timeout=5).json()
    return {entry["id"]: entry for entry in answer["coordinators"]}


def own_url(entry: dict) -> str:
    return f"http://127.0.0.1:{entry['ports']['own']}"


def reported(url: str, stage: str) -> dict | None:
    """The counters replica `stage` reports itself (through the coordinator at `url`); None before its
    first heartbeat there."""
    answer = httpx.get(f"{url}/v1/stages", timeout=5).json()
    replicas = {s["name"]: s["replicas"] for s in answer["stages"]}[stage]
    assert len(replicas) == 1, replicas
    return replicas[0]["counters"] or None


def counters(url: str, stage: str) -> dict:
    found = reported(url, stage)
    assert found is not None, f"replica {stage} sent no heartbeat to {url} since it registered"
    return found


class Load:
    """CLIENTS threads posting requests (kept-alive connections) until stopped; a connection error is
    retried once on a new connection. Outcomes: the final status (or error) of every request."""

    def __init__(self, urls: list[str], params: dict, clients: int = CLIENTS) -> None:
        self.urls, self.params = urls, params
        self.outcomes: Counter[str] = Counter()
        self.retried = 0
        self.served_by: Counter[str] = Counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(urls[i % len(urls)],)) for i in range(clients)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _client(self, url: str) -> None:
        client = httpx.Client(base_url=url, timeout=30)
        body = {"inputs": {"n": 1}, "params": self.params, "timeout_s": 20}
        while not self._stop.is_set():
            for attempt in (1, 2):
                try:
                    response = client.post("/v1/requests", json=body)
                    outcome = str(response.status_code)
                    with self._lock:
                        self.served_by[response.headers.get("x-omni-coordinator", "?")] += 1
                    break
                except httpx.TransportError as exc:  # the connection broke: retry once on a new one
                    outcome = type(exc).__name__
                    client.close()
                    client = httpx.Client(base_url=url, timeout=30)
                    if attempt == 1:
                        with self._lock:
                            self.retried += 1
            with self._lock:
                self.outcomes[outcome] += 1
        client.close()

    def total(self) -> int:
        with self._lock:
            return sum(self.outcomes.values())


def answered_within(url: str, limit_s: float) -> float:
    """Seconds a new connection to `url` takes to be answered (/health), retrying once on a connection
    error; a bare socket, so that only the server's side is timed."""
    host, port = url.rsplit("//", 1)[1].split(":")
    started = time.monotonic()
    for attempt in (1, 2):
        try:
            with socket.create_connection((host, int(port)), timeout=limit_s) as sock:
                sock.sendall(f"GET /health HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n".encode())
                head = sock.recv(64)
            if not head:
                raise ConnectionResetError("closed without an answer")
            assert head.startswith(b"HTTP/1.1 200"), head
            return time.monotonic() - started
        except OSError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _long_request(url: str, failures: list[str]) -> None:
    """A request that works at stage c for a minute, through the coordinator at `url` (which dies)."""
    try:
        httpx.post(
            f"{url}/v1/requests",
            json={"inputs": {"n": 1}, "params": {"sleep_s": {"c": 60}}, "timeout_s": 50},
            timeout=55,
        )
        failures.append("the long request got an answer")
    except httpx.TransportError:
        pass  # its coordinator died: the client sees the connection go


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_coordinator_that_dies_or_stops_under_load_fails_nothing_a_retry_cannot_cure(
    tmp_path: Path, fault: str
) -> None:
    with _mesh(tmp_path) as mesh:
        before = every_coordinator_ready(mesh)
        survivor, victim = own_url(before["c0"]), before["c1"]
        replicas = {name: [r["pid"] for r in rs] for name, rs in mesh.stages().items()}
        # Ready comes with the registration; the counters with the replica's first heartbeat after it.
        baseline = wait_for(lambda: reported(survivor, "c"), 10, "stage c's first heartbeat")
        long_failures: list[str] = []
        with Load([mesh.url], {"sleep_s": {"a": 0.5}}) as load:
            wait_for(lambda: load.total() >= 100, 60, "load through both coordinators")
            long = threading.Thread(target=_long_request, args=(own_url(victim), long_failures))
            long.start()
            wait_for(lambda: counters(survivor, "c")["concurrent"] >= 1, 10, "the long request at stage c")
            probes: list[float] = []
            prober = threading.Thread(
                target=lambda: probes.extend(answered_within(mesh.url, 1.0) for _ in range(8))
            )
            os.kill(victim["pid"], getattr(signal, fault))
            faulted = time.monotonic()
            try:
                # New connections on the shared port are answered at once: the kernel stops handing
                # them to a dead coordinator, and `up` kills a stopped one at once.
                prober.start()
                # No orphaned work: the long request's stage work is cancelled within 2 s of its
                # coordinator's death (the replica's own count, which heartbeats bring a moment later;
                # a stopped coordinator dies when `up` finds it stopped).
                dies_s = 0.0 if fault == "SIGKILL" else STOPPED_S + SUPERVISE_S
                wait_for(
                    lambda: counters(survivor, "c")["cancelled_total"] > baseline["cancelled_total"],
                    dies_s + 2.0 + HEARTBEAT_S,
                    "the dead coordinator's work at stage c to be cancelled",
                )
                prober.join(20)
                assert len(probes) == 8 and max(probes) < 1.0, (
                    f"new connections took {probes} s to be answered"
                )
                long.join(10)
                assert not long_failures
                # Back and serving within 10 s (a new process, its own port ready).
                wait_for(lambda: _back(mesh.url, victim), 10.0, f"coordinator c1 back after {fault}")
                loaded = load.total()
                wait_for(lambda: load.total() >= loaded + 100, 60, "load after the fault")
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim["pid"], signal.SIGCONT)
        failed = {k: v for k, v in load.outcomes.items() if k != "200"}
        assert not failed, f"requests failed after one retry: {failed} (of {load.total()})"
        assert load.retried > 0, (
            "no request was in flight on the faulted coordinator: the test proves nothing"
        )
        assert set(load.served_by) == {"c0", "c1"}, load.served_by
        # No replica restarted, none registered again with the survivor (same pid, uptime from before).
        stages = httpx.get(f"{survivor}/v1/stages", timeout=5).json()["stages"]
        for stage in stages:
            for replica in stage["replicas"]:
                assert [replica["pid"]] == replicas[stage["name"]]
                assert replica["restarts"] == 0
                assert replica["uptime_s"] > time.monotonic() - faulted, replica


def _back(url: str, victim: dict) -> bool:
    entry = coordinators(url).get("c1")
    if not entry or entry["pid"] == victim["pid"] or entry["health"] != "healthy":
        return False
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{own_url(entry)}/ready", timeout=1).status_code == 200
    return False


def test_two_coordinators_never_overbook_a_replica(tmp_path: Path) -> None:
    with _mesh(tmp_path, max_inflight=1) as mesh:
        entries = every_coordinator_ready(mesh)
        urls = [own_url(entries["c0"]), own_url(entries["c1"])]  # half the clients on each
        with Load(urls, {"sleep_s": {"a": 0.02, "b": 0.01}}, clients=8) as load:
            wait_for(lambda: load.total() >= 150, 90, "150 requests through both coordinators")
        assert dict(load.outcomes) == {"200": load.total()}, load.outcomes
        assert set(load.served_by) == {"c0", "c1"}, load.served_by
        time.sleep(2 * HEARTBEAT_S)  # the last counters reach the coordinators
        for stage in ("a", "b"):
            seen = counters(urls[0], stage)
            assert seen["calls_total"] >= 150, seen
            assert seen["concurrent_peak"] == 1, (
                f"stage {stage} held {seen['concurrent_peak']} requests at once"
            )


STREAMING = {
    "name": "coordinators-streaming",
    "stages": [
        {"stage_id": 0, "name": "gen", "handler": "mesh_handlers:gen"},
        {"stage_id": 1, "name": "relay", "handler": "mesh_handlers:relay", "engine_input_source": [0]},
    ],
}


def test_streams_and_large_inputs_work_the_same_through_either_coordinator(tmp_path: Path) -> None:
    """A streamed answer whose request's inputs are too large for a control message (they go through
    the coordinator's ingress connector) comes whole through each coordinator, which names itself."""
    with running_mesh(tmp_path, STREAMING, "--coordinators", "2") as mesh:
        entries = every_coordinator_ready(mesh)
        pad = "x" * 1_100_000  # past the inline limit: the entry stage fetches the inputs through a connector
        for name, entry in entries.items():
            with httpx.Client(base_url=own_url(entry), timeout=60) as client:
                body = {"inputs": {"count": 5, "size": 1000, "pad": pad}, "timeout_s": 30, "stream": True}
                with client.stream("POST", "/v1/requests", json=body) as response:
                    assert response.status_code == 200, response.read()
                    assert response.headers["x-omni-coordinator"] == name
                    events = list(sse_events(response))
            chunks = [event["output"] for kind, event in events if kind == "chunk"]
            assert [(c["seq"], c["size"], c["sum"]) for c in chunks] == [
                (i, 1000, 1000.0 * i) for i in range(5)
            ]
            assert events[-1][0] == "done", events[-1]
            assert events[-1][1]["request_id"].startswith(f"{name}."), events[-1][1]


def test_a_killed_launchers_coordinators_directory_is_swept_by_the_next_one() -> None:
    """A launcher SIGKILLed leaves its coordinators' status directory; the next `up --coordinators`
    removes those of launchers that are gone, and leaves a live one's alone."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{int(gone.stdout)}-"))
    (orphan / "c0.json").write_text("{}")
    live = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))
    plan = CoordinatorPlan.make(2, None)
    try:
        assert not orphan.exists(), "a dead launcher's directory was left"
        assert live.exists() and plan.directory.exists()
        assert plan.directory.name.startswith(f"{DIR_PREFIX}{os.getpid()}-")
    finally:
        plan.remove()
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(orphan, ignore_errors=True)
