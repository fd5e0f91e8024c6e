"""No module of the package grows past 400 lines: one concept each, readable in a sitting."""

from __future__ import annotations

from pathlib import Path

import omni_mesh

LIMIT = 400


def test_no_module_is_over_the_limit() -> None:
    package = Path(omni_mesh.__file__).parent
    sizes = {str(path.relative_to(package)): len(path.read_text().splitlines()) for path in package.rglob("*.py")}
    assert len(sizes) > 100  # the walk found the package
    assert {name: lines for name, lines in sizes.items() if lines > LIMIT} == {}
