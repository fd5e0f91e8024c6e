"""The `omni-mesh` command.

Each subcommand is a `_cmd_<name>(args) -> int` function plus a `_add_<name>(subparsers)` that
declares its arguments; both are registered once, in `_COMMANDS`. A command reports a user error by
raising `CliError` (or `TopologyError`): `main` prints `error: <message>` on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence

from omni_mesh.topology import Topology, TopologyError, load_topology

EXIT_OK = 0
EXIT_USAGE = 2  # argparse's code for bad usage; also used for invalid input files


class CliError(Exception):
    """A user-facing failure: printed as `error: <message>`, exit status 2."""


# --------------------------------------------------------------------------------------------------
# validate


def _add_validate(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "validate",
        help="check a topology file and print its stages and edges",
        description="Check a topology file (graph, connectors, their extra: settings) without starting anything.",
    )
    parser.add_argument("topology", metavar="TOPOLOGY", help="path to the topology YAML file")
    parser.add_argument("--json", action="store_true", help="print the validated topology as JSON")
    parser.add_argument(
        "--no-import", action="store_true",
        help="check the file only; by default each stage's handler is imported, as its stage would",
    )
    return parser


def _cmd_validate(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology)
    broken = [] if args.no_import else unimportable_handlers(topology)
    if args.json:
        print(json.dumps(topology.to_dict(), indent=2, sort_keys=False, default=str))
    else:
        print(format_summary(topology))
        named = [s for s in topology.stages if s.handler]
        if named and not args.no_import:
            print(f"handlers: {len(named) - len(broken)} of {len(named)} import")
    for problem in broken:
        print(f"error: {problem}", file=sys.stderr)
    return EXIT_USAGE if broken else EXIT_OK


def unimportable_handlers(topology: Topology) -> list[str]:
    """Import every stage's handler as its stage process would; what fails, one message each."""
    from omni_mesh.stage import load_handler

    problems = []
    for stage in topology.stages:
        if stage.handler:
            try:
                load_handler(topology, stage)
            except ValueError as exc:
                problems.append(str(exc))
    return problems


def format_summary(topology: Topology) -> str:
    """A human-readable account of a validated topology (what `validate` prints)."""
    entries = {stage.stage_id for stage in topology.entry_stages}
    finals = {stage.stage_id for stage in topology.final_stages}
    lines = [f"topology {topology.name!r} is valid" + (f" ({topology.path})" if topology.path else "")]
    if topology.graph_from:
        lines.append(f"graph: from omni-mesh's built-in copy of {topology.graph_from}")
    lines.append(f"stages ({len(topology.stages)}):")
    for stage in topology.stages:
        roles = [
            role
            for role, on in (("entry", stage.stage_id in entries), ("final", stage.stage_id in finals))
            if on
        ]
        lines.append(
            f"  {stage.stage_id}  {stage.name}  replicas={stage.replicas} max_inflight={stage.max_inflight}"
            f"  handler={stage.handler or '-'}" + (f"  [{', '.join(roles)}]" if roles else "")
            + f"  max_queued={stage.queue_limit()}" + ("" if stage.max_queued is not None else " (default)")
        )
    lines.append(f"edges ({len(topology.edges)}):")
    for edge in topology.edges:
        src, dst = topology.stage(edge.src).name, topology.stage(edge.dst).name
        auto = " (auto)" if edge.connector.auto else ""
        lines.append(
            f"  {edge.label}  {src} -> {dst}  via {edge.connector.name} [{edge.connector.ref}]{auto}"
        )
    if not topology.edges:
        lines.append("  (none)")
    used = {edge.connector.ref for edge in topology.edges}
    spare = [f"{ref} ({spec.name})" for ref, spec in topology.connectors.items() if ref not in used]
    if spare:
        lines.append(f"connectors no edge uses: {', '.join(spare)}")
    lines.extend(f"warning: {warning}" for warning in topology.warnings)
    missing = topology.missing_handlers()
    if missing:
        who = ", ".join(f"{stage.stage_id} {stage.name!r}" for stage in missing)
        lines.append(
            f"note: {len(missing)} stage(s) have no handler: {who}; `omni-mesh up` needs a "
            "handler: module:function on every stage"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# services: coordinator, stage, up


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where it has none: a secret such as the API key is
    read from the environment after parsing, so --help can never print it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


# The REST front door, shared by `coordinator` and `up` (which hands them to its coordinator).
ENV_API_KEY = "OMNI_MESH_API_KEY"
HEADER_TIMEOUT_S = 5.0  # = omni_mesh.coordinator.http_limits' defaults (not imported: it loads uvicorn)
BODY_TIMEOUT_S = 10.0


def _add_rest_flags(parser: argparse.ArgumentParser) -> None:
    rest = parser.add_argument_group("REST front door")
    rest.add_argument(
        "--api-key", metavar="KEY", default=None,
        help=f"clients must send 'Authorization: Bearer KEY' on every route but /health (default: ${ENV_API_KEY}; "
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


def _rest_settings(args: argparse.Namespace) -> dict:
    """The REST flags, checked, as serve()'s keyword arguments."""
    key = args.api_key if args.api_key is not None else os.environ.get(ENV_API_KEY)
    tls = {"ssl_certfile": args.ssl_certfile or None, "ssl_keyfile": args.ssl_keyfile or None}
    if bool(tls["ssl_certfile"]) != bool(tls["ssl_keyfile"]):
        raise CliError("HTTPS needs both --ssl-certfile and --ssl-keyfile (PEM files); pass both, or neither")
    for name, path in tls.items():
        if path and not os.access(path, os.R_OK):
            raise CliError(f"--{name.replace('_', '-')} {path}: no such readable file")
    for name in ("header_timeout_s", "body_timeout_s"):
        if not getattr(args, name) > 0:
            raise CliError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    return {"api_key": key or None, **tls, "header_timeout_s": args.header_timeout_s,
            "body_timeout_s": args.body_timeout_s}


def _add_coordinator(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "coordinator",
        help="run the coordinator (REST API, replica registry, dispatch) alone",
        description="Run the coordinator service. Stage replicas connect to its control endpoint.",
        formatter_class=_HelpWithDefaults,
    )
    parser.add_argument("topology", metavar="TOPOLOGY", nargs="?", default=os.environ.get("OMNI_MESH_TOPOLOGY"))
    # Loopback unless told otherwise; a container sets OMNI_MESH_HOST=0.0.0.0 to publish the port.
    parser.add_argument("--host", default=_env("OMNI_MESH_HOST", "127.0.0.1"), help="REST bind address ($OMNI_MESH_HOST)")
    parser.add_argument("--port", type=int, default=int(_env("OMNI_MESH_PORT", "8000")), help="REST port")
    parser.add_argument(
        "--control", default=_env("OMNI_MESH_CONTROL_BIND", "tcp://0.0.0.0:5555"), help="ZeroMQ control endpoint to bind"
    )
    parser.add_argument("--timeout-s", type=float, default=float(_env("OMNI_MESH_TIMEOUT_S", "30")),
                        help="deadline of requests that set no timeout_s")
    # = coordinator.registry.HEARTBEAT_TIMEOUT_S (not imported: parsing must stay light)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=5.0, help="silence after which a replica is dead")
    parser.add_argument("--grace-s", type=float, default=10.0, help="time in-flight requests get on shutdown")
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
        "--coordinator", default=_env("OMNI_MESH_COORDINATOR", "tcp://127.0.0.1:5555"), help="coordinator control endpoint"
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
    if not stage.handler:
        raise CliError(f"stage {stage.name!r} ({stage.stage_id}) has no handler: set `handler: module:function`")
    return main_stage(
        topology, stage.name, args.coordinator, replica_id=args.replica, host=args.host, health_file=args.health_file
    )


def _add_up(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "up",
        help="run the coordinator and every stage replica locally",
        description="Start the coordinator and every replica as local processes; Ctrl-C stops them all.",
        formatter_class=_HelpWithDefaults,
    )
    parser.add_argument("topology", metavar="TOPOLOGY")
    parser.add_argument("--host", default="127.0.0.1", help="REST bind address")
    parser.add_argument("--port", type=int, default=8000, help="REST port")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="deadline of requests that set no timeout_s")
    _add_rest_flags(parser)
    return parser


def _cmd_up(args: argparse.Namespace) -> int:
    from omni_mesh.launcher import run_up

    topology = load_topology(args.topology)
    rest = _rest_settings(args)
    # The coordinator reads the key from its environment, which it inherits: never from its argv,
    # which ps shows to every user of the machine.
    if rest["api_key"]:
        os.environ[ENV_API_KEY] = rest["api_key"]
    else:
        os.environ.pop(ENV_API_KEY, None)
    coordinator_args = [
        "--timeout-s", str(args.timeout_s),
        "--header-timeout-s", str(rest["header_timeout_s"]),
        "--body-timeout-s", str(rest["body_timeout_s"]),
    ]
    try:
        return run_up(
            topology, host=args.host, port=args.port, coordinator_args=coordinator_args,
            api_key=rest["api_key"], ssl_certfile=rest["ssl_certfile"], ssl_keyfile=rest["ssl_keyfile"],
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _add_bench(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="benchmarks: a connector, or a running pipeline")
    kinds = parser.add_subparsers(dest="bench", metavar="KIND", required=True)
    connector = kinds.add_parser("connector", help="cross-process put->get through one connector vs memcpy and raw")
    connector.add_argument("--connector", default="SharedMemoryConnector", help="connector name")
    connector.add_argument("--config", default="{}", help="the connector's extra: mapping, as JSON")
    connector.add_argument("--sizes", default=None, help="comma-separated sizes (default 4KiB,1MiB,16MiB,256MiB)")
    connector.add_argument("--no-raw", action="store_true", help="skip the raw-library baseline")
    connector.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where the payload tensor lives (cuda: vs device copy_)"
    )
    connector.add_argument(
        "--start-worker",
        action="store_true",
        help="YuanrongConnector: start a throwaway datasystem worker on loopback for the run (dscli)",
    )
    connector.add_argument(
        "--zero-copy",
        action="store_true",
        help="allocate each payload with connector.empty() (its memory), so the put copies nothing",
    )
    connector.add_argument("--json", action="store_true", help="print the results as JSON")
    pipeline = kinds.add_parser("pipeline", help="drive a mesh over HTTP with concurrent clients")
    pipeline.add_argument("--url", default=None, help="coordinator URL of a running mesh")
    pipeline.add_argument("--topology", default=None, help="start this topology with `up` for the run instead")
    pipeline.add_argument("--concurrency", type=int, default=32)
    pipeline.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    pipeline.add_argument("--inputs", default='{"prompt": "Hello"}', help="request inputs, as JSON")
    pipeline.add_argument("--params", default="{}", help="request params, as JSON")
    pipeline.add_argument("--timeout-s", type=float, default=30.0)
    pipeline.add_argument(
        "--security", choices=["both", "on", "off"], default=None,
        help="with --topology: measure the control plane with CURVE on, off (OMNI_MESH_INSECURE=1), or both "
        "in alternating rounds, each on a fresh mesh (default: both). --url measures the mesh as it runs",
    )
    pipeline.add_argument("--rounds", type=int, default=3, help="with --topology: rounds per security mode")
    pipeline.add_argument(
        "--stream", action="store_true",
        help="send stream: true and read the events: time to the first chunk and to the first audio chunk",
    )
    pipeline.add_argument("--json", action="store_true", help="print the results as JSON")
    chaos = kinds.add_parser(
        "chaos", help="soak: checked load while replicas are SIGKILLed; non-zero exit if an invariant breaks"
    )
    chaos.add_argument(
        "--topology", default=None,
        help="a chain of omni_mesh.bench.chaos_handlers:step stages (default: 3 stages x --replicas, shared memory)",
    )
    chaos.add_argument("--replicas", type=int, default=2, help="replicas per stage of the default topology")
    chaos.add_argument("--duration", type=float, default=180.0, help="seconds of load and kills")
    chaos.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    chaos.add_argument("--kill-every", type=float, default=4.0, help="mean seconds between SIGKILLs")
    chaos.add_argument("--timeout-s", type=float, default=10.0, help="each request's deadline")
    chaos.add_argument("--seed", type=int, default=None, help="seed of the kill schedule (default: random, printed)")
    chaos.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "connector":
        from omni_mesh.bench import connector

        config = _json_arg(args.config, "--config")
        if args.device == "cuda" and not connector.torch.cuda.is_available():
            raise CliError("--device cuda: this machine has no CUDA device")
        sizes = connector.parse_sizes(args.sizes)
        with contextlib.ExitStack() as stack:
            if args.start_worker:
                if args.connector != "YuanrongConnector":
                    raise CliError("--start-worker starts a datasystem worker: it is for YuanrongConnector")
                from omni_mesh.testing.datasystem_worker import running_worker

                config = {**config, **stack.enter_context(running_worker()).config}
            result = connector.run(
                args.connector, config, sizes, raw=not args.no_raw, device=args.device, zero_copy=args.zero_copy
            )
        print(json.dumps(result, indent=2) if args.json else connector.report(result))
        return EXIT_OK
    if args.bench == "chaos":
        from omni_mesh.bench import chaos

        for flag in ("replicas", "duration", "concurrency", "kill_every", "timeout_s"):
            if not getattr(args, flag) > 0:
                raise CliError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
        try:
            result = chaos.run(
                topology=args.topology, duration_s=args.duration, concurrency=args.concurrency,
                kill_every_s=args.kill_every, timeout_s=args.timeout_s, seed=args.seed, replicas=args.replicas,
            )
        except ValueError as exc:  # not a chain of the chaos handler, or not a topology at all
            raise CliError(str(exc)) from None
        print(json.dumps(result, indent=2) if args.json else chaos.report(result))
        return 1 if chaos.broken(result) else EXIT_OK  # 1: an invariant broke (the report says which)
    from omni_mesh.bench import pipeline

    if bool(args.url) == bool(args.topology):
        raise CliError("pass exactly one of --url (a running mesh) or --topology (start one for the run)")
    if args.url and args.security:
        raise CliError("--security picks how the bench starts the mesh: it needs --topology, not --url")
    if args.rounds < 1:
        raise CliError(f"--rounds must be >= 1, got {args.rounds}")
    result = pipeline.run(
        url=args.url,
        topology=args.topology,
        concurrency=args.concurrency,
        duration_s=args.duration,
        inputs=_json_arg(args.inputs, "--inputs"),
        params=_json_arg(args.params, "--params"),
        timeout_s=args.timeout_s,
        security=args.security or "both",
        rounds=args.rounds,
        stream=args.stream,
    )
    print(json.dumps(result, indent=2) if args.json else pipeline.report(result))
    return EXIT_OK


# --------------------------------------------------------------------------------------------------
# status


def _add_status(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "status",
        help="a running mesh's stages, replicas, edges and rates, in the terminal",
        description="Show what /dashboard shows: each stage's replicas and health, in-flight and queued "
        "work, requests per second and latency, bytes per second on each edge.",
    )
    parser.add_argument("url", metavar="URL", nargs="?", default="http://127.0.0.1:8000", help="the coordinator")
    parser.add_argument("--watch", action="store_true", help="refresh every second until Ctrl-C")
    parser.add_argument("--api-key", default=None, help="the REST API key (default: $OMNI_MESH_API_KEY)")
    return parser


def _cmd_status(args: argparse.Namespace) -> int:
    import httpx

    from omni_mesh import status

    try:
        status.run(args.url, api_key=args.api_key or os.environ.get("OMNI_MESH_API_KEY"), watch=args.watch)
    except (httpx.HTTPError, RuntimeError) as exc:
        raise CliError(f"cannot read the mesh at {args.url}: {exc}") from None
    return EXIT_OK


# --------------------------------------------------------------------------------------------------
# export


def _add_export(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export",
        help="write a topology's Compose file or Kubernetes manifests",
        description="Generate deployment files from a topology, the one source of truth: a Compose file, or "
        "Kubernetes manifests (one YAML stream). To standard output, or to -o FILE.",
    )
    kinds = parser.add_subparsers(dest="export", metavar="KIND", required=True)
    compose = kinds.add_parser("compose", help="a Compose file: the coordinator and one scalable service per stage")
    k8s = kinds.add_parser("k8s", help="Kubernetes manifests: Deployments, Services, autoscalers, the keys Secret")
    for kind in (compose, k8s):
        kind.add_argument("topology", metavar="TOPOLOGY")
        kind.add_argument("-o", "--output", metavar="FILE", default=None, help="write FILE instead of standard output")
        kind.add_argument(
            "--context", metavar="DIR", default=None,
            help="the directory the image is built from (default: the nearest above TOPOLOGY with services/Dockerfile)",
        )
    compose.add_argument(
        "--network", choices=["bridge", "host"], default="bridge",
        help="bridge: services reach each other by name, REST published on 127.0.0.1; host: every service on "
        "the host's network, on 127.0.0.1 only",
    )
    compose.add_argument("--http-port", type=int, default=8000, help="with --network host: the REST port")
    compose.add_argument("--control-port", type=int, default=5555, help="with --network host: the control plane's port")
    k8s.add_argument("--image", default="omni-mesh:latest", help="the image every pod runs (push it where the cluster pulls)")
    k8s.add_argument("--name", default=None, help="prefix of every object's name (default: the topology's name)")
    k8s.add_argument(
        "--keys", metavar="PATH", default=None,
        help="put this mesh.key_secret (or DIR/mesh.key_secret) in the Secret; default: create the Secret yourself",
    )
    k8s.add_argument("--shm-size", default="2Gi", help="/dev/shm of a pod whose stages share memory")
    k8s.add_argument("--max-replicas", type=int, default=None, help="each autoscaler's ceiling (default: 4 x replicas)")
    return parser


def _cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from omni_mesh import export

    topology = load_topology(args.topology)
    output = Path(args.output) if args.output not in (None, "-") else None
    try:
        source = export.ImageSource.find(topology, args.context)
        if args.export == "compose":
            options = export.ComposeOptions(args.network, args.http_port, args.control_port)
            result = export.export_compose(topology, source, output, options)
        else:
            k8s = export.K8sOptions(args.image, args.name, args.keys, args.shm_size, args.max_replicas)
            result = export.export_k8s(topology, source, k8s)
        export.write(result.text, output)
    except (export.ExportError, OSError) as exc:
        raise CliError(str(exc)) from None
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return EXIT_OK


# --------------------------------------------------------------------------------------------------
# keys, and the security flags of the commands that run services


def _add_keys(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "keys",
        help="mesh keys: the CURVE key pair every service of one mesh shares",
        description="Write a new mesh key pair (DIR/mesh.key and DIR/mesh.key_secret, mode 0600). Give "
        "every coordinator and stage replica of the mesh the same DIR (--keys DIR, OMNI_MESH_KEYS_DIR, "
        "or a mounted secret). `omni-mesh up` needs none: it makes keys for its own processes.",
    )
    actions = parser.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    generate = actions.add_parser("generate", help="write a new key pair into DIR (never overwrites)")
    generate.add_argument("directory", metavar="DIR")
    return parser


def _cmd_keys(args: argparse.Namespace) -> int:
    from omni_mesh.security import MeshKeyError, MeshKeys

    try:
        path = MeshKeys.generate().write(args.directory)
    except (MeshKeyError, OSError) as exc:
        raise CliError(str(exc)) from None
    print(f"wrote {path} and {path.with_suffix('.key')}: mount the directory into every service of the mesh "
          f"and point OMNI_MESH_KEYS_DIR (or --keys) at it")
    return EXIT_OK


#: Commands that run services: they take --keys / --insecure; the long-running single services
#: refuse to start without keys unless --insecure says so (`up` makes its own).
_SECURED = ("up", "coordinator", "stage")


def _add_security_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keys", metavar="DIR", default=None,
        help="directory with the mesh keys (`omni-mesh keys generate DIR`; default: $OMNI_MESH_KEYS_DIR)",
    )
    parser.add_argument(
        "--insecure", action="store_true",
        help="run the control plane and side channels WITHOUT authentication or encryption (debugging only)",
    )


def _apply_security_flags(args: argparse.Namespace) -> None:
    from omni_mesh import security

    if args.insecure:
        os.environ[security.ENV_INSECURE] = "1"
    if args.keys:
        os.environ[security.ENV_KEYS_DIR] = args.keys
    try:
        keys = security.keys_from_environment()
    except security.MeshKeyError as exc:
        raise CliError(str(exc)) from None
    if keys is None and not security.insecure_requested() and args.command != "up":
        raise CliError(
            f"no mesh keys: run `omni-mesh keys generate DIR` once, then give every service of the mesh "
            f"--keys DIR (or {security.ENV_KEYS_DIR}=DIR); --insecure runs without authentication (debugging only)"
        )


def _json_arg(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{flag}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CliError(f"{flag}: expected a JSON object, got {text!r}")
    return value


def _topology_arg(args: argparse.Namespace) -> str:
    if not args.topology:
        raise CliError("which topology? pass TOPOLOGY (or set OMNI_MESH_TOPOLOGY)")
    return args.topology


# --------------------------------------------------------------------------------------------------
# registry and entry point

Command = Callable[[argparse.Namespace], int]
Declare = Callable[[argparse._SubParsersAction], argparse.ArgumentParser]

# name -> (declare its arguments, run it). New subcommands (up, stage, coordinator, bench) go here.
_COMMANDS: dict[str, tuple[Declare, Command]] = {
    "validate": (_add_validate, _cmd_validate),
    "up": (_add_up, _cmd_up),
    "coordinator": (_add_coordinator, _cmd_coordinator),
    "stage": (_add_stage, _cmd_stage),
    "bench": (_add_bench, _cmd_bench),
    "keys": (_add_keys, _cmd_keys),
    "status": (_add_status, _cmd_status),
    "export": (_add_export, _cmd_export),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-mesh",
        description="Run a multi-stage omni-modality inference pipeline as a mesh of asyncio services.",
    )
    from omni_mesh import __version__

    parser.add_argument("--version", action="version", version=f"omni-mesh {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (declare, run) in _COMMANDS.items():
        command = declare(subparsers)
        _show_defaults(command)
        command.set_defaults(_run=run)
        _add_logging_flags(command)
        if name in _SECURED:
            _add_security_flags(command)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every command's --help (and its subcommands', such as `bench pipeline`) shows the defaults."""
    parser.formatter_class = _HelpWithDefaults
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)


def _add_logging_flags(parser: argparse.ArgumentParser) -> None:
    from omni_mesh import logs

    parser.add_argument("--log-level", choices=logs.LEVELS, default=logs.default_level(),
                        help=f"log verbosity (${logs.ENV_LEVEL})")
    parser.add_argument("--log-format", choices=logs.FORMATS, default=logs.default_format(),
                        help=f"text lines or JSON lines (${logs.ENV_FORMAT})")


def _service_name(args: argparse.Namespace) -> str:
    """How this process names itself in log lines."""
    if args.command == "stage" and args.stage:
        return args.replica or args.stage
    return {"up": "launcher"}.get(args.command, args.command)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `omni-mesh`: show what there is to run
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from omni_mesh import logs

    logs.configure(_service_name(args), args.log_level, args.log_format)
    try:
        if args.command in _SECURED:
            _apply_security_flags(args)
        return args._run(args)
    except (CliError, TopologyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and friends: stop quietly. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again (the recipe from the `signal` docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
