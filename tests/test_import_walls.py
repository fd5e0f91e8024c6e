"""The package's internal walls, read from the source: who may import what.

Every module of `omni_mesh` is parsed with `ast` (imports at any depth, function-level ones included;
imports under `if TYPE_CHECKING:` aside, as they never run) and three rules are checked:
(a) nothing outside `omni_mesh/connectors/` imports a private connectors module: one whose name or any
    package on its path starts with `_`, or one inside the concept subpackages (shm/, served/, pools/,
    mooncake/, datasystem/); outsiders use the registry in `omni_mesh.connectors` and the public modules;
(b) the coordinator and the launcher import nothing of shared memory: reclaiming goes through the
    connector types' lifecycles;
(c) no import cycle among `omni_mesh` modules, but for the known ones listed below with their owners;
(e) the coordinator's scheduling room imports nothing of its HTTP or OpenAI rooms nor of an HTTP server
    library, and topology (every process reads it) imports nothing of the coordinator.
And, by importing them in a fresh process: (d) the coordinator, the launcher, the CLI (but its bench
and engine commands), the stage runtime and the codec do not import torch at module level.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "omni_mesh"
CONNECTORS = "omni_mesh.connectors"
#: The connectors' private subpackages (everything inside them is private to `omni_mesh.connectors`).
PRIVATE_SUBPACKAGES = ("shm", "served", "pools", "mooncake", "datasystem")
#: Import cycles that predate this check, each owned by the area that removes it. A cycle not listed
#: here, or a listed one that grows, fails the test.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import under `node`, at any depth, skipping the bodies of `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append(child)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for orelse in child.orelse:
                found.extend(
                    [orelse] if isinstance(orelse, (ast.Import, ast.ImportFrom)) else _import_nodes(orelse)
                )
        else:
            found.extend(_import_nodes(child))
    return found


@cache
def imports_of(name: str) -> frozenset[str]:
    """The `omni_mesh` modules `name` imports: `from P import m` counts as P.m when that is a module,
    else as P (a package's `__init__` running because a submodule is imported is not counted)."""
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        for alias in node.names:
            found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base)
    return frozenset(m for m in found if m in modules())


@cache
def libraries_of(name: str) -> frozenset[str]:
    """The top-level packages outside `omni_mesh` that `name` imports (absolute imports only)."""
    path = modules()[name]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif not node.level and node.module:
            found.add(node.module.split(".")[0])
    return frozenset(found - {"omni_mesh"})


def is_private_connectors_module(name: str) -> bool:
    if not name.startswith(CONNECTORS + "."):
        return False
    parts = name.split(".")[2:]
    return parts[0] in PRIVATE_SUBPACKAGES or any(part.startswith("_") for part in parts)


def test_the_parser_sees_what_the_rules_are_about() -> None:
    """The rules below are only as good as the import reading: check it on modules known to import."""
    assert "omni_mesh.connectors.shm.segments" in imports_of("omni_mesh.connectors.shm.pool")
    assert "omni_mesh.connectors" in imports_of("omni_mesh.coordinator.scheduling.registry")
    # function-level imports count: connector_type imports the light configs module inside the function
    assert "omni_mesh.connectors.config" in imports_of("omni_mesh.connectors.registry")
    assert is_private_connectors_module("omni_mesh.connectors._addresses")
    assert not is_private_connectors_module("omni_mesh.connectors.config.values")  # public: topology reads it
    assert is_private_connectors_module("omni_mesh.connectors.served.channel")
    assert not is_private_connectors_module("omni_mesh.connectors.zmq")
    assert not is_private_connectors_module("omni_mesh.connectors")


def test_nothing_outside_connectors_imports_a_private_connectors_module() -> None:
    breaches = [
        f"{name} imports {target}"
        for name in modules()
        if not (name == CONNECTORS or name.startswith(CONNECTORS + "."))
        for target in sorted(imports_of(name))
        if is_private_connectors_module(target)
    ]
    assert not breaches, "give what outsiders need a public name in omni_mesh.connectors:\n" + "\n".join(
        breaches
    )


def test_the_coordinator_and_the_launcher_know_nothing_of_shared_memory() -> None:
    shared_memory = (f"{CONNECTORS}.shm", f"{CONNECTORS}.shared_memory")
    breaches = [
        f"{name} imports {target}"
        for name in modules()
        if name == "omni_mesh.launcher" or name.startswith("omni_mesh.coordinator")
        for target in sorted(imports_of(name))
        if target in shared_memory or target.startswith(f"{CONNECTORS}.shm.")
    ]
    assert not breaches, "reclaim through omni_mesh.connectors' lifecycles instead:\n" + "\n".join(breaches)


def find_cycles(graph: dict[str, frozenset[str]]) -> list[frozenset[str]]:
    """The strongly connected components of `graph` with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for target in graph.get(name, frozenset()):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in on_stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == name:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def import_cycles() -> list[frozenset[str]]:
    return find_cycles({name: imports_of(name) for name in modules()})


def test_no_new_import_cycle() -> None:
    new = [sorted(cycle) for cycle in import_cycles() if cycle not in KNOWN_CYCLES]
    assert not new, f"import cycles among omni_mesh modules: {new}"


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {
        "a": frozenset({"b"}),
        "b": frozenset({"c"}),
        "c": frozenset({"a"}),
        "d": frozenset({"a"}),
        "e": frozenset(),
    }
    assert find_cycles(graph) == [frozenset({"a", "b", "c"})]
    assert find_cycles({"a": frozenset({"b"}), "b": frozenset()}) == []


#: Modules that import torch: where tensors are made (engines, device transfer engines, benches).
#: Everything else a light process runs must not, at module level, transitively (test below).
LIGHT_PACKAGES = ("omni_mesh.coordinator", "omni_mesh.cli", "omni_mesh.stage", "omni_mesh.codec")
LIGHT_MODULES = (
    "omni_mesh.launcher",
    "omni_mesh.connectors",
    "omni_mesh.connectors.shared_memory",
    "omni_mesh.connectors.zmq",
    "omni_mesh.connectors.in_process",
    "omni_mesh.cuda_ipc",
)
#: The bench and engine commands: they time and build tensors.
HEAVY_COMMANDS = ("omni_mesh.cli.bench", "omni_mesh.cli.models")
_FIRST_TO_IMPORT_TORCH = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    if "torch" in sys.modules:
        print(name)
        break
"""


def light_modules() -> list[str]:
    names = [
        name
        for name in modules()
        if name.startswith(tuple(f"{package}." for package in LIGHT_PACKAGES)) or name in LIGHT_PACKAGES
    ]
    names = [n for n in names if n not in HEAVY_COMMANDS and not n.endswith(".__main__")]
    return sorted(names) + list(LIGHT_MODULES)


def first_to_import_torch(names: list[str]) -> str:
    """Import `names` in order in a fresh `python -c`: the first after which torch is in sys.modules."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", _FIRST_TO_IMPORT_TORCH, *names],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT.parent,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_the_coordinator_launcher_cli_stage_and_codec_do_not_import_torch() -> None:
    """Module level, transitively: a process that only imports these never loads torch (2-3 s of CPU);
    the codec and connectors import it when a tensor shows up (omni_mesh.lazy_torch)."""
    names = light_modules()
    assert "omni_mesh.coordinator.http.app" in names and "omni_mesh.cli.validate" in names and len(names) > 60
    assert first_to_import_torch(names) == "", "this module imports torch at import time; import it lazily"
    # The control: the check sees a module that does import torch.
    assert first_to_import_torch(["omni_mesh.codec", "omni_mesh.bench.connector"]) == "omni_mesh.bench.connector"


SCHEDULING = "omni_mesh.coordinator.scheduling"
#: What the scheduler must not reach: the rooms that call it, and the libraries that serve HTTP.
UPSTAIRS = ("omni_mesh.coordinator.http", "omni_mesh.coordinator.openai")
HTTP_SERVER_LIBRARIES = frozenset({"fastapi", "starlette", "uvicorn", "httptools", "h11"})


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def wall_breaches(graph: dict[str, frozenset[str]], libraries: dict[str, frozenset[str]]) -> list[str]:
    """Rule (e) over an import graph and each module's libraries."""
    breaches = []
    for name in sorted(graph):
        if _inside(name, SCHEDULING):
            breaches += [f"{name} imports {t}" for t in sorted(graph[name]) if any(_inside(t, u) for u in UPSTAIRS)]
            breaches += [f"{name} imports {lib}" for lib in sorted(libraries.get(name, frozenset()) & HTTP_SERVER_LIBRARIES)]
        if _inside(name, "omni_mesh.topology"):
            breaches += [f"{name} imports {t}" for t in sorted(graph[name]) if _inside(t, "omni_mesh.coordinator")]
    return breaches


def test_the_scheduler_imports_nothing_of_http_and_topology_nothing_of_the_coordinator() -> None:
    names = list(modules())
    assert f"{SCHEDULING}.dispatch" in names and "omni_mesh.coordinator.http.app" in names
    assert "fastapi" in libraries_of("omni_mesh.coordinator.http.app")  # the reader sees libraries
    breaches = wall_breaches({n: imports_of(n) for n in names}, {n: libraries_of(n) for n in names})
    assert not breaches, "the HTTP and OpenAI rooms call the scheduler, never the other way:\n" + "\n".join(
        breaches
    )


def test_the_wall_check_sees_a_breach() -> None:
    graph = {
        f"{SCHEDULING}.dispatch": frozenset({"omni_mesh.coordinator.http.access"}),
        f"{SCHEDULING}.admission": frozenset(),
        "omni_mesh.topology.parse": frozenset({"omni_mesh.coordinator.openai.routes"}),
        "omni_mesh.coordinator.http.app": frozenset({f"{SCHEDULING}.service"}),
    }
    libraries = {f"{SCHEDULING}.admission": frozenset({"fastapi", "msgpack"})}
    assert wall_breaches(graph, libraries) == [
        f"{SCHEDULING}.admission imports fastapi",
        f"{SCHEDULING}.dispatch imports omni_mesh.coordinator.http.access",
        "omni_mesh.topology.parse imports omni_mesh.coordinator.openai.routes",
    ]
