"""The demo split over two hosts, as compose/docker-compose.host-a.yml and .host-b.yml run it.

Two network namespaces joined by a veth pair stand in for the hosts (tests/support/netns.py). Host A runs
the coordinator and the thinker, host B the talker and code2wav, each service with the `command` and
`environment` its compose file gives it (resolved by `docker-compose config`, with
OMNI_MESH_COORDINATOR_HOST set to host A's address). thinker -> talker crosses the link over
MooncakeTransferEngineConnector (`host: auto`, which resolves to each namespace's own address);
talker -> code2wav uses shared memory on host B.

Host B also gets its own shared memory, as a second machine has: its processes run in a mount
namespace with a private tmpfs on /dev/shm (`unshare --mount`, then `nsenter` into it), so the
coordinator's shared-memory domain check sees two hosts for real. Host B runs two talker replicas,
each in its own PID namespace as containers are (`--scale talker=2`): with network_mode: host both
containers also carry the host's name, and the replicas must still register as two.

The test talks to the coordinator from threads that entered host A's network namespace (setns).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from support.meshkit import wait_for
from support.netns import Host, TwoHosts
from support.servicekit import COMPOSE, Api, Service, Services, compose_config, localize

from omni_mesh.connectors.shm.segments import shm_dir

HOST_A = COMPOSE / "docker-compose.host-a.yml"
HOST_B = COMPOSE / "docker-compose.host-b.yml"
TIMEOUT_S = 5.0  # the deadline of the requests sent while the link is cut
_CLONE_NEWNET = 0x40000000


def _enter_netns(name: str) -> None:
    """ThreadPoolExecutor initializer: move this thread into network namespace `name`."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


class TwoHostMesh:
    """The per-host compose files' services, started in the two namespaces."""

    def __init__(self, hosts: TwoHosts, directory: Path, topology: str | None = None) -> None:
        self.hosts = hosts
        self.directory = directory
        self.services = Services(directory / "logs")
        self.topology = topology
        self._http = ThreadPoolExecutor(8, initializer=_enter_netns, initargs=(hosts.a.netns,))
        self.api = Api(
            "http://127.0.0.1:8000", call=lambda fn, *a, **k: self._http.submit(fn, *a, **k).result()
        )
        self.shm_b: Path | None = None
        self.anchor: Service | None = None
        self.processes: dict[str, Service] = {}

    def start_host_b_shm(self) -> None:
        """A process that holds host B's mount namespace with its own tmpfs on /dev/shm."""
        script = "mount -t tmpfs -o size=1g omni-mesh-host-b /dev/shm && exec sleep 3600"
        self.anchor = self.services.start(
            "host-b-shm",
            self.hosts.b.command(["unshare", "--mount", "--propagation", "private", "sh", "-c", script]),
        )
        shm = Path(f"/proc/{self.anchor.pid}/root/dev/shm")
        ours = os.stat(shm_dir()).st_dev

        def mounted() -> bool:
            if not self.anchor.running():
                raise AssertionError(f"host B's /dev/shm could not be set up:\n{self.anchor.log()}")
            with contextlib.suppress(OSError):
                return os.stat(shm).st_dev != ours
            return False

        wait_for(mounted, 10, "host B's private /dev/shm")
        self.shm_b = shm

    def _start(
        self,
        host: Host,
        file: Path,
        service: str,
        advertise: str,
        *,
        index: int = 1,
        own_pid_namespace: bool = False,
    ) -> Service:
        config = compose_config(file, {"OMNI_MESH_COORDINATOR_HOST": self.hosts.a.ip})
        instance = f"{advertise}-{service}-{index}"
        local = localize(config, service, scratch=self.directory, instance=instance)
        env = dict(local.env, OMNI_MESH_ADVERTISE_HOST=advertise)  # the hosts share one hostname here
        if self.topology:
            env["OMNI_MESH_TOPOLOGY"] = self.topology
        if host is self.hosts.a:
            wrap = host.command([])
        else:
            assert self.anchor is not None, "start host B's /dev/shm first"
            wrap = ["nsenter", "-t", str(self.anchor.pid), "--mount", "--net", "--"]
            env["OMNI_MESH_SHM_DIR"] = "/dev/shm"  # its own tmpfs, not the suite's directory on ours
        if own_pid_namespace:  # as a container: its own pids (from 1), its own /proc
            wrap += ["unshare", "--pid", "--fork", "--mount-proc"]
        process = self.services.start(local.name, local.argv, env=env, wrap=wrap, forks=own_pid_namespace)
        self.processes[instance] = process
        return process

    def start(self) -> None:
        self.start_host_b_shm()
        self._start(self.hosts.a, HOST_A, "coordinator", "host-a")
        self._start(self.hosts.a, HOST_A, "thinker", "host-a")
        for index in (1, 2):
            self._start(self.hosts.b, HOST_B, "talker", "host-b", index=index, own_pid_namespace=True)
        self._start(self.hosts.b, HOST_B, "code2wav", "host-b")

    def wait_registered(self, timeout_s: float = 90.0) -> dict[str, list[dict]]:
        expected = {"thinker": 1, "talker": 2, "code2wav": 1}

        def registered() -> dict | None:
            for process in self.processes.values():
                if not process.running():
                    raise AssertionError(f"{process.name} exited:\n{process.log()[-4000:]}")
            with contextlib.suppress(Exception):
                stages = self.api.stages()
                healthy = {
                    name: len([r for r in rs if r["health"] == "healthy"]) for name, rs in stages.items()
                }
                if healthy == expected:
                    return stages
            return None

        return wait_for(registered, timeout_s, f"healthy replicas {expected}", interval_s=0.2)

    def stop(self) -> None:
        """SIGTERM every service (they drain and exit 0), check both hosts' /dev/shm, end host B's."""
        self.api.close()
        self._http.shutdown()
        for name in (
            "host-b-talker-1",
            "host-b-talker-2",
            "host-b-code2wav-1",
            "host-a-thinker-1",
            "host-a-coordinator-1",
        ):
            process = self.processes[name]
            assert self.services.stop(process, signal.SIGTERM) == 0, f"{name}:\n{process.log()[-3000:]}"
        self.services.assert_no_segments()  # host A shares this machine's /dev/shm
        assert self.shm_b is not None and self.anchor is not None
        leftovers = [p.name for p in self.shm_b.iterdir()]
        assert not leftovers, f"left in host B's /dev/shm: {leftovers}"
        self.services.stop(self.anchor, signal.SIGTERM)

    def close(self) -> None:
        self._http.shutdown(wait=False, cancel_futures=True)
        self.services.close()


@contextlib.contextmanager
def two_host_mesh(directory: Path, topology: str | None = None) -> Iterator[TwoHostMesh]:
    with TwoHosts() as hosts:
        mesh = TwoHostMesh(hosts, directory, topology)
        try:
            mesh.start()
            yield mesh
        finally:
            hosts.restore()
            mesh.close()
    left = [h.netns for h in (hosts.a, hosts.b) if os.path.exists(f"/var/run/netns/{h.netns}")]
    assert not left, f"network namespaces left behind: {left}"


def _demo(api: Api, prompt: str, timeout_s: float = 60.0):
    return api.request({"prompt": prompt}, timeout_s=timeout_s)


def test_demo_across_two_hosts_over_mooncake_survives_a_cut_link(tmp_path: Path) -> None:
    with two_host_mesh(tmp_path) as mesh:
        api, hosts = mesh.api, mesh.hosts
        stages = mesh.wait_registered()
        assert {r["host"] for r in stages["thinker"]} == {"host-a"}
        assert {r["host"] for r in [*stages["talker"], *stages["code2wav"]]} == {"host-b"}
        # Two talker containers on one host network: same host name, both pid 1 in their namespaces.
        assert len({r["id"] for r in stages["talker"]}) == 2, [r["id"] for r in stages["talker"]]
        # The /dev/shm each replica sees: its SharedMemoryConnector's lifecycle token (None: it uses none).
        domains = {
            name: {(r["cleanup"].get("SharedMemoryConnector") or {}).get("domain") for r in replicas}
            for name, replicas in stages.items()
        }
        assert domains["talker"] == domains["code2wav"] and len(domains["talker"]) == 1
        assert domains["thinker"] != domains["talker"]
        ready = api.ready()
        assert ready.status_code == 200, ready.text

        response = _demo(api, "Hello across two hosts")
        assert response.status_code == 200, response.text
        out = response.json()["outputs"]
        assert (
            "Hello across two hosts" in out["text"]
            and out["sample_rate"] == 24_000
            and out["audio_wav_base64"]
        )

        def moved_over_mooncake() -> bool:
            stages = api.stages()
            puts = sum(r["connectors"]["mooncake"]["puts"] for r in stages["thinker"])
            gets = sum(r["connectors"]["mooncake"]["gets"] for r in stages["talker"])
            return puts >= 1 and gets >= 1

        # Counters arrive with each replica's next heartbeat.
        wait_for(
            moved_over_mooncake, 5, "the thinker's put and a talker's get on MooncakeTransferEngineConnector"
        )
        assert api.stages()["thinker"][0]["connectors"]["mooncake"]["status"] == "healthy"

        # The link goes down: requests fail by their deadline, naming the stage on the far side.
        hosts.cut()
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            answers = list(
                pool.map(lambda i: (_demo(api, f"cut {i}", TIMEOUT_S), time.monotonic()), range(2))
            )
        for response, answered in answers:
            assert answered - started <= TIMEOUT_S + 1.0, f"answered {answered - started:.1f} s after the cut"
            assert response.status_code in (502, 504), response.text
            body = response.json()
            assert body["stage"] == "talker" and "'talker'" in body["error"], body
        # Host B's replicas have gone silent: /ready says so.
        missing = wait_for(
            lambda: (r := api.ready()).status_code == 503 and r.json()["missing"],
            10,
            "/ready to report host B gone",
        )
        assert any("'talker'" in problem for problem in missing), missing

        # The link comes back: host B's replicas register again and requests succeed.
        hosts.restore()

        def served() -> bool:
            return _demo(api, "after the cut", TIMEOUT_S).status_code == 200

        wait_for(served, 60, "a request to succeed after the link came back", interval_s=0.5)
        mesh.wait_registered(30)  # both talkers are back
        assert api.ready().status_code == 200
        with ThreadPoolExecutor(3) as pool:
            after = list(pool.map(lambda i: _demo(api, f"after {i}"), range(3)))
        assert [r.status_code for r in after] == [200] * 3, [r.text for r in after]
        mesh.stop()


def test_shm_edge_wired_across_hosts_is_reported_by_ready(tmp_path: Path) -> None:
    # The single-host topology, every edge shared memory, run with the two-host compose files.
    single_host = str(COMPOSE / "omni-demo.yaml")
    with two_host_mesh(tmp_path, topology=single_host) as mesh:
        stages = mesh.wait_registered()
        thinker, talker = stages["thinker"][0]["id"], stages["talker"][0]["id"]
        ready = mesh.api.ready()
        assert ready.status_code == 503, ready.text
        missing = ready.json()["missing"]
        assert len(missing) == 1, missing  # talker -> code2wav shares host B's /dev/shm: fine
        problem = missing[0]
        for part in (
            "edge 0->1",
            "SharedMemoryConnector",
            repr(thinker),
            repr(talker),
            "host-a",
            "host-b",
            "MooncakeTransferEngineConnector",
            "ZmqConnector",
        ):
            assert part in problem, (part, problem)
        # A request cannot cross that edge: it fails at the talker, naming the edge (the data plane's fault).
        response = _demo(mesh.api, "over the wrong edge", 20)
        assert response.status_code == 502, response.text
        body = response.json()
        assert body["stage"] == "talker" and "0->1" in body["error"], body
        mesh.stop()
