"""Run a real mesh for end-to-end tests: `omni-mesh up TOPOLOGY --port P` as a subprocess.

`start_mesh` writes the topology into a directory (next to a copy of `mesh_handlers.py`, so the
stage processes import it from the topology's directory), starts the launcher on a free port and
waits for `/ready`. `Mesh.stop` sends a signal, waits for the launcher to exit, and checks that no
process of the mesh remains and that nothing the mesh's processes made is left in /dev/shm, nor the
mesh's own shared-memory directory (`up` makes one per run: OMNI_MESH_SHM_DIR of its processes).
Everything a mesh starts is killed on every path, also when a check fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from omni_mesh.connectors.shm.segments import ENV_DIR, PREFIX, owner_of, process_start_time, shm_dir
from omni_mesh.ports import free_port, taken_since
from omni_mesh.procinfo import descendants, dying_with_this_thread

HANDLERS = Path(__file__).with_name("mesh_handlers.py")
OMNI_MESH = Path(sys.executable).with_name("omni-mesh")  # the console script next to this venv's python
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
PORT_ATTEMPTS = 3  # the REST port is picked before `up` binds it: another process may take it first

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Poll `condition` until it returns something truthy; fail naming `what` past the deadline."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        last = condition()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")
        time.sleep(interval_s)


def settled(read: Callable[[], T], timeout_s: float, what: str, quiet_s: float = 1.0) -> T:
    """What `read` returns once it stays the same for `quiet_s` (two heartbeats of 0.5 s): counters
    an earlier request left in flight would otherwise be taken for the next one's baseline."""
    def unchanged() -> T | None:
        first = read()
        time.sleep(quiet_s)
        return first if first and read() == first else None

    return wait_for(unchanged, timeout_s, f"{what} to settle")


def wait_until(condition: Callable[[], object], timeout_s: float = 5.0) -> bool:
    """Poll `condition` until it is truthy or `timeout_s` passes; whether it became truthy
    (for `assert wait_until(...), message`; wait_for is the one that fails by itself)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return bool(condition())


class Mesh:
    """One running `omni-mesh up`, with an HTTP client and the bookkeeping its checks need."""

    def __init__(
        self,
        process: subprocess.Popen,
        url: str,
        topology: Path,
        log: Path,
        *,
        headers: dict[str, str] | None = None,
        verify: ssl.SSLContext | bool = True,
        given_shm_dir: str | None = None,
    ) -> None:
        self.process = process
        self.url = url
        self.topology = topology
        self.log_path = log
        # headers: e.g. the API key; verify: the context that trusts a mesh's self-signed certificate.
        self.client = httpx.Client(base_url=url, timeout=60.0, headers=headers, verify=verify)
        # OMNI_MESH_SHM_DIR of `up`: the one the test gave it, else the test session's, or /dev/shm
        self.inherited_shm_dir = Path(given_shm_dir) if given_shm_dir else shm_dir()
        self.shm_before = set(segments_in(self.inherited_shm_dir))
        # pid -> start time of every process of this mesh we have seen (a restarted stage adds one).
        self.processes: dict[int, int] = {}
        self.shm_dirs: set[Path] = {self.inherited_shm_dir}  # where its processes keep segments
        self.stopped = False

    # ------------------------------------------------------------------ HTTP

    def request(
        self, inputs: Any, *, params: dict | None = None, timeout_s: float = 20.0, **body: Any
    ) -> httpx.Response:
        payload = {"inputs": inputs, "params": params or {}, "timeout_s": timeout_s, **body}
        return self.client.post("/v1/requests", json=payload, timeout=timeout_s + 30)

    def ok(self, inputs: Any, **kwargs: Any) -> dict:
        response = self.request(inputs, **kwargs)
        assert response.status_code == 200, (response.status_code, response.text)
        return response.json()

    def stages(self) -> dict[str, list[dict]]:
        """{stage name: replicas} from /v1/stages; remembers every replica pid it sees."""
        response = self.client.get("/v1/stages", timeout=10)
        assert response.status_code == 200, response.text
        out = {stage["name"]: stage["replicas"] for stage in response.json()["stages"]}
        for replicas in out.values():
            for replica in replicas:
                self._remember(replica["pid"])
        return out

    def replica(self, stage: str) -> dict | None:
        replicas = self.stages().get(stage) or []
        return replicas[0] if replicas else None

    def connector_health(self, stage: str) -> dict[str, dict]:
        replica = self.replica(stage)
        return replica["connectors"] if replica else {}

    def ready(self) -> httpx.Response:
        return self.client.get("/ready", timeout=10)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"omni-mesh up exited with {self.process.returncode}:\n{self.log()}")
            # A short timeout per poll: a listener that is not our coordinator (another process took
            # the port) accepts and never answers, and `up`'s exit must be seen before the next try.
            with contextlib.suppress(httpx.HTTPError):
                return self.client.get("/ready", timeout=1.0).status_code == 200
            return False

        wait_for(ready, timeout_s, f"{self.url}/ready", interval_s=0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    # ------------------------------------------------------------------ processes

    def _remember(self, pid: int) -> None:
        # A test's own peer may register a replica under this process's pid (a rogue member): never
        # count it as the mesh's, or stop() would SIGKILL the test process itself (an xdist worker).
        if pid == os.getpid():
            return
        start = process_start_time(pid)
        if start is not None:
            self.processes.setdefault(pid, start)
            directory = shm_dir_of(pid)
            if directory is not None:
                self.shm_dirs.add(directory)

    def own_shm_dir(self) -> Path | None:
        """The shared-memory directory `up` made for this mesh (None: its processes use the one `up` was given)."""
        own = [d for d in self.shm_dirs if d != self.inherited_shm_dir]
        assert len(own) <= 1, f"the processes of one mesh use several shared-memory directories: {own}"
        return own[0] if own else None

    def remember_tree(self) -> None:
        self._remember(self.process.pid)
        for pid in descendants(self.process.pid):
            self._remember(pid)

    def alive(self) -> list[int]:
        """Processes of this mesh that still run (a pid reused by another process does not count)."""
        return [pid for pid, start in self.processes.items() if process_start_time(pid) == start]

    def our_segments(self) -> list[str]:
        """Segments made by a process of this mesh, in /dev/shm or in the mesh's own directory."""
        ours = []
        for directory in sorted(self.shm_dirs):
            for name in segments_in(directory):
                owner = owner_of(name)
                if owner is not None and owner.pid in self.processes and name not in self.shm_before:
                    ours.append(name)
        return ours

    def stop(self, sig: signal.Signals = signal.SIGINT, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Signal the launcher, wait for it, and check it left no process and no segment behind."""
        if self.stopped:
            return self.process.returncode
        self.stopped = True
        self.client.close()
        self.remember_tree()
        try:
            self.process.send_signal(sig)
            try:
                code = self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"omni-mesh up did not exit within {timeout_s} s of {sig.name}"
                ) from None
            # The launcher has exited: whatever it started must be gone too (give init a moment to reap).
            wait_for(lambda: not self.alive(), 5.0, f"the processes of the mesh to exit after {sig.name}")
            leftovers = self.our_segments()
            assert not leftovers, f"omni-mesh up left shared-memory segments in /dev/shm: {leftovers}"
            own = self.own_shm_dir()
            assert own is None or not own.exists(), f"omni-mesh up left its shared-memory directory {own}"
            assert code == 0, f"omni-mesh up exited with {code} after {sig.name}:\n{self.log()[-4000:]}"
            return code
        finally:
            self.kill()

    def kill(self) -> None:
        """Last resort (a failed check): SIGKILL every process of the mesh still running, and remove the
        segments they made (nothing of a mesh killed whole is left to reap them; a failed test must not
        also show up as a leak at the end of the run)."""
        self.stopped = True
        with contextlib.suppress(Exception):
            self.client.close()
        with contextlib.suppress(Exception):
            self.remember_tree()
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        for directory in sorted(self.shm_dirs):
            for name in self.our_segments():
                with contextlib.suppress(FileNotFoundError):
                    (directory / name).unlink()


def segments_in(directory: Path) -> list[str]:
    try:
        return sorted(name for name in os.listdir(directory) if name.startswith(PREFIX))
    except FileNotFoundError:
        return []


def shm_dir_of(pid: int) -> Path | None:
    """OMNI_MESH_SHM_DIR in the environment process `pid` started with (None: unset or unreadable)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{ENV_DIR}=".encode()
    found = [entry[len(prefix) :].decode() for entry in environ if entry.startswith(prefix)]
    return Path(found[-1]) if found and found[-1] else None


def write_topology(directory: Path, topology: dict | str | Path, *, handlers: bool = True) -> Path:
    """Write a topology (a mapping, YAML text, or a file to copy) and the test handlers into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "topology.yaml"
    if isinstance(topology, Path):
        shutil.copyfile(topology, path)
    elif isinstance(topology, dict):
        path.write_text(yaml.safe_dump(topology, sort_keys=False))
    else:
        path.write_text(topology)
    if handlers:
        shutil.copyfile(HANDLERS, directory / HANDLERS.name)
    return path


def up_command(topology: Path, port: int, *extra: str) -> list[str]:
    assert OMNI_MESH.exists(), f"{OMNI_MESH} missing: install the package (pip install -e .)"
    return [str(OMNI_MESH), "up", str(topology), "--port", str(port), *extra]


def start_mesh(
    directory: Path,
    topology: dict | str | Path,
    *extra: str,
    env: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    verify: ssl.SSLContext | bool = True,
    scheme: str = "http",
) -> Mesh:
    """`omni-mesh up` on `topology` (written into `directory`), ready to serve.

    `env` is added to this process's environment for `up`; `headers` and `verify` go to the mesh's
    HTTP client and `scheme` into its URL (an API key, a mesh serving HTTPS)."""
    path = write_topology(directory, topology)
    command = lambda port: up_command(path, port, *extra)  # noqa: E731
    return start_command(directory, command, path, env=env, headers=headers, verify=verify, scheme=scheme)


def start_command(
    directory: Path,
    command: Callable[[int], list[str]],
    topology: Path,
    *,
    env: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    verify: ssl.SSLContext | bool = True,
    scheme: str = "http",
) -> Mesh:
    """A mesh started by `command(port)` (`omni-mesh up ...`, `omni-mesh serve ...`) in `directory`,
    ready to serve; its output goes to directory/mesh.log."""
    log = directory / "mesh.log"
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        with log.open("wb") as out:
            process = subprocess.Popen(
                dying_with_this_thread(command(port)),
                env={**os.environ, **env} if env else None,
                cwd=directory,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        mesh = Mesh(process, f"{scheme}://127.0.0.1:{port}", topology, log, headers=headers, verify=verify,
                    given_shm_dir=(env or {}).get("OMNI_MESH_SHM_DIR"))
        try:
            mesh.wait_ready()
            mesh.remember_tree()
            mesh.stages()
            return mesh
        except BaseException as exc:
            mesh.remember_tree()
            mesh.kill()
            # The port was free when picked; if `up` refused it because someone took it since, pick again.
            if not isinstance(exc, AssertionError) or attempt == PORT_ATTEMPTS or not taken_since("127.0.0.1", [port]):
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def running_mesh(
    directory: Path, topology: dict | str | Path, *extra: str, sig: signal.Signals = signal.SIGINT, **options: Any
) -> Iterator[Mesh]:
    """A mesh for a `with` block or a fixture: stopped with `sig` and checked afterwards.
    `options` are start_mesh's keywords (env, headers, verify, scheme)."""
    with stopped_after(start_mesh(directory, topology, *extra, **options), sig) as mesh:
        yield mesh


@contextlib.contextmanager
def stopped_after(mesh: Mesh, sig: signal.Signals = signal.SIGINT) -> Iterator[Mesh]:
    """`mesh` for a `with` block: stopped with `sig` and checked at its end, killed if the block fails."""
    try:
        yield mesh
    except BaseException:
        mesh.kill()
        raise
    mesh.stop(sig)
