"""`omni-mesh status`: a running mesh's stages, replicas, edges and rates, in the terminal."""

from __future__ import annotations

import argparse
import os

from omni_mesh.cli.common import EXIT_OK, CliError, Command, Declare


def _add_status(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "status",
        help="a running mesh's stages, replicas, edges and rates, in the terminal",
        description="Show what /dashboard shows: each stage's replicas and health, in-flight and queued "
        "work, requests per second and latency, bytes per second on each edge.",
    )
    parser.add_argument(
        "url", metavar="URL", nargs="?", default="http://127.0.0.1:8000",
        help="the coordinator: a URL, or HOST:PORT (then http://)",
    )
    parser.add_argument("--watch", action="store_true", help="refresh every second until Ctrl-C")
    parser.add_argument("--api-key", default=None, help="the REST API key (default: $OMNI_MESH_API_KEY)")
    return parser


def with_scheme(url: str) -> str:
    """`127.0.0.1:8000` and `localhost:8000` (no scheme: `localhost` would read as one) as http:// URLs."""
    return url if "://" in url else f"http://{url}"


def _cmd_status(args: argparse.Namespace) -> int:
    import httpx

    from omni_mesh import status

    try:
        status.run(with_scheme(args.url), api_key=args.api_key or os.environ.get("OMNI_MESH_API_KEY"), watch=args.watch)
    except (httpx.HTTPError, RuntimeError) as exc:
        raise CliError(f"cannot read the mesh at {args.url}: {exc}") from None
    return EXIT_OK


COMMANDS: dict[str, tuple[Declare, Command]] = {"status": (_add_status, _cmd_status)}
