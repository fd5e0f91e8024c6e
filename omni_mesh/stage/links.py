"""A replica's links to every coordinator of its mesh (docs/architecture.md, "Several coordinators").

One `CoordinatorLink` per control endpoint; `--coordinator` takes them comma-separated. What the
replica says about a request (outputs, errors) goes back over the link its work came on (`origin`);
heartbeats go to every link. With several coordinators a link that stays dropped for `GONE_S`, or
whose coordinator no longer knows us (it restarted), takes its requests' work with it: nobody waits
for that work any more (`StageReplica._orphaned`).
"""

from __future__ import annotations

from typing import Any

from omni_mesh.control import Message
from omni_mesh.stage.link import CoordinatorLink

#: How long a dropped link may stay down before the work of its requests is cancelled: a blip
#: (ZeroMQ reconnects in 0.1 s) reconciles instead; a coordinator that died never answers for it.
GONE_S = 1.0


def endpoints(coordinator: str) -> list[str]:
    """The control endpoints in `--coordinator` (comma-separated), in order, each once."""
    found = [part.strip() for part in coordinator.split(",") if part.strip()]
    if not found:
        raise ValueError(f"--coordinator names no control endpoint: {coordinator!r}")
    return list(dict.fromkeys(found))


class Links:
    """Every coordinator link of one replica, and which one each request's work came on."""

    def __init__(self, coordinator: str, replica_id: str) -> None:
        self.all = [CoordinatorLink(endpoint, replica_id) for endpoint in endpoints(coordinator)]
        self.origin: dict[str, CoordinatorLink] = {}  # rid -> the link its work came on
        self.refused: set[CoordinatorLink] = set()  # links told "full": heartbeat them when a slot frees

    @property
    def several(self) -> bool:
        return len(self.all) > 1

    def registered(self) -> list[CoordinatorLink]:
        return [link for link in self.all if link.registered.is_set()]

    def of(self, rid: str) -> CoordinatorLink:
        return self.origin.get(rid, self.all[0])

    async def send(self, message: Message, *extra: Any) -> None:
        """A message about one request (`rid`), over the link its work came on."""
        await self.of(message.rid).send(message, *extra)  # type: ignore[attr-defined]

    def rids_of(self, link: CoordinatorLink, rids: list[str]) -> list[str]:
        """Those of `rids` whose work came on `link`."""
        return [rid for rid in rids if self.of(rid) is link]

    def forget(self, keep: set[str]) -> None:
        """Drop the origin of every request no longer worked on nor kept to send again."""
        for rid in [rid for rid in self.origin if rid not in keep]:
            del self.origin[rid]

    def close(self) -> None:
        for link in self.all:
            link.close()
