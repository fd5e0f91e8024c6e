"""Values several modules share live once, in omni_mesh/defaults.py (a module that imports nothing):
no module repeats one to stay light, and the CLI's defaults are those values."""

from __future__ import annotations

import ast
from pathlib import Path

from omni_mesh import cli, defaults, launcher, security, stage, watchdog
from omni_mesh.bench import mesh
from omni_mesh.coordinator.http import limits as http_limits
from omni_mesh.coordinator.scheduling import registry, service

PACKAGE = Path(defaults.__file__).parent
SHARED = {name for name in vars(defaults) if name.isupper()}


def test_no_module_assigns_a_shared_value_of_its_own() -> None:
    """An assignment of one of defaults.py's names anywhere else is a copy that can drift."""
    copies = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "defaults.py":
            continue
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            copies += [f"{path.relative_to(PACKAGE)}: {t.id}" for t in targets if isinstance(t, ast.Name) and t.id in SHARED]
    assert copies == [], copies


def test_the_old_names_are_the_shared_values() -> None:
    assert mesh.ENV_INSECURE is security.ENV_INSECURE is defaults.ENV_INSECURE
    assert launcher.INSTANCE_ENV is service.INSTANCE_ENV is defaults.INSTANCE_ENV
    assert (cli.HEADER_TIMEOUT_S, cli.BODY_TIMEOUT_S, cli.WRITE_TIMEOUT_S) == (
        http_limits.HEADER_TIMEOUT_S, http_limits.BODY_TIMEOUT_S, http_limits.WRITE_TIMEOUT_S
    )
    assert stage.HEARTBEAT_S == service.HEARTBEAT_S == defaults.HEARTBEAT_S


def test_the_coordinator_command_defaults_to_the_registry_heartbeat_timeout() -> None:
    args = cli._build_parser().parse_args(["coordinator", "topology.yaml"])
    assert args.heartbeat_timeout_s == registry.HEARTBEAT_TIMEOUT_S
    assert registry.Registry.__init__.__defaults__ == (registry.HEARTBEAT_TIMEOUT_S,)


def test_up_defaults_to_the_registry_heartbeat_timeout_and_the_watchdogs_limit() -> None:
    args = cli._build_parser().parse_args(["up", "topology.yaml"])
    assert args.heartbeat_timeout_s == registry.HEARTBEAT_TIMEOUT_S
    assert args.coordinator_watchdog_s == watchdog.UNRESPONSIVE_S
    assert args.control_port is None  # a free port, picked at start
