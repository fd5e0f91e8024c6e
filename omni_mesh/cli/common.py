"""What every command module shares: exit codes, the user-error exception, the --help formatter,
and the types of the command registry."""

from __future__ import annotations

import argparse
from collections.abc import Callable

EXIT_OK = 0
EXIT_USAGE = 2  # argparse's code for bad usage; also used for invalid input files


class CliError(Exception):
    """A user-facing failure: printed as `error: <message>`, exit status 2."""


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where it has none: a secret such as the API key is
    read from the environment after parsing, so --help can never print it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


#: Runs a parsed command; its exit status.
Command = Callable[[argparse.Namespace], int]
#: Declares a command's arguments on the subparsers; the command's parser.
Declare = Callable[[argparse._SubParsersAction], argparse.ArgumentParser]
