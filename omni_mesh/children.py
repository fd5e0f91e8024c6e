"""A process `omni-mesh up` starts and supervises (the coordinator or a stage replica), and the prctl
that ties it to its launcher."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import time
from dataclasses import dataclass, field

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in a child before exec (`preexec_fn`): if its parent is killed outright, it gets SIGTERM."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


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
        self.process = subprocess.Popen(
            self.argv, env=self.env, start_new_session=True, preexec_fn=die_with_parent
        )
        self.pids.append(self.process.pid)
        self.started_at = time.monotonic()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def describe_exit(self) -> str:
        code = self.process.returncode if self.process else None
        if code is None:
            return "is running"
        return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
