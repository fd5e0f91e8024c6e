"""`omni-mesh status`: a running mesh's stages, replicas, edges and rates, in the terminal; `omni-mesh scale`:
the replicas of one of its stages."""

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


def _add_scale(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "scale",
        help="set the replicas of a stage of a running `omni-mesh up`",
        description="Ask the coordinator for N replicas of STAGE; `omni-mesh up` starts them, or drains and "
        "stops the extra ones. A stage with autoscale: is refused: its replicas follow the load.",
    )
    parser.add_argument("stage", metavar="STAGE", help="the stage's name")
    parser.add_argument("replicas", metavar="N", type=int, help="the replicas it runs from now on (at least 1)")
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the coordinator: a URL, or HOST:PORT (then http://)"
    )
    parser.add_argument("--api-key", default=None, help="the REST API key (default: $OMNI_MESH_API_KEY)")
    return parser


def _cmd_scale(args: argparse.Namespace) -> int:
    from urllib.parse import quote

    import httpx

    key = args.api_key or os.environ.get("OMNI_MESH_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    url = f"{with_scheme(args.url).rstrip('/')}/v1/stages/{quote(args.stage, safe='')}/replicas"
    try:
        answer = httpx.post(url, json={"replicas": args.replicas}, headers=headers, timeout=10.0)
        body = answer.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise CliError(f"cannot reach the mesh at {args.url}: {exc}") from None
    if answer.status_code != 200:
        raise CliError(f"scale {args.stage} {args.replicas}: {body.get('error') or answer.text[:200]}")
    print(f"{args.stage}: {body['previous']} -> {body['target_replicas']} replicas (`omni-mesh up` starts or drains them)")
    return EXIT_OK


COMMANDS: dict[str, tuple[Declare, Command]] = {
    "status": (_add_status, _cmd_status),
    "scale": (_add_scale, _cmd_scale),
}
