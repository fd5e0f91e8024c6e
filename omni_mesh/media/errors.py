"""The one error of the media package: the part is at fault, not the server."""

from __future__ import annotations

from omni_mesh.errors import InvalidInput


class MediaError(InvalidInput):
    """A media part that cannot be used: not base64, not the declared format, truncated, over a
    limit, a URL that may not be fetched. The message says what is wrong with the part; callers put
    where it is in front (`messages[0].content[1]: ...`). A stage raising it answers 422."""
