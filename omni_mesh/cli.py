"""The `omni-mesh` command.

Each subcommand is a `_cmd_<name>(args) -> int` function plus a `_add_<name>(subparsers)` that
declares its arguments; both are registered once, in `_COMMANDS`. A command reports a user error by
raising `CliError` (or `TopologyError`): `main` prints `error: <message>` on stderr and exits 2.
"""

from __future__ import annotations

import argparse
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
    return parser


def _cmd_validate(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology)
    if args.json:
        print(json.dumps(topology.to_dict(), indent=2, sort_keys=False, default=str))
    else:
        print(format_summary(topology))
    return EXIT_OK


def format_summary(topology: Topology) -> str:
    """A human-readable account of a validated topology (what `validate` prints)."""
    entries = {stage.stage_id for stage in topology.entry_stages}
    finals = {stage.stage_id for stage in topology.final_stages}
    lines = [f"topology {topology.name!r} is valid" + (f" ({topology.path})" if topology.path else "")]
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
    missing = topology.missing_handlers()
    if missing:
        who = ", ".join(f"{stage.stage_id} {stage.name!r}" for stage in missing)
        lines.append(
            f"note: {len(missing)} stage(s) have no handler: {who}; `omni-mesh up` needs a "
            "handler: module:function on every stage"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# registry and entry point

Command = Callable[[argparse.Namespace], int]
Declare = Callable[[argparse._SubParsersAction], argparse.ArgumentParser]

# name -> (declare its arguments, run it). New subcommands (up, stage, coordinator, bench) go here.
_COMMANDS: dict[str, tuple[Declare, Command]] = {
    "validate": (_add_validate, _cmd_validate),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-mesh",
        description="Run a multi-stage omni-modality inference pipeline as a mesh of asyncio services.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for declare, run in _COMMANDS.values():
        declare(subparsers).set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `omni-mesh`: show what there is to run
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
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
