"""The `omni-mesh` command.

Each subcommand is a `_cmd_<name>(args) -> int` function plus a `_add_<name>(subparsers)` that
declares its arguments; its module registers both once, in its `COMMANDS`, and `entry` joins those
into the parser. A command reports a user error by raising `CliError` (or `TopologyError`): `main`
prints `error: <message>` on stderr and exits 2.

The package, one command group a module:

    common    exit codes, `CliError`, the --help formatter, the registry's types
    validate  `validate`, and `format_summary` (what it prints)
    schema    `schema`: the topology files' JSON Schema
    services  `coordinator`, `stage`, `up`, and the REST front door's flags
    bench     `bench connector|pipeline|chaos`
    status    `status`
    export    `export compose|k8s`
    keys      `keys generate`, and --keys / --insecure of the commands that run services
    entry     the registry, the parser, `main` (the console script `omni-mesh`, `python -m omni_mesh`)
"""

from omni_mesh.cli.common import EXIT_OK, EXIT_USAGE, CliError
from omni_mesh.cli.entry import _build_parser as _build_parser  # tests parse argv with it
from omni_mesh.cli.entry import main
from omni_mesh.cli.services import BODY_TIMEOUT_S, ENV_API_KEY, HEADER_TIMEOUT_S, WRITE_TIMEOUT_S
from omni_mesh.cli.services import _rest_settings as _rest_settings  # tests check the REST flags with it
from omni_mesh.cli.validate import format_summary, unimportable_handlers

__all__ = [
    "BODY_TIMEOUT_S",
    "ENV_API_KEY",
    "EXIT_OK",
    "EXIT_USAGE",
    "HEADER_TIMEOUT_S",
    "WRITE_TIMEOUT_S",
    "CliError",
    "format_summary",
    "main",
    "unimportable_handlers",
]
