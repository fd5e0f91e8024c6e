"""Whether this host can run openYuanrong's TransferEngine: Ascend's CANN runtime (`libascendcl.so`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_ASCEND_HOMES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
_DEFAULT_ASCEND_HOME = "/usr/local/Ascend/ascend-toolkit/latest"


def ascend_runtime_missing() -> str | None:
    """None if Ascend's libascendcl.so loads here, else what was looked for."""
    candidates = ["libascendcl.so"]  # LD_LIBRARY_PATH, as CANN's set_env.sh leaves it
    homes = [os.environ.get(name) for name in _ASCEND_HOMES] + [_DEFAULT_ASCEND_HOME]
    candidates += [os.path.join(home, "lib64", "libascendcl.so") for home in homes if home]
    found = ctypes.util.find_library("ascendcl")  # the ldconfig cache
    if found:
        candidates.append(found)
    for path in dict.fromkeys(candidates):
        if os.sep in path and not os.path.exists(path):
            continue
        try:
            ctypes.CDLL(path)
            return None
        except OSError:
            continue
    return (
        "libascendcl.so (Ascend CANN runtime) is not found: not on LD_LIBRARY_PATH, not in the ldconfig "
        f"cache, not under $ASCEND_HOME_PATH/lib64 or {_DEFAULT_ASCEND_HOME}/lib64; install CANN and run "
        "`source /usr/local/Ascend/ascend-toolkit/set_env.sh`"
    )
