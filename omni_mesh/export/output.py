"""What an export produces: YAML that reads like a hand-written file (block mappings, nested lists
indented, short lists of scalars such as commands on one line, a comment header, anchors only where
the caller names them), the warnings that go with it, and where it is written."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Exported:
    text: str
    warnings: list[str] = field(default_factory=list)  # what may not work as exported (printed on stderr)
    secret: bool = False  # the text holds a secret (the mesh keys): a file of it is private to its owner


class _Dumper(yaml.SafeDumper):
    named: Mapping[int, str] = {}  # id(value) -> anchor name (not `anchors`: the Serializer uses that)

    def increase_indentation(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indentation(flow, False)  # lists indented under their key

    def ignore_aliases(self, data: Any) -> bool:
        return id(data) not in self.named  # no &id001: only the values the caller named

    def generate_anchor(self, node: yaml.Node) -> str:
        return next(self.named[key] for key, seen in self.represented_objects.items() if seen is node)


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    scalars = all(isinstance(item, (str, int, float, bool)) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=bool(data) and scalars)


_Dumper.add_representer(list, _represent_list)


def render(documents: Iterable[dict], header: Iterable[str] = (), anchors: Mapping[int, str] | None = None) -> str:
    """The documents as one YAML stream (`---` between them), after `header` as comment lines. A value
    whose id is in `anchors` is written once, under that anchor name, and aliased where it recurs."""
    dumper = type("Dumper", (_Dumper,), {"named": dict(anchors or {})})
    comments = "".join(f"# {line}".rstrip() + "\n" for line in header)
    body = yaml.dump_all(list(documents), Dumper=dumper, sort_keys=False, default_flow_style=False, width=4096)
    return comments + body


def write(text: str, output: str | os.PathLike | None, *, secret: bool = False) -> None:
    """To standard output, or to the file `output` (replaced whole, never left half-written).

    The file is made 0600 (mkstemp's mode) and filled, then renamed over `output`: with `secret` it
    stays 0600 from its first byte, whatever mode a file it replaces had; otherwise it is opened up to
    0644 like any other generated file."""
    if output is None or str(output) == "-":
        print(text, end="")
        return
    path = Path(output)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            if not secret:
                os.fchmod(f.fileno(), 0o644)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
