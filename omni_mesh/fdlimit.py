"""The process's file-descriptor limit: raised to what the system allows before serving.

Every connection, segment and pipe costs a descriptor; the common default soft limit (1,024) lets
about a thousand idle connections starve a coordinator, while the hard limit is usually far higher
and any process may raise its soft limit up to it.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("omni_mesh")


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (where the system lets us); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # a sandbox may refuse: keep going with what we have
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard
