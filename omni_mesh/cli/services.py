"""The commands that run services: `coordinator`, `stage`, and `up` (the coordinator and every
replica as local processes), with the REST front door's flags `coordinator` and `up` share."""

from __future__ import annotations

import argparse
import ipaddress
import os
from typing import TYPE_CHECKING

from omni_mesh.cli.common import EXIT_OK, CliError, Command, Declare, HelpWithDefaults
from omni_mesh.defaults import BODY_TIMEOUT_S as BODY_TIMEOUT_S
from omni_mesh.defaults import CONNECTOR_HOST_ENV, COORDINATOR_UNRESPONSIVE_S, HEARTBEAT_TIMEOUT_S
from omni_mesh.defaults import HEADER_TIMEOUT_S as HEADER_TIMEOUT_S
from omni_mesh.defaults import WRITE_TIMEOUT_S as WRITE_TIMEOUT_S
from omni_mesh.port_checks import check_ports
from omni_mesh.topology import Topology, load_topology

if TYPE_CHECKING:
    from omni_mesh.media.limits import MediaLimits


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


# The REST front door, shared by `coordinator` and `up` (which hands them to its coordinator).
ENV_API_KEY = "OMNI_MESH_API_KEY"


def _add_rest_flags(parser: argparse.ArgumentParser) -> None:
    rest = parser.add_argument_group("REST front door")
    rest.add_argument(
        "--api-key", metavar="KEY", default=None,
        help=f"clients must send 'Authorization: Bearer KEY' on every route but /health and /dashboard's page "
        f"(default: ${ENV_API_KEY}; "
        "unset: no key). Prefer the variable: a flag's value shows in ps",
    )
    rest.add_argument(
        "--ssl-certfile", metavar="PEM", default=os.environ.get("OMNI_MESH_SSL_CERTFILE"),
        help="serve HTTPS with this certificate (chain); needs --ssl-keyfile ($OMNI_MESH_SSL_CERTFILE)",
    )
    rest.add_argument(
        "--ssl-keyfile", metavar="PEM", default=os.environ.get("OMNI_MESH_SSL_KEYFILE"),
        help="the certificate's private key ($OMNI_MESH_SSL_KEYFILE)",
    )
    rest.add_argument(
        "--header-timeout-s", type=float, default=HEADER_TIMEOUT_S,
        help="a client that has not sent a request's headers by then is answered 408 and closed",
    )
    rest.add_argument(
        "--body-timeout-s", type=float, default=BODY_TIMEOUT_S,
        help="the same for the body, counted from the end of the headers (16 MiB in 10 s: 1.7 MB/s)",
    )
    rest.add_argument(
        "--write-timeout-s", type=float, default=WRITE_TIMEOUT_S,
        help="a client that reads nothing of its answer for this long is cut off and its answer dropped",
    )
    _add_media_flags(parser)


def _add_media_flags(parser: argparse.ArgumentParser) -> None:
    from omni_mesh.media.limits import ENV, MediaLimits

    try:
        env = MediaLimits.from_env()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    media = parser.add_argument_group("media in requests (also read by every stage from the environment)")
    for flag, name, kind, what in (
        ("--media-max-bytes", "max_bytes", int, "bytes of one media part"),
        ("--media-max-image-pixels", "max_image_pixels", int, "width x height of an image or video frame"),
        ("--media-max-audio-s", "max_audio_s", float, "seconds of one audio clip or audio track"),
        ("--media-max-video-frames", "max_video_frames", int, "frames of one video"),
        ("--media-fetch-timeout-s", "fetch_timeout_s", float, "one remote media download"),
    ):
        media.add_argument(flag, type=kind, default=getattr(env, name), help=f"at most: {what} (${ENV[name]})")
    media.add_argument(
        "--allowed-media-domains", metavar="D1,D2", default=",".join(env.allowed_domains),
        help="domains (and their subdomains) whose http(s) media URLs the coordinator fetches; empty: remote "
        f"media off, no connection is made (${ENV['allowed_domains']})",
    )


def _media_limits(args: argparse.Namespace) -> MediaLimits:
    from omni_mesh.media.limits import MediaLimits, domains

    try:
        return MediaLimits(
            max_bytes=args.media_max_bytes, max_image_pixels=args.media_max_image_pixels,
            max_audio_s=args.media_max_audio_s, max_video_frames=args.media_max_video_frames,
            allowed_domains=domains(args.allowed_media_domains), fetch_timeout_s=args.media_fetch_timeout_s,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _rest_settings(args: argparse.Namespace) -> dict:
    """The REST flags, checked, as serve()'s keyword arguments."""
    key = args.api_key if args.api_key is not None else os.environ.get(ENV_API_KEY)
    tls = {"ssl_certfile": args.ssl_certfile or None, "ssl_keyfile": args.ssl_keyfile or None}
    if bool(tls["ssl_certfile"]) != bool(tls["ssl_keyfile"]):
        raise CliError("HTTPS needs both --ssl-certfile and --ssl-keyfile (PEM files); pass both, or neither")
    for name, path in tls.items():
        if path and not os.access(path, os.R_OK):
            raise CliError(f"--{name.replace('_', '-')} {path}: no such readable file")
    for name in ("header_timeout_s", "body_timeout_s", "write_timeout_s"):
        if not getattr(args, name) > 0:
            raise CliError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    return {"api_key": key or None, **tls, "header_timeout_s": args.header_timeout_s,
            "body_timeout_s": args.body_timeout_s, "write_timeout_s": args.write_timeout_s,
            "media_limits": _media_limits(args)}


def _add_coordinator(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "coordinator",
        help="run the coordinator (REST API, replica registry, dispatch) alone",
        description="Run the coordinator service. Stage replicas connect to its control endpoint.",
        formatter_class=HelpWithDefaults,
    )
    parser.add_argument("topology", metavar="TOPOLOGY", nargs="?", default=os.environ.get("OMNI_MESH_TOPOLOGY"))
    # Loopback unless told otherwise; a container sets OMNI_MESH_HOST=0.0.0.0 to publish the port.
    parser.add_argument("--host", default=_env("OMNI_MESH_HOST", "127.0.0.1"), help="REST bind address ($OMNI_MESH_HOST)")
    parser.add_argument("--port", type=int, default=int(_env("OMNI_MESH_PORT", "8000")), help="REST port")
    # The control plane too: replicas on other hosts need it opened explicitly (tcp://0.0.0.0:5555 in a
    # container; the exported compose files and manifests set OMNI_MESH_CONTROL_BIND).
    parser.add_argument(
        "--control", default=_env("OMNI_MESH_CONTROL_BIND", "tcp://127.0.0.1:5555"),
        help="ZeroMQ control endpoint to bind; other hosts reach it only when told, e.g. tcp://0.0.0.0:5555 "
        "($OMNI_MESH_CONTROL_BIND)",
    )
    parser.add_argument("--timeout-s", type=float, default=float(_env("OMNI_MESH_TIMEOUT_S", "30")),
                        help="deadline of requests that set no timeout_s")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=HEARTBEAT_TIMEOUT_S, help="silence after which a replica is dead")
    parser.add_argument("--grace-s", type=float, default=10.0, help="time in-flight requests get on shutdown")
    parser.add_argument(
        "--max-control-connections", type=int, metavar="N",
        default=int(_env("OMNI_MESH_MAX_CONTROL_CONNECTIONS", "0")) or None,
        help="connections the control port holds at once; more are refused (default: a quarter of the "
        "open-file limit, at most 1024) ($OMNI_MESH_MAX_CONTROL_CONNECTIONS)",
    )
    parser.add_argument(
        "--max-rest-connections", type=int, metavar="N",
        default=int(_env("OMNI_MESH_MAX_REST_CONNECTIONS", "0")) or None,
        help="REST connections held at once; more are answered 503 and closed (default: half the "
        "open-file limit) ($OMNI_MESH_MAX_REST_CONNECTIONS)",
    )
    parser.add_argument("--reuse-port", action="store_true",
                        help="share the REST port with the mesh's other coordinators (SO_REUSEPORT)")
    parser.add_argument("--own-port", type=int, default=None, metavar="N",
                        help="a second REST port of this coordinator alone (`up --coordinators N` checks each on it)")
    _add_rest_flags(parser)
    return parser


def _cmd_coordinator(args: argparse.Namespace) -> int:
    import logging

    from omni_mesh import aio
    from omni_mesh.coordinator import serve

    topology = load_topology(_topology_arg(args))
    rest = _rest_settings(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    aio.run(
        serve(
            topology,
            host=args.host,
            port=args.port,
            control=args.control,
            default_timeout_s=args.timeout_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            grace_s=args.grace_s,
            max_control_connections=args.max_control_connections,
            max_rest_connections=args.max_rest_connections,
            reuse_port=args.reuse_port,
            own_port=args.own_port,
            **rest,
        )
    )
    return EXIT_OK


def _add_stage(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "stage",
        help="run one replica of one stage",
        description="Run one stage replica; it registers with the coordinator at --coordinator.",
    )
    parser.add_argument("topology", metavar="TOPOLOGY", nargs="?", default=os.environ.get("OMNI_MESH_TOPOLOGY"))
    parser.add_argument("--stage", default=os.environ.get("OMNI_MESH_STAGE"), help="stage name or id")
    parser.add_argument(
        "--coordinator", default=_env("OMNI_MESH_COORDINATOR", "tcp://127.0.0.1:5555"),
        help="coordinator control endpoint; several coordinators: every one's, comma-separated"
    )
    parser.add_argument("--replica", default=os.environ.get("OMNI_MESH_REPLICA"), help="replica id (default: stage-host-pid)")
    parser.add_argument("--host", default=os.environ.get("OMNI_MESH_ADVERTISE_HOST"), help="host name to report")
    parser.add_argument(
        "--health-file",
        default=os.environ.get("OMNI_MESH_HEALTH_FILE"),
        help="touched at every heartbeat while registered (for container health checks)",
    )
    return parser


def _cmd_stage(args: argparse.Namespace) -> int:
    from omni_mesh.stage import main_stage

    topology = load_topology(_topology_arg(args))
    if not args.stage:
        raise CliError("which stage? pass --stage NAME (or set OMNI_MESH_STAGE)")
    stage = topology.stage(int(args.stage) if args.stage.isdigit() else args.stage)
    if not stage.runnable:
        raise CliError(
            f"stage {stage.name!r} ({stage.stage_id}) has no handler: set `handler: module:function` or `engine:`"
        )
    return main_stage(
        topology, stage.name, args.coordinator, replica_id=args.replica, host=args.host, health_file=args.health_file
    )


def _add_up(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "up",
        help="run the coordinator and every stage replica locally",
        description="Start the coordinator and every replica as local processes; Ctrl-C stops them all.",
        formatter_class=HelpWithDefaults,
    )
    parser.add_argument("topology", metavar="TOPOLOGY")
    add_up_flags(parser)
    return parser


def add_up_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `up` but its TOPOLOGY (`serve` takes them too)."""
    parser.add_argument("--host", default="127.0.0.1", help="REST bind address")
    parser.add_argument("--port", type=int, default=8000, help="REST port")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="deadline of requests that set no timeout_s")
    parser.add_argument(
        "--ready-timeout-s", type=float, default=os.environ.get("OMNI_MESH_READY_TIMEOUT_S"),
        help="how long the mesh may take to become ready; default 60 s, or 600 s when a stage runs an "
        "engine: (it loads its model first) ($OMNI_MESH_READY_TIMEOUT_S)",
    )
    parser.add_argument(
        "--control-port", type=int, default=None, metavar="N",
        help="the control plane's port, on 127.0.0.1 (default: a free port, picked at start)",
    )
    parser.add_argument(
        "--connector-host", metavar="ADDR", default=_env(CONNECTOR_HOST_ENV, "127.0.0.1"),
        help="where connectors with `host: auto` bind and advertise (ZmqConnector, the transfer engines' side "
        "channels); `auto`: the default route's interface; an address the topology writes wins "
        f"(${CONNECTOR_HOST_ENV})",
    )
    parser.add_argument(
        "--heartbeat-timeout-s", type=float, default=HEARTBEAT_TIMEOUT_S,
        help="silence after which the coordinator takes a replica out",
    )
    parser.add_argument(
        "--coordinators", type=int, default=1, metavar="N",
        help="coordinator processes sharing the REST port (SO_REUSEPORT), each restarted when it dies",
    )
    parser.add_argument(
        "--coordinator-watchdog-s", type=float, default=COORDINATOR_UNRESPONSIVE_S, metavar="S",
        help="the coordinator is asked /health every 2 s; silent this long, it is killed and restarted "
        "(0: never)",
    )
    parser.add_argument(
        "--max-replicas-total", type=int, default=None, metavar="N",
        help="the most stage replicas to run on this host in all, autoscaled ones included (default: the "
        "CPU count, at least the starting replicas)",
    )
    parser.add_argument(
        "--min-free-memory", default=None, metavar="SIZE",
        help="memory autoscaling leaves free: no replica starts where the host's available memory, less "
        "the replica's size, would fall below it (e.g. 2GiB; default: 10%% of the host's memory)",
    )
    _add_rest_flags(parser)


def _cmd_up(args: argparse.Namespace) -> int:
    return run_topology(load_topology(args.topology), args)


def run_topology(topology: Topology, args: argparse.Namespace) -> int:
    """`up` of a loaded topology with add_up_flags' arguments: until a signal stops it."""
    from omni_mesh.launcher import run_up

    rest = _rest_settings(args)
    # The coordinator reads the key from its environment, which it inherits: never from its argv,
    # which ps shows to every user of the machine.
    # The media limits too, for the coordinator and every stage (which decodes media) alike.
    os.environ.update(rest.pop("media_limits").env())
    if rest["api_key"]:
        os.environ[ENV_API_KEY] = rest["api_key"]
    else:
        os.environ.pop(ENV_API_KEY, None)
    try:
        check_ports(args.host, args.port, args.control_port)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not args.coordinator_watchdog_s >= 0:
        raise CliError(f"--coordinator-watchdog-s must be >= 0 seconds (0: off), got {args.coordinator_watchdog_s}")
    if getattr(args, "coordinators", 1) < 1:
        raise CliError(f"--coordinators must be at least 1, got {args.coordinators}")
    if not args.heartbeat_timeout_s > 0:
        raise CliError(f"--heartbeat-timeout-s must be > 0 seconds, got {args.heartbeat_timeout_s}")
    coordinator_args = [
        "--timeout-s", str(args.timeout_s),
        "--heartbeat-timeout-s", str(args.heartbeat_timeout_s),
        "--header-timeout-s", str(rest["header_timeout_s"]),
        "--body-timeout-s", str(rest["body_timeout_s"]),
        "--write-timeout-s", str(rest["write_timeout_s"]),
    ]
    try:
        return run_up(
            topology, host=args.host, port=args.port, coordinator_args=coordinator_args,
            ready_timeout_s=_ready_timeout_s(args.ready_timeout_s, topology),
            api_key=rest["api_key"], ssl_certfile=rest["ssl_certfile"], ssl_keyfile=rest["ssl_keyfile"],
            control_port=args.control_port, unresponsive_s=args.coordinator_watchdog_s,
            max_replicas_total=args.max_replicas_total, min_free_memory=_min_free_memory(args.min_free_memory),
            connector_host=_connector_host(args.connector_host), coordinator_count=getattr(args, "coordinators", 1),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _min_free_memory(value: str | None) -> int | None:
    """`--min-free-memory` in bytes (a ValueError naming the flag where it is not a size)."""
    from omni_mesh.connectors.config.fields import parse_size

    return None if value is None else parse_size(int(value) if value.isdigit() else value, what="--min-free-memory")


def _connector_host(value: str) -> str:
    """--connector-host, checked: an IP address, or `auto` (the connectors' own rule)."""
    value = value.strip()
    if value.lower() == "auto":
        return "auto"
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise CliError(
            f"--connector-host must be an IP address (127.0.0.1, 0.0.0.0 for every interface, this host's "
            f"address) or auto (the address of the default route's interface), got {value!r}"
        ) from None


def _ready_timeout_s(value: float | str | None, topology: Topology) -> float:
    if value is not None:
        return float(value)
    return 600.0 if any(stage.engine is not None for stage in topology.stages) else 60.0


def _topology_arg(args: argparse.Namespace) -> str:
    if not args.topology:
        raise CliError("which topology? pass TOPOLOGY (or set OMNI_MESH_TOPOLOGY)")
    return args.topology


COMMANDS: dict[str, tuple[Declare, Command]] = {
    "up": (_add_up, _cmd_up),
    "coordinator": (_add_coordinator, _cmd_coordinator),
    "stage": (_add_stage, _cmd_stage),
}
