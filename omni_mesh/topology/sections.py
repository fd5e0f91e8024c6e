"""Where a topology's sections live: ours at the top level, vllm-omni's stage configs under `runtime:`."""

from __future__ import annotations

from typing import Any

from omni_mesh.topology.model import TopologyError
from omni_mesh.topology.schema import Runtime, check_spelling, known_keys


class Sections:
    """`connectors:`, `defaults:`, `edges:` and flags such as `auto_shm`, read from the top level and
    from `runtime:` together: mappings merged, edge lists joined, and a mapping item or flag set
    differently in both places an error."""

    def __init__(self, data: dict) -> None:
        self.data = data
        self.runtime = self._runtime_section()

    def _runtime_section(self) -> dict:
        runtime = self.data.get("runtime")
        if runtime is None:
            return {}
        if not isinstance(runtime, dict):
            raise TopologyError(f"runtime: must be a mapping, got {type(runtime).__name__}")
        check_spelling(runtime, known_keys(Runtime), "runtime", "other keys are vllm-omni's, ignored here")
        return runtime

    def mapping(self, key: str, singular: str) -> dict:
        """`key` from the top level and from `runtime:`, merged; an item set differently in both is an error."""
        merged: dict = {}
        found = [section[key] for section in (self.data, self.runtime) if section.get(key) is not None]
        if len(found) == 1 and isinstance(found[0], dict):
            return found[0]  # the file's own mapping, whose keys the loader knows the lines of
        for where, section in ((f"{key}:", self.data), (f"runtime.{key}:", self.runtime)):
            value = section.get(key)
            if value is None:
                continue
            if not isinstance(value, dict):
                raise TopologyError(f"{where} must be a mapping, got {type(value).__name__}")
            for item, item_value in value.items():
                if item in merged and merged[item] != item_value:
                    raise TopologyError(
                        f"{singular} {item!r} is set both under {key}: and runtime.{key}: with different "
                        f"values ({merged[item]!r} vs {item_value!r}); keep only one of them"
                    )
                merged[item] = item_value
        return merged

    def flag(self, key: str, default: bool) -> bool:
        """A true/false `key` from the top level or `runtime:` (the same in both if in both)."""
        values = {where: s[key] for where, s in (("", self.data), ("runtime.", self.runtime)) if key in s}
        for where, value in values.items():
            if not isinstance(value, bool):
                raise TopologyError(f"{where}{key} must be true or false, got {value!r}")
        if len(set(values.values())) > 1:
            raise TopologyError(
                f"{key} is set both at the top level and under runtime: with different values; keep only one"
            )
        return next(iter(values.values()), default)

    def edge_entries(self) -> list[tuple[str, Any]]:
        """Every `edges:` entry, top level first, each with where it is (`runtime.edges[0]`)."""
        entries: list[tuple[str, Any]] = []
        for where, section in (("edges", self.data), ("runtime.edges", self.runtime)):
            value = section.get("edges")
            if value is None:
                continue
            if not isinstance(value, list):
                raise TopologyError(f"{where}: must be a list of {{from: <id>, to: <id>}} entries")
            entries.extend((f"{where}[{index}]", entry) for index, entry in enumerate(value))
        return entries
