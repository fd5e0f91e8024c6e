"""`omni-mesh validate`: check a topology file and print what it describes."""

from __future__ import annotations

import argparse
import json
import sys

from omni_mesh.cli.common import EXIT_OK, EXIT_USAGE, Command, Declare
from omni_mesh.topology import Topology, load_handler, load_topology


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
        help="check the file only; by default each stage's handler is imported, as its stage would, and "
        "each engine's model is found and its config read",
    )
    return parser


def _cmd_validate(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology)
    broken = [] if args.no_import else unimportable_handlers(topology) + engine_model_problems(topology)
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
    problems = []
    for stage in topology.stages:
        if stage.handler:
            try:
                load_handler(topology, stage)
            except ValueError as exc:
                problems.append(str(exc))
    return problems


def engine_model_problems(topology: Topology) -> list[str]:
    """Each engine's model as its stage would find it: the variables set, the directory or hub id there
    (a hub id from the cache only: `up` downloads what is missing), a config of an architecture with
    engines; what fails, one message each naming the stage."""
    from omni_mesh.engines.checkpoint import CheckpointError, read_config
    from omni_mesh.engines.settings import ARCHS
    from omni_mesh.model_source import ModelNotFound, NotCached, resolve

    problems = []
    for stage in topology.stages:
        if stage.engine is None:
            continue
        who = f"stage {stage.stage_id} {stage.name!r}: engine.model"
        try:
            config = read_config(resolve(stage.engine["model"], download=False))
        except NotCached:
            continue  # `up` downloads it
        except (ModelNotFound, CheckpointError) as exc:
            problems.append(f"{who}: {exc}")
            continue
        arch = stage.engine.get("arch") or config.get("model_type")
        if arch not in ARCHS:
            problems.append(f"{who}: model_type {arch!r} has no engine here; engines exist for: {', '.join(ARCHS)}")
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
            f"  {stage.describe_work()}" + (f"  [{', '.join(roles)}]" if roles else "")
            + f"  max_queued={stage.queue_limit()}" + ("" if stage.max_queued is not None else " (default)")
            + (f"  autoscale={a.min_replicas}-{a.max_replicas} (target {a.target_ongoing_requests:g} ongoing, "
               f"delays {a.upscale_delay_s:g}/{a.downscale_delay_s:g} s)" if (a := stage.autoscale) else "")
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
            "handler: module:function (or an engine:) on every stage"
        )
    return "\n".join(lines)


COMMANDS: dict[str, tuple[Declare, Command]] = {"validate": (_add_validate, _cmd_validate)}
