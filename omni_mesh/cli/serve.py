"""`omni-mesh serve MODEL`: the model's stage graph with the OpenAI API, as `vllm serve MODEL` starts.

MODEL is a checkpoint directory or a Hugging Face hub id (omni_mesh.model_source); its config picks
the graph (omni_mesh.model_graph). The topology is written to a private temporary file and run as
`omni-mesh up` runs one (every `up` flag applies); `--print-topology` writes it out instead, to edit
and `up` later.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

from omni_mesh.cli.common import EXIT_OK, CliError, Command, Declare, HelpWithDefaults
from omni_mesh.cli.services import add_up_flags, run_topology
from omni_mesh.engines.settings import DTYPES
from omni_mesh.model_graph import PARTS, ServeOptions, model_topology
from omni_mesh.model_source import ModelNotFound, expand, resolve

_REPLICAS = re.compile(r"^(\w+)=(\d+)$")


def _add_serve(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model (hub id or directory): its stage graph with the OpenAI API",
        description="Serve MODEL, a Hugging Face hub id or a checkpoint directory, as `vllm serve` does: the "
        f"stage graph of its architecture ({', '.join(PARTS)}), every stage a local process, the OpenAI API "
        "(/v1/chat/completions, /v1/models) named after the model. A hub id comes from huggingface_hub's cache, "
        "downloaded when missing (HF_HUB_OFFLINE=1: the cache only).",
        formatter_class=HelpWithDefaults,
    )
    parser.add_argument("model", metavar="MODEL", help="hub id (Qwen/Qwen2.5-Omni-3B) or checkpoint directory")
    model = parser.add_argument_group("model (vLLM's flags)")
    model.add_argument("--served-model-name", metavar="NAME", default=None,
                       help="the model's name in the API (/v1/models, `model` of requests); default: MODEL")
    model.add_argument("--dtype", choices=DTYPES, default="auto", help="weights' dtype (auto: the checkpoint's)")
    model.add_argument("--device", default="cpu", help="cpu or cuda:N, for every stage")
    model.add_argument("--max-model-len", type=int, default=None, metavar="N",
                       help="prompt + reply tokens of one request; a reply is cut to fit, a longer prompt refused")
    model.add_argument("--max-audio-tokens", type=int, default=None, metavar="N",
                       help="the talker's codec codes per reply when a request sets no max_audio_tokens "
                       "(default: the engine's, 2048; a random tiny model never stops before it)")
    model.add_argument("--threads", type=int, default=None, metavar="N", help="torch threads of each stage (CPU)")
    model.add_argument("--replicas", action="append", default=[], metavar="STAGE=N",
                       help="replicas of a stage, e.g. --replicas talker=2 (repeat for more stages; default 1)")
    model.add_argument("--print-topology", action="store_true",
                       help="write the topology serve would run to stdout and exit (edit it, then `omni-mesh up` it)")
    add_up_flags(parser)
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    topology = serve_topology(args)
    text = _yaml(topology)
    if args.print_topology:
        sys.stdout.write(text)
        return EXIT_OK
    from omni_mesh.topology import load_topology

    directory = Path(tempfile.mkdtemp(prefix="omni-mesh-serve-"))  # mode 0700: the stages read it
    try:
        path = directory / "topology.yaml"
        path.write_text(text, encoding="utf-8")
        return run_topology(load_topology(path), args)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def serve_topology(args: argparse.Namespace) -> dict:
    """The topology that serves args.model with args' settings; CliError saying what is wrong."""
    if args.max_model_len is not None and args.max_model_len < 1:
        raise CliError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    for flag in ("threads", "max_audio_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    try:
        directory = resolve(args.model)
        # A directory is written as an absolute path (the topology works from anywhere); a hub id as it is.
        model = str(directory.resolve()) if Path(expand(args.model)).expanduser().is_dir() else expand(args.model)
        options = ServeOptions(
            served_model_name=args.served_model_name or args.model, dtype=args.dtype, device=args.device,
            max_model_len=args.max_model_len, max_audio_tokens=args.max_audio_tokens,
            replicas=_replicas(args.replicas), threads=args.threads,
        )
        return model_topology(model, directory, options)
    except ModelNotFound as exc:
        raise CliError(str(exc)) from None


def _replicas(values: list[str]) -> dict[str, int]:
    out = {}
    for value in values:
        match = _REPLICAS.match(value)
        if not match or int(match.group(2)) < 1:
            raise CliError(f"--replicas {value!r}: write STAGE=N with N >= 1, e.g. --replicas talker=2")
        out[match.group(1)] = int(match.group(2))
    return out


def _yaml(topology: dict) -> str:
    import yaml

    head = "# Written by `omni-mesh serve --print-topology`: run it with `omni-mesh up FILE` (docs/engines.md).\n"
    return head + yaml.safe_dump(topology, sort_keys=False, default_flow_style=None, width=120)


COMMANDS: dict[str, tuple[Declare, Command]] = {"serve": (_add_serve, _cmd_serve)}
