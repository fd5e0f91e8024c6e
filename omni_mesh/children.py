"""A process `omni-mesh up` starts and supervises (the coordinator or a stage replica), and the prctl
that ties it to its launcher.

No Python runs in a child between fork and exec (no `preexec_fn`): with one, CPython forks with
fork() rather than vfork() and runs every `os.register_at_fork` child hook (huggingface_hub's,
filelock's, ...) in the child, and a hook that wants a lock another thread held at the fork hangs the
child before exec, and the launcher with it. So the child asks for its parent-death signal itself,
first thing, told whom to watch by `PARENT_PID_ENV`."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

_PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "OMNI_MESH_DIE_WITH_PARENT"  # the launcher's pid, for the child it starts
EXIT_ORPHANED = 3  # the parent was gone before the child could ask to die with it


def die_with_parent() -> None:
    """From now on this process gets SIGTERM if the thread that started it goes (its parent killed
    outright, say). It lasts across exec."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def adopt_parent_death_signal() -> None:
    """In a child the launcher started (`PARENT_PID_ENV` set): die with the launcher, or exit now if
    it is already gone. The variable is taken out, so this process's own children do not inherit it."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if not parent:
        return
    die_with_parent()
    if os.getppid() != int(parent):  # it went before the prctl: nothing would ever signal us
        print(f"omni-mesh: the launcher (pid {parent}) is gone; exiting", file=sys.stderr)
        sys.exit(EXIT_ORPHANED)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    process: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    pids: list[int] = field(default_factory=list)
    quick_exits: int = 0  # exits in a row, each soon after its start
    given_up: bool = False
    stage: str = ""  # a replica's stage
    retiring: bool = False  # asked to drain and exit (autoscale): not restarted

    def start(self) -> None:
        # A new session: a terminal's Ctrl-C reaches only the launcher, which stops children in order.
        env = {**(os.environ if self.env is None else self.env), PARENT_PID_ENV: str(os.getpid())}
        self.process = subprocess.Popen(self.argv, env=env, start_new_session=True)
        self.pids.append(self.process.pid)
        self.started_at = time.monotonic()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def describe_exit(self) -> str:
        code = self.process.returncode if self.process else None
        if code is None:
            return "is running"
        return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
