"""The command registry, the parser built from it, and `main`, the `omni-mesh` entry point."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from omni_mesh.children import adopt_parent_death_signal
from omni_mesh.cli import bench, export, keys, models, schema, serve, services, status, validate
from omni_mesh.cli.common import EXIT_OK, EXIT_USAGE, CliError, Command, Declare, HelpWithDefaults
from omni_mesh.defaults import COORDINATOR_ID_ENV
from omni_mesh.topology import TopologyError

# name -> (declare its arguments, run it), in the order --help lists them. A new subcommand goes in
# its module's COMMANDS.
_COMMANDS: dict[str, tuple[Declare, Command]] = {
    **validate.COMMANDS,
    **schema.COMMANDS,
    **services.COMMANDS,
    **serve.COMMANDS,
    **bench.COMMANDS,
    **keys.COMMANDS,
    **status.COMMANDS,
    **export.COMMANDS,
    **models.COMMANDS,
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
        if name in keys.SECURED:
            keys.add_security_flags(command)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every command's --help (and its subcommands', such as `bench pipeline`) shows the defaults."""
    parser.formatter_class = HelpWithDefaults
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
    if args.command == "coordinator" and os.environ.get(COORDINATOR_ID_ENV):  # one of several
        return f"coordinator-{os.environ[COORDINATOR_ID_ENV]}"
    return {"up": "launcher", "serve": "launcher"}.get(args.command, args.command)


def main(argv: Sequence[str] | None = None) -> int:
    adopt_parent_death_signal()  # first: a launcher killed outright must not leave this process behind
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `omni-mesh`: show what there is to run
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from omni_mesh import logs

    logs.configure(_service_name(args), args.log_level, args.log_format)
    try:
        if args.command in keys.SECURED:
            keys.apply_security_flags(args)
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
