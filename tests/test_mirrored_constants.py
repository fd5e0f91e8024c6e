"""Values some light modules repeat rather than import (importing would load uvicorn, zmq or the
coordinator on every CLI call): each copy must still say what the original says."""

from __future__ import annotations

from omni_mesh import cli, launcher, security, stage, watchdog
from omni_mesh.bench import mesh
from omni_mesh.coordinator import http_limits, registry, service


def test_each_repeated_value_matches_its_original() -> None:
    assert mesh.ENV_INSECURE == security.ENV_INSECURE
    assert launcher.INSTANCE_ENV == service.INSTANCE_ENV
    assert (cli.HEADER_TIMEOUT_S, cli.BODY_TIMEOUT_S) == (http_limits.HEADER_TIMEOUT_S, http_limits.BODY_TIMEOUT_S)
    assert cli.WRITE_TIMEOUT_S == http_limits.WRITE_TIMEOUT_S
    assert stage.HEARTBEAT_S == service.HEARTBEAT_S  # the stage's interval until the coordinator announces one


def test_the_coordinator_command_defaults_to_the_registry_heartbeat_timeout() -> None:
    args = cli._build_parser().parse_args(["coordinator", "topology.yaml"])
    assert args.heartbeat_timeout_s == registry.HEARTBEAT_TIMEOUT_S
    assert registry.Registry.__init__.__defaults__ == (registry.HEARTBEAT_TIMEOUT_S,)


def test_up_defaults_to_the_registry_heartbeat_timeout_and_the_watchdogs_limit() -> None:
    args = cli._build_parser().parse_args(["up", "topology.yaml"])
    assert args.heartbeat_timeout_s == registry.HEARTBEAT_TIMEOUT_S
    assert args.coordinator_watchdog_s == watchdog.UNRESPONSIVE_S
    assert args.control_port is None  # a free port, picked at start
