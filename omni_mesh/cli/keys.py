"""`omni-mesh keys generate`, and the security flags (--keys, --insecure) of the commands that run
services."""

from __future__ import annotations

import argparse
import os

from omni_mesh.cli.common import EXIT_OK, CliError, Command, Declare


def _add_keys(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "keys",
        help="mesh keys: the CURVE key pair every service of one mesh shares",
        description="Write a new mesh key pair (DIR/mesh.key and DIR/mesh.key_secret, mode 0600). Give "
        "every coordinator and stage replica of the mesh the same DIR (--keys DIR, OMNI_MESH_KEYS_DIR, "
        "or a mounted secret). `omni-mesh up` needs none: it makes keys for its own processes.",
    )
    actions = parser.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    generate = actions.add_parser("generate", help="write a new key pair into DIR (never overwrites)")
    generate.add_argument("directory", metavar="DIR")
    return parser


def _cmd_keys(args: argparse.Namespace) -> int:
    from omni_mesh.security import MeshKeyError, MeshKeys

    try:
        path = MeshKeys.generate().write(args.directory)
    except (MeshKeyError, OSError) as exc:
        raise CliError(str(exc)) from None
    print(f"wrote {path} and {path.with_suffix('.key')}: mount the directory into every service of the mesh "
          f"and point OMNI_MESH_KEYS_DIR (or --keys) at it")
    return EXIT_OK


COMMANDS: dict[str, tuple[Declare, Command]] = {"keys": (_add_keys, _cmd_keys)}

#: Commands that run services: they take --keys / --insecure; the long-running single services
#: refuse to start without keys unless --insecure says so (`up` makes its own).
SECURED = ("up", "coordinator", "stage")


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """--keys and --insecure, on each command in SECURED."""
    parser.add_argument(
        "--keys", metavar="DIR", default=None,
        help="directory with the mesh keys (`omni-mesh keys generate DIR`; default: $OMNI_MESH_KEYS_DIR)",
    )
    parser.add_argument(
        "--insecure", action="store_true",
        help="run the control plane and side channels WITHOUT authentication or encryption (debugging only)",
    )


def apply_security_flags(args: argparse.Namespace) -> None:
    """Hand the flags to the environment the service reads them from; no keys and no --insecure is an
    error, except for `up`."""
    from omni_mesh import security

    if args.insecure:
        os.environ[security.ENV_INSECURE] = "1"
    if args.keys:
        os.environ[security.ENV_KEYS_DIR] = args.keys
    try:
        keys = security.keys_from_environment()
    except security.MeshKeyError as exc:
        raise CliError(str(exc)) from None
    if keys is None and not security.insecure_requested() and args.command != "up":
        raise CliError(
            f"no mesh keys: run `omni-mesh keys generate DIR` once, then give every service of the mesh "
            f"--keys DIR (or {security.ENV_KEYS_DIR}=DIR); --insecure runs without authentication (debugging only)"
        )

