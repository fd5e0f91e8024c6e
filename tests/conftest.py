"""Suite-wide set-up.

Mooncake's native library crashes the process when it loads after openYuanrong's yr.datasystem (their
bundled libraries clash; `omni_mesh.connectors._mooncake_common` refuses that order with a clear error).
The suite exercises both in one pytest process, so mooncake is loaded first, as `omni-mesh stage` does.
"""

import mooncake.engine  # noqa: F401
import mooncake.store  # noqa: F401
