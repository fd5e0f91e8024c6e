"""Mooncake's return codes as the connectors' exception family (`connectors/errors.py`): the one place
they are mapped, for MooncakeStoreConnector and MooncakeTransferEngineConnector.

The Python bindings return bare integers: the store's `ErrorCode` (mooncake-store/include/types.h) and
the transfer engine's `ERR_*` (mooncake-transfer-engine/include/error.h, grouped by hundreds: -1xx
network, -2xx metadata).
"""

from __future__ import annotations

from omni_mesh.connectors.errors import (
    ConnectorError,
    ConnectorFull,
    ConnectorUnavailable,
    PayloadMissing,
)

# The store's codes this package acts on by value.
NO_AVAILABLE_HANDLE = -200  # no segment has room for the object
INVALID_PARAMS = -600  # get_into: the buffer is smaller than the object
REPLICA_IS_NOT_READY = -703  # put but not yet complete
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
RPC_FAIL = -900  # the master cannot be reached
RPC_TIMEOUT = -901
TENANT_QUOTA_EXCEEDED = -1700
#: The codes that say the master did not answer (mooncake.probes.MasterWatch), by name.
MASTER_UNREACHABLE = {RPC_FAIL: "RPC_FAIL", RPC_TIMEOUT: "RPC_TIMEOUT"}

# code -> (kind, name, what to do). Any other code is a plain ConnectorError.
_STORE: dict[int, tuple[type[ConnectorError], str, str]] = {
    NO_AVAILABLE_HANDLE: (
        ConnectorFull,
        "NO_AVAILABLE_HANDLE",
        "the store is out of space: raise `segment` on the storage processes or consume payloads sooner",
    ),
    TENANT_QUOTA_EXCEEDED: (
        ConnectorFull,
        "TENANT_QUOTA_EXCEEDED",
        "the tenant's quota in the store is used up",
    ),
    OBJECT_NOT_FOUND: (
        PayloadMissing,
        "OBJECT_NOT_FOUND",
        "not in the store (never put, consumed or expired)",
    ),
    REPLICA_IS_NOT_READY: (PayloadMissing, "REPLICA_IS_NOT_READY", "its put has not completed"),
    RPC_FAIL: (ConnectorUnavailable, "RPC_FAIL", "the Mooncake master cannot be reached: is it running?"),
    RPC_TIMEOUT: (ConnectorUnavailable, "RPC_TIMEOUT", "the Mooncake master did not answer in time"),
    TRANSFER_FAIL: (
        ConnectorUnavailable,
        "TRANSFER_FAIL",
        "the transfer to or from the segment's holder failed: it may have died",
    ),
}


def store_error(rc: int, what: str) -> ConnectorError:
    """The family's kind for a store call's negative `rc`; `what` names the connector, call, edge and key."""
    kind, name, advice = _STORE.get(rc, (ConnectorError, "", "see the master's and this process's log"))
    return kind(f"{what}: the store answered rc={rc}{f' ({name})' if name else ''}; {advice}")


def engine_error(rc: int, what: str) -> ConnectorError:
    """The family's kind for a transfer engine call's negative `rc` (network and metadata failures mean
    the peer or the metadata server cannot be reached)."""
    kind = ConnectorUnavailable if -300 < rc <= -100 else ConnectorError
    return kind(f"{what} (rc={rc})")
