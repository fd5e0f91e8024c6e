"""A Docker engine for the tests, and the base image services/Dockerfile starts from, on machines with
no image registry (tests/test_docker_compose.py; the facts behind it: the lab notes on Docker).

- `engine_unavailable()`: why no engine can run here at all (not root, no cgroups), or None.
- `docker_engine()`: the engine already running (DOCKER_HOST, or /var/run/docker.sock), or Debian's
  dockerd started here with a private socket and exec root, a cached data root, and the flags that keep
  it off the host's network configuration (no bridge, no iptables, no forwarding or masquerading).
  Containers then run only with `network_mode: host`. What it started, it stops.
- `base_image(engine)`: an image to build FROM when python:3.11-slim cannot be pulled: Debian's Python
  3.11 (mmdebstrap from the host's own mirror) in a venv first on PATH, pip trusting the system CAs.
  The rootfs is made with all of that in it and imported as the image (no build step); imported once:
  a re-import would change its id and invalidate every cached layer above it.
- `torch_index()`: a PEP 503 index on 127.0.0.1 serving this machine's CPU torch wheel (pip's
  find-links), or TORCH_INDEX_URL from the environment. Its URL is never written into the repository.

The base image's tar and the engine's data root live in a cache directory outside the repository
(OMNI_MESH_TEST_CACHE, default /var/cache/omni-mesh-test), so a warm run builds only what changed; a
lock there keeps two runs from sharing one data root.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import html
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from omni_mesh.procinfo import dying_with_this_thread
from support.meshkit import wait_for

CACHE = Path(os.environ.get("OMNI_MESH_TEST_CACHE", "/var/cache/omni-mesh-test"))
SUITE = "bookworm"  # Debian 12: Python 3.11, the CPython of the CPU torch wheel (cp311)
BASE_IMAGE = f"omni-mesh-test/python:3.11-{SUITE}"
#: minbase (Priority: required, which has useradd, and apt) plus Python. libpython: as python:3.11-slim has.
ROOTFS_PACKAGES = "python3,python3-venv,libpython3.11,ca-certificates"
#: What python:3.11-slim's config says that the Dockerfile relies on: python and pip first on PATH.
BASE_IMAGE_CHANGES = [
    "ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["python3"]',
]
DOCKERD_FLAGS = [
    "--iptables=false",
    "--ip6tables=false",
    "--ip-masq=false",
    "--ip-forward=false",
    "--bridge=none",
    "--storage-driver=overlay2",
]
#: Builds use the classic builder: Debian's engine has no buildx, and compose v1 builds that way too.
BUILD_ENV = {"DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0"}
TORCH_INDEX_PORT = 38517
_LOCK_WAIT_S = 900.0


def engine_unavailable() -> str | None:
    """Why no Docker engine can run on this machine (None: one can)."""
    if os.geteuid() != 0 and not _running_engine_socket():
        return "no Docker engine runs here and starting one needs root"
    cgroups = Path("/sys/fs/cgroup")
    if not (cgroups / "cgroup.controllers").exists() and not (cgroups / "memory").is_dir():
        return "no cgroups mounted at /sys/fs/cgroup: containers cannot run here"
    return None


def _running_engine_socket() -> str | None:
    host = os.environ.get("DOCKER_HOST")
    if host:
        return host
    return "unix:///var/run/docker.sock" if Path("/var/run/docker.sock").is_socket() else None


# ====================================================================== the engine


@dataclass
class Engine:
    host: str  # DOCKER_HOST
    process: subprocess.Popen | None = None  # the dockerd started here; None: someone else's engine

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **BUILD_ENV, "DOCKER_HOST": self.host}

    def docker(self, *args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if check and result.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        return result

    def has_image(self, name: str) -> bool:
        return self.docker("image", "inspect", name, check=False).returncode == 0

    def answers(self) -> bool:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.docker("version", "--format", "{{.Server.Version}}", timeout_s=10, check=False).returncode == 0
        return False


@contextlib.contextmanager
def docker_engine(log_dir: Path) -> Iterator[Engine]:
    """An engine to use: the one running, or one started here (and stopped on exit)."""
    running = _running_engine_socket()
    if running and Engine(running).answers():
        yield Engine(running)
        return
    with _cache_lock():
        engine = _start_dockerd(log_dir)
        try:
            yield engine
        finally:
            _stop_dockerd(engine)


@contextlib.contextmanager
def _cache_lock() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as lock:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{CACHE}/lock: another test run held the engine for {_LOCK_WAIT_S:.0f} s") from None
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _start_dockerd(log_dir: Path) -> Engine:
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise AssertionError(
            "dockerd is missing: `make test` installs it (or run "
            "`apt-get install -y --no-install-recommends docker.io mmdebstrap`)"
        )
    _stop_stale_dockerd()
    exec_root = Path(tempfile.mkdtemp(prefix="omni-dockerd-", dir="/run" if os.access("/run", os.W_OK) else None))
    host = f"unix://{exec_root}/docker.sock"
    data_root = CACHE / "docker"
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "dockerd.log", "ab") as log:
        process = subprocess.Popen(
            dying_with_this_thread([  # the engine goes when this test process does
                dockerd,
                *DOCKERD_FLAGS,
                f"--data-root={data_root}",
                f"--exec-root={exec_root}",
                f"--pidfile={exec_root}/docker.pid",
                f"--host={host}",
            ]),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (CACHE / "dockerd.pid").write_text(f"{process.pid}\n")
    engine = Engine(host, process)

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"dockerd exited with {process.returncode}:\n{(log_dir / 'dockerd.log').read_text()[-3000:]}")
        return engine.answers()

    wait_for(ready, 60, "dockerd to answer", interval_s=0.2)
    # Containers a killed earlier run left in this data root (restart: unless-stopped brings them back).
    leftovers = engine.docker("ps", "-aq").stdout.split()
    if leftovers:
        engine.docker("rm", "-f", *leftovers, timeout_s=120)
    engine.docker("network", "prune", "-f")
    return engine


def _stop_stale_dockerd() -> None:
    """A dockerd an earlier run started on this data root and left (we hold the lock: its run is gone)."""
    pid_file = CACHE / "dockerd.pid"
    with contextlib.suppress(OSError, ValueError):
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if cmdline and Path(cmdline[0].decode()).name == "dockerd" and f"--data-root={CACHE / 'docker'}".encode() in cmdline:
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: not Path(f"/proc/{pid}").exists(), 60, "the stale dockerd to exit")


def _stop_dockerd(engine: Engine) -> None:
    process = engine.process
    assert process is not None
    exec_root = Path(engine.host.removeprefix("unix://")).parent
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    # dockerd may leave its network namespace bind-mounted; nothing else of it may stay mounted.
    for mount in sorted(_mounts_under(exec_root), reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)
    shutil.rmtree(exec_root, ignore_errors=True)
    (CACHE / "dockerd.pid").unlink(missing_ok=True)


def _mounts_under(root: Path) -> list[str]:
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    return [p for p in points if p == str(root) or p.startswith(f"{root}/")]


def mounts_of(container_ids: list[str]) -> list[str]:
    """Mount points (a container's /dev/shm, its root) of these containers that are still mounted."""
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    return [p for p in points if any(c in p for c in container_ids)]


# ====================================================================== the base image


def base_image(engine: Engine, log_dir: Path) -> str:
    """BASE_IMAGE, imported from the cached rootfs tar (made when missing) unless the engine has it."""
    if not engine.has_image(BASE_IMAGE):
        changes = [arg for change in BASE_IMAGE_CHANGES for arg in ("--change", change)]
        engine.docker("import", *changes, str(_rootfs_tar(log_dir)), BASE_IMAGE, timeout_s=300)
    return BASE_IMAGE


def _rootfs_tar(log_dir: Path) -> Path:
    """CACHE/python-SUITE.tar: a minimal Debian with Python in a venv at /opt/python, pip trusting the
    system CAs, and the host's CAs and apt settings.

    mmdebstrap, not debootstrap: it installs the packages with apt in one go and with dpkg's unsafe I/O
    (a throwaway rootfs needs no fsync), half debootstrap's CPU time; the merged-usr hook sets up the
    merged /usr itself instead of installing usrmerge and with it perl."""
    tar = CACHE / f"python-{SUITE}.tar"
    if tar.exists():
        return tar
    if shutil.which("mmdebstrap") is None:
        raise AssertionError("mmdebstrap is missing: `make test` installs it (apt-get install mmdebstrap)")
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="rootfs-") as scratch:
        root = Path(scratch) / "root"
        argv = ["mmdebstrap", "--variant=minbase", f"--include={ROOTFS_PACKAGES}", "--dpkgopt=force-unsafe-io"]
        argv += ["--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr", SUITE, str(root), debian_mirror()]
        with open(log_dir / "mmdebstrap.log", "wb") as log:
            result = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=900)
        assert result.returncode == 0, f"mmdebstrap failed:\n{(log_dir / 'mmdebstrap.log').read_text()[-3000:]}"
        (root / "etc/dpkg/dpkg.cfg.d/99mmdebstrap").unlink(missing_ok=True)  # the unsafe I/O: not for the image
        # apt and pip inside containers reach the indexes exactly as the host does: same CAs, same settings.
        for certificate in Path("/usr/local/share/ca-certificates").rglob("*.crt"):
            shutil.copy2(certificate, root / "usr/local/share/ca-certificates" / certificate.name)
        for setting in Path("/etc/apt/apt.conf.d").iterdir():
            if setting.is_file() and not (root / "etc/apt/apt.conf.d" / setting.name).exists():
                shutil.copy2(setting, root / "etc/apt/apt.conf.d" / setting.name)
        subprocess.run(["chroot", str(root), "update-ca-certificates"], capture_output=True, check=True, timeout=120)
        subprocess.run(["chroot", str(root), "python3", "-m", "venv", "/opt/python"], capture_output=True, check=True, timeout=300)
        (root / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
        partial = Path(scratch) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(root), "-cf", str(partial), "."], check=True, timeout=300)
        os.replace(partial, tar)
    return tar


def debian_mirror() -> str:
    """The Debian mirror the host's apt uses for SUITE (one-line or deb822 sources), else Debian's own."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        if not path.is_file() or path.suffix not in ("", ".list", ".sources"):
            continue
        text = path.read_text(errors="replace")
        for line in text.splitlines():
            match = re.match(rf"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+{SUITE}\s", line.strip() + " ")
            if match:
                return match.group(1)
        for stanza in re.split(r"\n\s*\n", text):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.MULTILINE))
            if SUITE in fields.get("Suites", "").split() and "deb" in fields.get("Types", "deb").split():
                return fields["URIs"].split()[0]
    return "http://deb.debian.org/debian"


# ====================================================================== the CPU torch wheel


@dataclass(frozen=True)
class TorchSource:
    index_url: str
    version: str | None  # the local wheel's version (TORCH_VERSION for the build); None: the Dockerfile's


@contextlib.contextmanager
def torch_index() -> Iterator[TorchSource]:
    """Where the image's build gets CPU torch: TORCH_INDEX_URL, or this machine's wheel served on loopback."""
    if os.environ.get("TORCH_INDEX_URL"):
        yield TorchSource(os.environ["TORCH_INDEX_URL"], None)
        return
    wheel = _local_torch_wheel()
    if wheel is None:
        raise AssertionError(
            "no CPU torch wheel in pip's find-links here: set TORCH_INDEX_URL to PyTorch's CPU wheel index "
            "(pytorch.org, Get Started, compute platform CPU)"
        )
    with tempfile.TemporaryDirectory() as root:
        project = Path(root) / "simple" / "torch"
        project.mkdir(parents=True)
        (project / wheel.name).symlink_to(wheel)
        href = urllib.parse.quote(wheel.name)
        (project / "index.html").write_text(f'<a href="{href}">{html.escape(wheel.name)}</a>\n')
        server = _serve(root)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            version = wheel.name.split("-")[1].split("+")[0]
            yield TorchSource(f"http://127.0.0.1:{server.server_address[1]}/simple", version)
        finally:
            server.shutdown()
            server.server_close()


def _serve(root: str) -> ThreadingHTTPServer:
    """An HTTP server for `root` on loopback, on the same port every run when it is free: the index URL
    is a build argument, and a new one would miss the build cache of every layer."""
    handler = functools.partial(_QuietHandler, directory=root)
    try:
        return ThreadingHTTPServer(("127.0.0.1", TORCH_INDEX_PORT), handler)
    except OSError:
        return ThreadingHTTPServer(("127.0.0.1", 0), handler)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def _local_torch_wheel() -> Path | None:
    directories = os.environ.get("PIP_FIND_LINKS", "").split()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        pip = [sys.executable, "-m", "pip", "config", "list"]
        listed = subprocess.run(pip, capture_output=True, text=True, timeout=30).stdout
        directories += re.findall(r"find-links='([^']+)'", listed)
    for directory in directories:
        wheels = sorted(Path(directory.removeprefix("file://")).glob("torch-*+cpu-cp311-cp311-*x86_64.whl"))
        if wheels:
            return wheels[-1]
    return None
