"""`omni-mesh models tiny ARCH DIR`: a tiny random checkpoint of a real architecture."""

from __future__ import annotations

import argparse
from pathlib import Path

from omni_mesh.cli.common import EXIT_OK, CliError, Command, Declare
from omni_mesh.engines.tiny import BUILDERS  # no torch: the builders import it when they run

ARCHS = tuple(BUILDERS)


def _add_models(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "models",
        help="model checkpoints for engine: stages",
        description="Write a tiny random checkpoint of a real architecture (seeded, offline, seconds): "
        "engine: stages run the real model code on it. It speaks noise; the point is the code path.",
    )
    actions = parser.add_subparsers(dest="models_action", metavar="ACTION", required=True)
    tiny = actions.add_parser("tiny", help="write a tiny random checkpoint into DIR")
    tiny.add_argument("arch", metavar="ARCH", choices=ARCHS, help=" | ".join(ARCHS))
    tiny.add_argument("directory", metavar="DIR")
    tiny.add_argument("--seed", type=int, default=0, help="seed of its random weights")
    return parser


def _cmd_models(args: argparse.Namespace) -> int:
    from omni_mesh.engines.tiny import build_tiny

    directory = Path(args.directory)
    if directory.exists() and any(directory.iterdir()):
        raise CliError(f"{directory} is not empty: choose a new directory for the checkpoint")
    try:
        build_tiny(args.arch, directory, args.seed)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None
    print(f"wrote a tiny {args.arch} checkpoint to {directory}: OMNI_MESH_MODEL={directory} "
          f"omni-mesh up compose/{args.arch}.yaml")
    return EXIT_OK


COMMANDS: dict[str, tuple[Declare, Command]] = {"models": (_add_models, _cmd_models)}
