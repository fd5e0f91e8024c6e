"""What a running `omni-mesh up` mesh listens on, against docs/security.md's "What listens where" (issue 37).

Each test starts a real mesh, makes every socket it can open open (a request whose inputs go through
the coordinator's ingress, payloads large enough for ZmqConnector's bulk socket), then reads the
listening TCP sockets of every process of the mesh from /proc, names each (the REST and control
ports by number, a connector's side channel by the endpoint its health reports, the rest by what
else that process runs) and checks the address against the table's `omni-mesh up` column. A
socket nobody can name fails the test too: the table must list everything.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from support.listeners import EVERY_INTERFACE, Listener, listening
from support.meshkit import Mesh, running_mesh, up_command, write_topology

from omni_mesh.connectors._addresses import bind_and_advertise, outward_address
from omni_mesh.defaults import CONNECTOR_HOST_ENV
from omni_mesh.ingress import INLINE_MAX_BYTES
from omni_mesh.ports import free_port
from omni_mesh.procinfo import descendants

REPO = Path(__file__).resolve().parents[1]
SECURITY = REPO / "docs" / "security.md"
N = 65_536  # float64 elements: a 512 KiB payload, over the bulk socket's 256 KiB threshold
PAD = "x" * (INLINE_MAX_BYTES + 1024)  # inputs too large for a control message: through the ingress


def _chain(connector: dict) -> dict:
    """a -> d over one connector `net` (mesh_handlers' `step`: d answers a summary)."""
    return {
        "name": "listeners",
        "connectors": {"net": connector},
        "stages": [
            {
                "stage_id": 0,
                "name": "a",
                "handler": "mesh_handlers:step",
                "output_connectors": {"to_stage_1": "net"},
            },
            {
                "stage_id": 1,
                "name": "d",
                "handler": "mesh_handlers:step",
                "engine_input_source": [0],
                "input_connectors": {"from_stage_0": "net"},
                "final_output": True,
            },
        ],
    }


ZMQ = _chain({"name": "ZmqConnector", "extra": {"memory_pool_size": 16 << 20}})
MOONCAKE = _chain({"name": "MooncakeTransferEngineConnector", "extra": {"memory_pool_size": 16 << 20}})


def documented() -> dict[str, str]:
    """{socket: where `omni-mesh up` binds it}, from the table under "What listens where"."""
    section = SECURITY.read_text(encoding="utf-8").split("## What listens where", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    table = {cells[0].strip(): cells[2].strip() for cells in rows[2:]}  # past the header and its rule
    assert table, f"{SECURITY}: no table under 'What listens where'"
    return table


def allowed(label: str) -> tuple[str, ...]:
    """The addresses the table allows for `label` under `omni-mesh up`."""
    table = documented()
    assert label in table, f"{SECURITY} does not list {label!r}: it lists {sorted(table)}"
    where = table[label]
    if where.startswith("every interface"):
        return EVERY_INTERFACE
    assert where.startswith("127.0.0.1"), f"{SECURITY}: {label!r}: unexpected address {where!r}"
    return ("127.0.0.1",)


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _port(endpoint: str | None) -> int | None:
    return int(endpoint.rsplit(":", 1)[1]) if endpoint else None


def labelled(mesh: Mesh) -> list[tuple[str, str, Listener]]:
    """(process, socket label, listener) for every listening socket of every process of the mesh;
    a socket this test cannot name is labelled "unknown"."""
    stats = mesh.client.get("/v1/stats", timeout=10).json()
    connectors = {stage: replicas[0]["connectors"] for stage, replicas in mesh.stages().items()}
    found = [("launcher", "unknown", sock) for sock in listening(mesh.process.pid)]
    for pid in sorted(descendants(mesh.process.pid)):
        argv = _argv(pid)
        if "coordinator" in argv:
            names = {
                urlsplit(mesh.url).port: "REST API",
                _port(_after(argv, "--control")): "control plane",
                _port((stats.get("ingress") or {}).get("endpoint")): "ingress side channel",
            }
            for sock in listening(pid):
                label = names.get(sock.port) or ("ingress bulk socket" if stats.get("ingress") else "unknown")
                found.append(("coordinator", label, sock))
        elif "stage" in argv:
            stage = _after(argv, "--stage")
            health = connectors[stage].get("net", {})
            kind = "ZmqConnector" if "bulk_transfers" in health else "Mooncake"
            for sock in listening(pid):
                if sock.port == _port(health.get("endpoint")):
                    label = (
                        "ZmqConnector side channel"
                        if kind == "ZmqConnector"
                        else "transfer-engine side channel"
                    )
                else:
                    label = (
                        "ZmqConnector bulk socket" if kind == "ZmqConnector" else "Mooncake transfer engine"
                    )
                found.append((stage, label, sock))
        else:
            found.extend((f"pid {pid} {' '.join(argv)}", "unknown", sock) for sock in listening(pid))
    return found


def check_against_docs(found: list[tuple[str, str, Listener]]) -> None:
    wrong = [
        f"{process}: {label} on {sock}"
        for process, label, sock in found
        if label == "unknown" or sock.address not in allowed(label)
    ]
    assert not wrong, f"sockets not where {SECURITY.name} says `omni-mesh up` binds them: {wrong}"


def _serve_one(mesh: Mesh) -> None:
    body = mesh.ok({"n": N, "pad": PAD})
    assert body["outputs"]["trail"] == ["a", "d"] and body["outputs"]["n"] == N


@pytest.fixture(scope="module")
def zmq_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("zmq"), ZMQ, sig=signal.SIGINT) as mesh:
        yield mesh


def test_a_zmq_mesh_listens_only_on_loopback(zmq_mesh: Mesh) -> None:
    _serve_one(zmq_mesh)
    assert zmq_mesh.connector_health("a")["net"]["bulk_transfers"] >= 1  # the bulk socket was used
    found = labelled(zmq_mesh)
    labels = {(process, label) for process, label, _ in found}
    # Every socket of the table's that this mesh opens is there (so the check below checked them).
    assert labels >= {
        ("coordinator", "REST API"),
        ("coordinator", "control plane"),
        ("coordinator", "ingress side channel"),
        ("coordinator", "ingress bulk socket"),
        ("a", "ZmqConnector side channel"),
        ("a", "ZmqConnector bulk socket"),
    }, found
    assert not [entry for entry in found if entry[0] == "d"], f"a consumer listens: {found}"
    check_against_docs(found)


def test_the_mooncake_engine_ports_are_the_documented_exception(tmp_path: Path) -> None:
    """Mooncake's library binds its own ports on every interface; omni-mesh's side channel of the
    connector stays on loopback."""
    with running_mesh(tmp_path, MOONCAKE, sig=signal.SIGINT) as mesh:
        _serve_one(mesh)
        found = labelled(mesh)
        assert (
            "connector 'net' (MooncakeTransferEngineConnector): Mooncake's transfer engine listens"
            in mesh.log()
        )
    labels = {(process, label) for process, label, _ in found}
    assert labels >= {("a", "transfer-engine side channel"), ("a", "Mooncake transfer engine")}, found
    check_against_docs(found)


def test_connector_host_asks_for_an_address(tmp_path: Path) -> None:
    """`--connector-host` is what `host: auto` binds under `up`; an address in the topology wins."""
    wide = _chain({"name": "ZmqConnector", "extra": {"memory_pool_size": 16 << 20}})
    with running_mesh(tmp_path / "flag", wide, "--connector-host", "0.0.0.0", sig=signal.SIGINT) as mesh:
        _serve_one(mesh)
        flag = {sock.address for process, _, sock in labelled(mesh) if process == "a"}
    pinned = _chain({"name": "ZmqConnector", "extra": {"memory_pool_size": 16 << 20, "host": "0.0.0.0"}})
    with running_mesh(tmp_path / "topology", pinned, sig=signal.SIGINT) as mesh:
        _serve_one(mesh)
        written = {sock.address for process, _, sock in labelled(mesh) if process == "a"}
    assert flag == written == {"0.0.0.0"}, (flag, written)


def test_the_auto_rule_takes_the_address_up_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONNECTOR_HOST_ENV, raising=False)
    outward = outward_address()
    assert bind_and_advertise("auto") == (outward, outward)  # compose, Kubernetes: the default route's
    monkeypatch.setenv(CONNECTOR_HOST_ENV, "127.0.0.1")
    assert bind_and_advertise(" auto ") == ("127.0.0.1", "127.0.0.1")
    assert bind_and_advertise("10.1.2.3") == ("10.1.2.3", "10.1.2.3")  # an address written wins
    monkeypatch.setenv(CONNECTOR_HOST_ENV, "0.0.0.0")
    assert bind_and_advertise("auto") == ("0.0.0.0", outward)  # every interface, advertised reachably


def test_a_connector_host_that_is_no_address_is_refused(tmp_path: Path) -> None:
    path = write_topology(tmp_path, ZMQ)
    result = subprocess.run(
        up_command(path, free_port(), "--connector-host", "eth0"), capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0, result
    assert "--connector-host must be an IP address" in result.stderr and "'eth0'" in result.stderr, (
        result.stderr
    )
