"""`omni-mesh export compose|k8s`: a topology's Compose file or Kubernetes manifests."""

from __future__ import annotations

import argparse
import sys

from omni_mesh.cli.common import EXIT_OK, CliError, Command, Declare
from omni_mesh.topology import load_topology


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
    compose.add_argument(
        "--coordinators", type=int, default=1, metavar="N",
        help="coordinator services sharing the REST port (more than 1: no single point of failure)",
    )
    k8s.add_argument("--image", default="omni-mesh:latest", help="the image every pod runs (push it where the cluster pulls)")
    k8s.add_argument("--name", default=None, help="prefix of every object's name (default: the topology's name)")
    k8s.add_argument(
        "--keys", metavar="PATH", default=None,
        help="put this mesh.key_secret (or DIR/mesh.key_secret) in the Secret; default: create the Secret yourself",
    )
    k8s.add_argument("--shm-size", default="2Gi", help="/dev/shm of a pod whose stages share memory")
    k8s.add_argument("--max-replicas", type=int, default=None, help="each autoscaler's ceiling (default: 4 x replicas)")
    k8s.add_argument(
        "--coordinators", type=int, default=1, metavar="N",
        help="coordinator pods behind the one REST Service (more than 1: a StatefulSet and a PodDisruptionBudget)",
    )
    return parser


def _cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from omni_mesh import export

    topology = load_topology(args.topology)
    output = Path(args.output) if args.output not in (None, "-") else None
    try:
        source = export.ImageSource.find(topology, args.context)
        if args.export == "compose":
            options = export.ComposeOptions(args.network, args.http_port, args.control_port, args.coordinators)
            result = export.export_compose(topology, source, output, options)
        else:
            if args.coordinators < 1:
                raise export.ExportError(f"--coordinators must be at least 1, got {args.coordinators}")
            k8s = export.K8sOptions(args.image, args.name, args.keys, args.shm_size, args.max_replicas, args.coordinators)
            result = export.export_k8s(topology, source, k8s)
        export.write(result.text, output, secret=result.secret)
    except (export.ExportError, OSError) as exc:
        raise CliError(str(exc)) from None
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return EXIT_OK


COMMANDS: dict[str, tuple[Declare, Command]] = {"export": (_add_export, _cmd_export)}
