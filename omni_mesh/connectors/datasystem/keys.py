"""The datasystem's keys and limits, where its client logs, and the error a client call raises.

Keys are `<key_prefix>;<edge key>` with every character outside the datasystem's key charset
percent-escaped (`%XX`, injective); keys longer than the 255-character limit end in `#<sha256>`.
"""

from __future__ import annotations

import hashlib
import os
import string
import tempfile

INSTALL_HINT = "install it with `pip install 'omni-mesh[yuanrong]'` (package openyuanrong-datasystem)"
MAX_KEY = 255
MAX_VALUE = 2**32 - 1  # mcreate takes uint32 sizes
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


class WorkerError(RuntimeError):
    """A datasystem client call failed; the message is the client's."""


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
