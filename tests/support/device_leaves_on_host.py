"""A Mooncake TE connector that sends CPU tensors down the device-to-device path, for machines
without GPUs: tensors of HOST_MIN_BYTES or more leave the frame and land in host receive buffers,
so the whole protocol (registration, receive buffers, one batch write) runs for real.

Register it under NAME (a lazy "module:Class" path, importable wherever tests/support/ is on sys.path, as
in the processes `support.peer.Peer` starts).
"""

from __future__ import annotations

from omni_mesh.connectors import register_connector
from omni_mesh.connectors.mooncake.device_transfer import DeviceLeavesPolicy
from omni_mesh.connectors.mooncake_transfer_engine import MooncakeTransferEngineConnector

HOST_MIN_BYTES = 8
NAME = "device_leaves_on_host:HostDeviceLeavesConnector"


class HostDeviceLeavesConnector(MooncakeTransferEngineConnector):
    def device_leaves_policy(self) -> DeviceLeavesPolicy:
        return DeviceLeavesPolicy(self.config.device_transfer, host_min_bytes=HOST_MIN_BYTES)


def register() -> str:
    """Make NAME usable with create_connector in this process (the class itself: this module may be
    imported as `support.device_leaves_on_host` here); returns it."""
    register_connector(NAME, HostDeviceLeavesConnector)
    return NAME
