"""`omni-mesh up`'s watchdog on its coordinator: a process can run and still not answer (SIGSTOP, a
frozen VM, a wedged event loop), and supervising exits alone never sees that.

Every few seconds it asks `/health` with a short timeout. The first unanswered question is logged, with
the pid and what is done about it; an answer after that is logged too. A coordinator that stays silent
for `limit_s` is killed (SIGKILL: a stopped process ignores everything else), and the launcher restarts
it like any coordinator that exited; the replicas register with the new one on their own. The requests
the silent one held were lost with it either way. Only a coordinator that has answered once since its
start is judged: one that is still starting is the start-up's business (`up` waits for /ready).
"""

from __future__ import annotations

import logging
import ssl
import subprocess
import threading
import time
from collections.abc import Callable

import httpx

from omni_mesh.defaults import COORDINATOR_UNRESPONSIVE_S

log = logging.getLogger("omni_mesh.launcher")

INTERVAL_S = 2.0  # how often /health is asked
TIMEOUT_S = 2.0  # how long an answer may take (it answers in milliseconds when well)
#: The default silence after which `up` restarts its coordinator: far longer than a GC pause or a
#: burst of load, short enough that a frozen mesh does not stay down unnoticed.
UNRESPONSIVE_S = COORDINATOR_UNRESPONSIVE_S


class Watchdog:
    def __init__(
        self,
        url: str,
        process: Callable[[], subprocess.Popen | None],
        *,
        limit_s: float = UNRESPONSIVE_S,
        verify: ssl.SSLContext | bool = True,
        interval_s: float = INTERVAL_S,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.url = f"{url}/health"
        self.process = process  # the coordinator's current process (it changes when restarted)
        self.limit_s = limit_s
        self.verify = verify
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.kills = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 1)

    def _run(self) -> None:
        # Started once `up` saw the mesh ready: the coordinator running now has answered.
        first = self.process()
        answered: int | None = first.pid if first is not None else None  # the pid that last answered
        silent_since: float | None = None
        with httpx.Client(timeout=self.timeout_s, verify=self.verify) as client:
            while not self._stop.wait(self.interval_s):
                process = self.process()
                if process is None or process.poll() is not None:
                    answered, silent_since = None, None  # exited: the launcher restarts it
                    continue
                asked = time.monotonic()
                error = _ask(client, self.url)
                if error is None:
                    if silent_since is not None:
                        log.warning(
                            "coordinator (pid %d) answers again after %.1f s of silence",
                            process.pid, time.monotonic() - silent_since,
                        )
                    answered, silent_since = process.pid, None
                    continue
                if answered != process.pid:
                    continue  # not answered once since its start: still starting
                if silent_since is None:
                    silent_since = asked
                    log.warning(
                        "coordinator (pid %d) is not answering %s (%s); it is restarted if it stays silent %.0f s",
                        process.pid, self.url, error, self.limit_s,
                    )
                elif time.monotonic() - silent_since >= self.limit_s:
                    log.error(
                        "coordinator (pid %d) has not answered %s for %.0f s: killing it, to be restarted "
                        "(its requests in flight are lost; the replicas register with the new one)",
                        process.pid, self.url, time.monotonic() - silent_since,
                    )
                    process.kill()
                    self.kills += 1
                    answered, silent_since = None, None


def _ask(client: httpx.Client, url: str) -> str | None:
    """None when the coordinator answered /health with 200; else what went wrong."""
    try:
        response = client.get(url)
    except httpx.TimeoutException:
        return "no answer within the timeout"
    except httpx.HTTPError as exc:
        return type(exc).__name__
    return None if response.status_code == 200 else f"status {response.status_code}"
