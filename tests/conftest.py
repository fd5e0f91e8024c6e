"""Suite-wide set-up.

The shared helpers live in tests/support/ (a package: `from support.meshkit import ...`).

Mooncake's native library crashes the process when it loads after openYuanrong's yr.datasystem (their
bundled libraries clash; `omni_mesh.connectors._mooncake_common` refuses that order with a clear error,
and the connector registry creates Mooncake connectors first for the same reason). The suite exercises
both in one pytest process, so the moment something is about to import yr.datasystem, mooncake is loaded
first. Tests that never touch openYuanrong do not load mooncake because of this file.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import sys


class _MooncakeBeforeYuanrong(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first import of yr.datasystem it imports mooncake, then steps aside."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if fullname == "yr.datasystem" and self in sys.meta_path:
            sys.meta_path.remove(self)
            with contextlib.suppress(ImportError):  # no mooncake here: nothing can clash
                importlib.import_module("mooncake.engine")
                importlib.import_module("mooncake.store")
        return None


sys.meta_path.insert(0, _MooncakeBeforeYuanrong())
