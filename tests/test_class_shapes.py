"""Classes built one way, read from the source with `ast` (issue 39: composition, not mixin stacks):

(a) no class of `omni_mesh` inherits from more than one `omni_mesh` class: a class that needs the
    work of several composes objects that do it;
(b) in `omni_mesh/connectors/`, no code reads or writes another object's private attribute
    (`other._name`; `self`, `cls` and `super()` aside), and a class reads only the private
    attributes it or its `omni_mesh` ancestors define: no mixin leaning on its siblings' state.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "omni_mesh"
CONNECTORS = ROOT / "connectors"

ClassKey = tuple[str, str]  # (module, class name)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, ast.Module]:
    return {_module_name(path): ast.parse(path.read_text(), str(path)) for path in ROOT.rglob("*.py")}


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


@cache
def _names(module: str) -> dict[str, str]:
    """Top-level names of `module` bound to `omni_mesh` modules or classes: name -> dotted origin."""
    tree = _modules()[module]
    is_package = (ROOT.parent / module.replace(".", "/") / "__init__.py").exists()
    names = {node.name: f"{module}.{node.name}" for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node, is_package)
            if source.split(".")[0] == "omni_mesh":
                for alias in node.names:
                    names.setdefault(alias.asname or alias.name, f"{source}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "omni_mesh":
                    names.setdefault(alias.asname or alias.name, alias.name)
    return names


@cache
def _classes() -> dict[ClassKey, ast.ClassDef]:
    return {
        (module, node.name): node
        for module, tree in _modules().items()
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def _resolve(origin: str) -> ClassKey | None:
    """The project class a dotted origin names (following re-exports), or None."""
    for _ in range(10):
        module, _, name = origin.rpartition(".")
        if (module, name) in _classes():
            return module, name
        if module not in _modules() or name not in _names(module):
            return None
        origin = _names(module)[name]
    return None


def _project_bases(module: str, node: ast.ClassDef) -> list[ClassKey]:
    bases = []
    for base in node.bases:
        dotted = ast.unparse(base)
        head, _, rest = dotted.partition(".")
        origin = _names(module).get(head)
        found = _resolve(f"{origin}.{rest}" if origin and rest else origin) if origin else None
        if found is not None:
            bases.append(found)
    return bases


def test_no_class_inherits_from_two_project_classes() -> None:
    assert len(_classes()) > 200  # the walk found the package's classes
    stacked = {
        f"{module}.{node.name}": [f"{m}.{n}" for m, n in bases]
        for (module, _), node in _classes().items()
        if len(bases := _project_bases(module, node)) > 1
    }
    assert stacked == {}, "compose the objects instead of inheriting from several project classes"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(node: ast.ClassDef) -> set[str]:
    """Private names a class defines: methods, class attributes, `__slots__`, `self._x = ...`."""
    names: set[str] = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
                    elif isinstance(leaf, ast.Attribute) and ast.unparse(leaf.value) in ("self", "cls"):
                        names.add(leaf.attr)
            if isinstance(item, ast.Assign) and any(ast.unparse(t) == "__slots__" for t in item.targets):
                names.update(e.value for e in ast.walk(item.value) if isinstance(e, ast.Constant))
    return {name for name in names if isinstance(name, str) and _is_private(name)}


@cache
def _defined(key: ClassKey) -> frozenset[str] | None:
    """Private names `key` and its ancestors define; None where an ancestor lies outside the project
    (a stdlib base may define what the class reads)."""
    module, _ = key
    node = _classes()[key]
    names = set(_own_names(node))
    project = _project_bases(module, node)
    if len(project) < len(node.bases) - sum(
        ast.unparse(b) in ("ABC", "Generic", "object") for b in node.bases
    ):
        return None
    for base in project:
        inherited = _defined(base)
        if inherited is None:
            return None
        names |= inherited
    return frozenset(names)


def _private_uses(tree: ast.AST) -> list[ast.Attribute]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and _is_private(node.attr)]


def test_connectors_read_no_other_object_private_attributes() -> None:
    foreign = []
    for path in sorted(CONNECTORS.rglob("*.py")):
        for node in _private_uses(ast.parse(path.read_text())):
            owner = ast.unparse(node.value)
            if owner not in ("self", "cls", "super()"):
                foreign.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert foreign == [], "reach other objects through their public names (or pass what is needed in)"


def test_connector_classes_read_only_their_own_private_attributes() -> None:
    borrowed = []
    checked = 0
    for (module, name), node in _classes().items():
        if not module.startswith("omni_mesh.connectors"):
            continue
        defined = _defined((module, name))
        if defined is None:
            continue
        checked += 1
        for use in _private_uses(node):
            if ast.unparse(use.value) in ("self", "cls") and use.attr not in defined:
                borrowed.append(f"{module}.{name}: self.{use.attr} (line {use.lineno})")
    assert checked > 50  # the walk found the connectors' classes
    assert borrowed == [], (
        "a class reads only what it or its ancestors define: compose, do not lean on siblings"
    )
