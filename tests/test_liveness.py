"""A replica is dead only on positive evidence (DESIGN.md, Trust): /proc says there is no such process,
or the pid now belongs to a process that started at another time. Failing to read /proc (out of file
descriptors, no permission) is no evidence: the process counts as alive, and the failure is logged
once, not at every check.

The EMFILE case is real: a child process lowers its own descriptor limit, uses every descriptor up,
and asks about a process that runs (this test's) and one that has exited.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_mesh import hostinfo
from omni_mesh.connectors.shm.segments import ProcessIdentity
from omni_mesh.hostinfo import ProcessUnknown, process_gone, process_start_time

CHILD = r"""
import json, logging, os, resource, sys
from omni_mesh.connectors.shm.segments import ProcessIdentity
from omni_mesh.coordinator.scheduling.registry import Replica
from omni_mesh.hostinfo import ProcessUnknown, machine_id, namespace, process_gone, process_start_time

logging.basicConfig(stream=sys.stderr, format="%(message)s")
live, live_start, dead = (int(arg) for arg in sys.argv[1:])
replica = Replica("r-0", "r", b"id", live, live_start, "host", machine_id(), namespace("pid"), 1, {})
identity = ProcessIdentity(ProcessIdentity.current().pidns, live, live_start)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
fillers = []
while True:
    try:
        fillers.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        break
out = {}
try:
    process_start_time(live)
    out["start_time"] = "answered"
except ProcessUnknown as exc:
    out["start_time"] = str(exc)
out["gone"] = [process_gone(live, live_start) for _ in range(200)] + [process_gone(dead)]
out["replica_gone"] = replica.local_process_gone()
out["identity_alive"] = identity.is_alive()
for fd in fillers:
    os.close(fd)
out["after"] = [process_gone(live, live_start), process_gone(live, live_start + 1), process_gone(dead),
                replica.local_process_gone()]
print(json.dumps(out))
"""


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_out_of_descriptors_a_live_process_is_unknown_not_gone() -> None:
    me = os.getpid()
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(me), str(process_start_time(me)), str(_exited_pid())],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert "Too many open files" in out["start_time"], out["start_time"]
    assert not any(out["gone"]), "EMFILE was taken for a dead process"
    assert out["replica_gone"] is False and out["identity_alive"] is True
    assert result.stderr.count("treating it as alive") == 1, result.stderr  # once, not 202 times
    # With descriptors again, the evidence counts: the same live process, its pid with another
    # start time (reused), an exited process, and the replica of the live one.
    assert out["after"] == [False, True, True, False]


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.EACCES, errno.EIO])
def test_any_other_failure_to_read_proc_is_unknown(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def fail(self: Path, *args: object, **kwargs: object) -> str:
        raise OSError(code, os.strerror(code), str(self))

    monkeypatch.setattr(Path, "read_text", fail)
    with pytest.raises(ProcessUnknown, match=os.strerror(code)):
        process_start_time(os.getpid())
    assert not process_gone(os.getpid(), 1)
    assert ProcessIdentity(ProcessIdentity.current().pidns, os.getpid(), 1).is_alive()


@pytest.mark.parametrize("code", [errno.ENOENT, errno.ESRCH])
def test_no_such_process_is_evidence(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def fail(self: Path, *args: object, **kwargs: object) -> str:
        raise OSError(code, os.strerror(code), str(self))

    monkeypatch.setattr(Path, "read_text", fail)
    assert process_start_time(12345) is None
    assert process_gone(12345) and process_gone(12345, 99)


def test_an_unreadable_stat_line_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "1 (truncated")
    with pytest.raises(ProcessUnknown):
        process_start_time(1)
    assert not process_gone(1, 5)
    assert hostinfo.own_start_time() == 0  # this process's identity: none to check liveness by
