"""The datasystem's keys, and where its client logs (its errors and limits: `errors`).

Keys are `<key_prefix>;<edge key>` with every character outside the datasystem's key charset
percent-escaped (`%XX`, injective); keys longer than the 255-character limit end in `#<sha256>`.
"""

from __future__ import annotations

import hashlib
import os
import string
import tempfile

MAX_KEY = 255
SAFE = frozenset(string.ascii_letters + string.digits + "-_!@^*()+=:;")  # the charset minus '%' and '#'


def client_log_dir() -> str:
    """Where the datasystem client writes its logs unless DATASYSTEM_CLIENT_LOG_DIR says otherwise.

    The client's default is ~/.datasystem/logs, which grows without bound; a per-user temp dir keeps
    those logs out of home directories.
    """
    if not os.environ.get("DATASYSTEM_CLIENT_LOG_DIR"):
        path = os.path.join(tempfile.gettempdir(), f"omni-mesh-datasystem-client-{os.getuid()}")
        os.makedirs(path, exist_ok=True)
        os.environ["DATASYSTEM_CLIENT_LOG_DIR"] = path
    return os.environ["DATASYSTEM_CLIENT_LOG_DIR"]


def datasystem_key(prefix: str, key: str) -> str:
    """The datasystem key for an edge key (see the module docstring)."""
    escaped = "".join(c if c in SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in key)
    name = f"{prefix};{escaped}"
    if len(name) > MAX_KEY:
        name = f"{name[: MAX_KEY - 65]}#{hashlib.sha256(key.encode()).hexdigest()}"
    return name
