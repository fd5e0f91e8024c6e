"""`omni-mesh up --coordinators N`: N coordinator processes for one mesh (docs/architecture.md,
"Several coordinators").

Each binds the shared REST port with SO_REUSEPORT (the kernel spreads new connections over them), a
REST port of its own (the launcher asks each for /ready and /health there, and coordinator c0 alone for
the autoscaling targets: one decision for the mesh) and a control port of its own; every replica is
given every control port. A coordinator that dies is restarted on the same ports like any child. One
stopped by a signal (SIGSTOP) is killed at once (`Stopped`): the kernel would go on handing it new
connections that nobody answers, where a dead one's are refused and retried elsewhere.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from omni_mesh.children import Child
from omni_mesh.defaults import COORDINATOR_ID_ENV, COORDINATORS_DIR_ENV
from omni_mesh.ports import free_ports
from omni_mesh.procinfo import stat_fields

log = logging.getLogger("omni_mesh.launcher")

#: How long a coordinator may stay stopped (state T) before it is killed to be restarted, and how often
#: that is looked at (on a thread of its own: the supervision loop may wait on HTTP).
STOPPED_S = 0.2
STOPPED_CHECK_S = 0.05


DIR_PREFIX = "omnimesh-coordinators-"  # + the launcher's pid: a SIGKILLed launcher's is swept later


def sweep_orphans() -> None:
    """Remove the coordinators' directories of launchers that are gone (SIGKILLed: nothing removed them)."""
    for directory in Path(tempfile.gettempdir()).glob(f"{DIR_PREFIX}*"):
        pid = directory.name[len(DIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and stat_fields(int(pid)) is None:
            shutil.rmtree(directory, ignore_errors=True)


@dataclass
class CoordinatorPlan:
    """Where each of N coordinators listens: control endpoints and own REST ports, by index."""

    count: int
    controls: list[str]
    own_ports: list[int]
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")))

    @classmethod
    def make(cls, count: int, control_port: int | None) -> CoordinatorPlan:
        sweep_orphans()
        ports = free_ports(2 * count)  # distinct (picked one at a time, two could be the same)
        controls = [
            f"tcp://127.0.0.1:{control_port + i if control_port else ports[count + i]}" for i in range(count)
        ]
        return cls(count, controls, ports[:count])

    def argv(self, index: int, base: list[str]) -> list[str]:
        """Coordinator `index`'s command line: the single coordinator's, with its own control port."""
        argv = [
            self.controls[index] if before == "--control" else arg
            for before, arg in zip(["", *base[:-1]], base, strict=True)
        ]
        return [*argv, "--reuse-port", "--own-port", str(self.own_ports[index])]

    def env(self, index: int, base: dict[str, str]) -> dict[str, str]:
        return {**base, COORDINATOR_ID_ENV: f"c{index}", COORDINATORS_DIR_ENV: str(self.directory)}

    def urls(self, scheme: str, host: str) -> list[str]:
        return [f"{scheme}://{host}:{port}" for port in self.own_ports]

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def coordinators(plan: CoordinatorPlan, base: Child) -> list[Child]:
    """The N coordinator children, made from the single coordinator's `base` (its argv and env)."""
    return [
        Child(f"coordinator-{i}", plan.argv(i, base.argv), plan.env(i, base.env or {}))
        for i in range(plan.count)
    ]


class Stopped:
    """Kills a coordinator found stopped (SIGSTOP: state T) for STOPPED_S, so it is restarted. Not one
    being traced (state t: a debugger): that one is somebody's doing."""

    def __init__(self, children: list[Child]) -> None:
        self.children = children
        self.since: dict[int, float] = {}  # pid -> when it was first seen stopped
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Watch on a thread of its own (idempotent; nothing to watch with one coordinator)."""
        if self._thread is None and len(self.children) > 1:
            self._thread = threading.Thread(target=self._watch, name="stopped-coordinators", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(STOPPED_CHECK_S):
            self.check(self.children)

    def check(self, children: list[Child]) -> None:
        now = time.monotonic()
        for child in children:
            if not child.running():
                continue
            pid = child.process.pid  # type: ignore[union-attr]
            if process_state(pid) != "T":
                self.since.pop(pid, None)
                continue
            if now - self.since.setdefault(pid, now) >= STOPPED_S:
                log.warning(
                    "%s (pid %d) is stopped; the kernel still hands it connections on the shared port: "
                    "killing it to be restarted",
                    child.name,
                    pid,
                )
                child.process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                self.since.pop(pid, None)


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` (/proc/PID/stat), None when it is gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else None
