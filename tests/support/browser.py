"""Real headless Chromium (Debian's package; `make test` installs it) for the pages the coordinator serves."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def tool(name: str) -> str:
    """The path of `name`; a missing tool fails the test with the command that installs it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run `make test` (it installs it) or `apt-get install {name}`")
    return path


def rendered(url: str, *flags: str) -> str:
    """The DOM of `url` once its scripts ran for 3 s of virtual time, serialised as HTML."""
    result = subprocess.run(
        [tool("chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000", *flags,
         "--dump-dom", url],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
