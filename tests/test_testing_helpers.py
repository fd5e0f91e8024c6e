"""The helpers the tests and benchmarks lean on (omni_mesh.ports, omni_mesh.procinfo), against
real sockets and real processes: a helper that reads /proc wrongly would make other tests pass vacuously."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from omni_mesh.ports import free_port, free_ports, taken_since
from omni_mesh.procinfo import children_of, cpu_seconds, descendants, rss_bytes, stat_fields


def test_free_ports_are_distinct_and_bindable_and_taken_since_sees_a_listener() -> None:
    ports = free_ports(4)
    assert len(set(ports)) == 4 and not taken_since("127.0.0.1", ports)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", free_port()))
        listener.listen()
        assert taken_since("127.0.0.1", [ports[0], listener.getsockname()[1]])
    with socket.create_server(("127.0.0.1", 0)) as server:  # a connection left in TIME_WAIT is not "taken"
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()
        client.close()
    assert not taken_since("127.0.0.1", [port])


def test_the_process_tree_cpu_time_and_memory_are_read_from_proc() -> None:
    # A child that starts a grandchild burning CPU, then both wait on stdin.
    code = (
        "import subprocess, sys, time\n"
        # CPU time, not wall time: on a loaded machine 0.3 s of wall clock may be 0.05 s of CPU.
        "g = subprocess.Popen([sys.executable, '-c', 'import sys, time\\n"
        "while time.process_time() < 0.3: pass\\nsys.stdin.read()'], stdin=sys.stdin)\n"
        "print(g.pid, flush=True)\n"
        "sys.stdin.read()\n"
        "g.wait()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        time.sleep(0.5)
        assert children_of(child.pid) == {grandchild}
        assert descendants(os.getpid()) >= {child.pid, grandchild}
        assert stat_fields(grandchild)[1] == str(child.pid)
        deadline = time.monotonic() + 30
        while cpu_seconds({grandchild}) < 0.25 and time.monotonic() < deadline:  # /proc counts in 10 ms ticks
            time.sleep(0.05)
        assert 0.25 <= cpu_seconds({grandchild}) < 5, cpu_seconds({grandchild})  # what it burnt, not 0 or wall
        assert rss_bytes(child.pid) > 1 << 20
    finally:
        child.stdin.close()
        child.wait(10)
    assert stat_fields(grandchild) is None or stat_fields(grandchild)[0] == "Z"
    assert cpu_seconds({child.pid}) == 0.0  # gone (reaped): counts 0


def test_no_production_module_imports_test_helpers() -> None:
    """omni_mesh/ (the commands users run: bench, cli, services) never imports the tests' helpers: a
    package named `testing` or `tests`/`support` would ship test code in production (issue 29)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "omni_mesh"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(root.parent)}:{node.lineno} imports {name}"
                for name in names
                if name.startswith(("omni_mesh.testing", "tests", "support"))
            ]
    assert not offenders, offenders
    assert not (root / "testing").exists(), "omni_mesh/testing/ is back: test-only helpers go in tests/support/"
