"""Native backend libraries, imported on first use in the one order that does not crash: the one place
of that rule. Mooncake's library segfaults the process when it loads after openYuanrong's yr.datasystem
(their bundled libraries clash, commit 4868d03): `load` of yr.datasystem loads mooncake first where it
is installed, and mooncake after a yr.datasystem got in some other way is refused with a clear error."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from types import ModuleType

from omni_mesh.connectors.errors import ConnectorUnavailable

#: Libraries that must load before those in LOADS_AFTER in one process.
LOADS_FIRST = ("mooncake.engine", "mooncake.store")
LOADS_AFTER = ("yr.datasystem",)


def _loaded(names: tuple[str, ...]) -> bool:
    return any(loaded == name or loaded.startswith(f"{name}.") for loaded in sys.modules for name in names)


def load(module: str, owner: str) -> ModuleType:
    """Import `module` (a backend library) in the safe order; ImportError if it is not installed,
    ConnectorUnavailable (naming `owner`) if it can no longer load safely in this process."""
    loaded = sys.modules.get(module)
    if loaded is not None:  # (None: blocked on purpose; the import below raises ImportError)
        return loaded
    # glog prints ~10 lines per engine at INFO; users can still ask for more by setting it themselves.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if module in LOADS_FIRST and not _loaded(LOADS_FIRST) and _loaded(LOADS_AFTER):
        raise ConnectorUnavailable(
            f"{owner}: mooncake cannot be loaded after openYuanrong's yr.datasystem in one process: their "
            "native libraries clash and the process would crash. Import yr.datasystem through "
            "omni_mesh.connectors.backends.load, which loads mooncake first"
        )
    if module in LOADS_AFTER:
        for first in LOADS_FIRST:
            with contextlib.suppress(ImportError):  # not installed: nothing can clash
                importlib.import_module(first)
    return importlib.import_module(module)


def rank(modules: tuple[str, ...]) -> int:
    """Creation order of a connector that loads `modules`: 0 when one must load first, else 1."""
    return 0 if any(module in LOADS_FIRST for module in modules) else 1
