"""Whether a stage's handler is there, seen from its source without running its module.

`omni-mesh up` checks every handler before it starts anything. Importing them for that would make
the launcher import what the handlers import (torch, a model library: seconds of CPU, on the path to
ready) only to throw it away. So the module is first located as import would find it on the path
(no package `__init__` runs) and its source read for a top-level binding of the name; only where the
source does not show it (a missing module or name, no Python source, a name bound some other way)
does the caller import, which then says precisely what is wrong. `omni-mesh validate` always imports.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
from pathlib import Path

from omni_mesh.topology.load import add_to_sys_path
from omni_mesh.topology.model import StageSpec, Topology


def handler_in_source(topology: Topology, stage: StageSpec) -> bool:
    """Whether the source of `stage`'s handler module, found on the path its stage process has, binds
    the handler's name (see `binds_handler`)."""
    module_name, _, attr = (stage.handler or "").partition(":")
    if not module_name or not attr:
        return False
    add_to_sys_path(topology)
    return binds_handler(module_name, attr)


def binds_handler(module_name: str, attr: str) -> bool:
    """True when `module_name` is a .py file found on the path whose top level binds `attr`
    (def, class, assignment or import); False when only importing it can tell."""
    origin = _module_origin(module_name)
    if origin is None:
        return False
    try:
        tree = ast.parse(Path(origin).read_bytes(), origin)
    except (OSError, SyntaxError, ValueError):
        return False
    return attr in _top_level_names(tree.body)


def _module_origin(module_name: str) -> str | None:
    """The .py file of `module_name`, located through its parents' search paths without running
    them; None where that does not find a plain source file (import decides then). The top-level
    name goes through every finder (an editable install maps it with one of its own); finding a
    top-level name imports nothing."""
    search: list[str] | None = None
    spec = None
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        if depth == 1:
            try:
                spec = importlib.util.find_spec(parts[0])
            except (ImportError, ValueError):
                return None
        else:
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), search)
        if spec is None or (depth < len(parts) and spec.submodule_search_locations is None):
            return None
        if spec.submodule_search_locations is not None:
            search = list(spec.submodule_search_locations)
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") and Path(origin).is_file() else None


def _top_level_names(body: list[ast.stmt]) -> set[str]:
    """Names a module body binds at top level, inside if/try/with/for blocks too."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign) or (isinstance(node, ast.AnnAssign) and node.value is not None):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):  # never runs
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    names |= _top_level_names(block)
            for handler in getattr(node, "handlers", None) or []:
                names |= _top_level_names(handler.body)
    return names
