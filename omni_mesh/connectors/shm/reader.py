"""SharedMemoryConnector's consumer side: a get maps the producer's segment once and decodes views.

Tensors and arrays come back as views over the slot: no copy at all; the slot's release, and why
stale or foreign metadata answers None, are the slot protocol's (`shm.slots`). A get without metadata
finds the payload by its key (`lookup`); tiny payloads come from their metadata (`shm.tiny`), payloads
of `empty()` outputs from each of their slots (`shm.outputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_mesh import codec, cuda_ipc
from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.keys import edge_key
from omni_mesh.connectors.keys import payload_name as where
from omni_mesh.connectors.shm import lookup
from omni_mesh.connectors.shm import tiny as shm_tiny
from omni_mesh.connectors.shm.maps import Mappings
from omni_mesh.connectors.shm.outputs import get_parts
from omni_mesh.connectors.shm.segments import ProcessIdentity
from omni_mesh.connectors.shm.slots import (
    digest,
    hold_until_dead,
    metadata_problem,
    names_a_payload,
    ready,
    take,
)

Got = tuple[Any, int]


class ShmReader:
    """Gets for one connector. `own_exports(name, offset)` gives the CUDA tensors of a payload this
    process put itself; `own_first()` the name of its pool's first segment, if any (searched first by key)."""

    def __init__(
        self,
        cfg: Any,
        identity: ProcessIdentity,
        counters: Counters,
        maps: Mappings,
        own_exports: Callable[[str, int], list[Any] | None],
        own_first: Callable[[], str | None],
    ) -> None:
        self._copy = cfg.copy_on_get
        self._identity = identity
        self._counters = counters
        self._maps = maps
        self._own_exports = own_exports
        self._own_first = own_first

    def get(self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None) -> Got | None:
        if type(metadata) is dict and (  # a tiny payload, in its metadata (`frame`: the usual get)
            metadata.get("frame") is not None or metadata.get("inline") is not None
        ):
            got = shm_tiny.get(from_stage, to_stage, get_key, metadata, self._maps, self._counters)
            return got if got is not None else self._stale()
        if not names_a_payload(metadata):  # no (or partial) metadata: the key alone, in every pool (lookup)
            return lookup.find_by_key(
                self._own_first(),
                self._maps,
                where(from_stage, to_stage, get_key),
                digest(from_stage, to_stage, get_key),
                lambda found: self.get(from_stage, to_stage, get_key, found),
            )
        if "refs" in metadata:
            return self._get_parts(from_stage, to_stage, get_key, metadata)
        name, offset = metadata.get("segment"), metadata.get("offset")
        generation, length = metadata.get("generation"), metadata.get("length")
        if (
            type(name) is not str
            or type(offset) is not int
            or type(generation) is not int
            or type(length) is not int
            or offset < 0
            or length < 0
        ):
            raise ConnectorError(
                f"SharedMemoryConnector: metadata for {where(from_stage, to_stage, get_key)} "
                f"{metadata_problem(metadata)}"
            )
        mm = self._maps.get(name) or self._maps.map(name, where(from_stage, to_stage, get_key))
        if mm is None or not ready(mm, offset, generation, length, digest(from_stage, to_stage, get_key)):
            return self._stale()
        base = take(mm, offset, length, self._identity)
        try:
            data = codec.decode(base, copy=self._copy, cuda_local=self._own_exports(name, offset))
        except (codec.FrameError, cuda_ipc.CudaIpcUnavailable) as exc:
            self._counters.add("errors")
            what = "bad frame for" if isinstance(exc, codec.FrameError) else "cannot map the CUDA tensors of"
            raise ConnectorError(
                f"SharedMemoryConnector: {what} {where(from_stage, to_stage, get_key)}: {exc}"
            ) from None
        finally:
            # With views alive, the slot goes back when they die; otherwise right now.
            hold_until_dead(base, mm, offset, generation)
            del base
        self._counters.add_pair("gets", "bytes_got", length)
        return data, length

    def _get_parts(self, from_stage: str, to_stage: str, get_key: str, metadata: dict) -> Got | None:
        """A payload holding empty() outputs (shm_outputs): views over each of its slots."""
        if metadata.get("key") != edge_key(from_stage, to_stage, get_key):
            return self._stale()  # metadata of another key or edge: never hand out its data
        said = where(from_stage, to_stage, get_key)
        try:
            got = get_parts(
                metadata,
                said,
                digest(from_stage, to_stage, get_key),
                self._maps.mapper(said),
                self._identity,
                self._copy,
            )
        except ConnectorError:
            self._counters.add("errors")
            raise
        if got is None:
            return self._stale()
        self._counters.add_pair("gets", "bytes_got", got[1])
        return got

    def _stale(self) -> None:
        self._counters.add("stale_gets")
        return None
