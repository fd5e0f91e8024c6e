"""`omni-mesh schema`: the JSON Schema of topology files, for editors (docs/topology.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omni_mesh.cli.common import EXIT_OK, CliError, Command, Declare


def _add_schema(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "schema",
        help="print the JSON Schema of topology files (for editor completion and checks)",
        description="Print the JSON Schema of topology files, made from the models `validate` reads them "
        "with; point an editor's YAML extension at it (docs/topology.md).",
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write the schema to FILE instead of stdout")
    return parser


def _cmd_schema(args: argparse.Namespace) -> int:
    from omni_mesh.topology.schema import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if args.output is None:
        print(text, end="")
        return EXIT_OK
    try:
        Path(args.output).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise CliError(f"schema: cannot write {args.output}: {exc.strerror or exc}") from None
    return EXIT_OK


COMMANDS: dict[str, tuple[Declare, Command]] = {"schema": (_add_schema, _cmd_schema)}
