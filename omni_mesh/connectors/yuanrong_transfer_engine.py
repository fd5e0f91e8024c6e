"""YuanrongTransferEngineConnector: NPU-to-NPU pulls with openYuanrong's P2P TransferEngine (Ascend only).

Needs an Ascend NPU host: the CANN runtime (`libascendcl.so`, e.g. after
`source /usr/local/Ascend/ascend-toolkit/set_env.sh`), `torch_npu`, and `pip install 'omni-mesh[yuanrong]'`.
The engine's data plane (`libp2p_transfer.so`) is built on ACL; there is no CPU or TCP data plane. On
any other host construction fails at once, naming the missing runtime and the connector to use
instead: ZmqConnector (cross-host over TCP, nothing to deploy) or YuanrongConnector (a datasystem worker).

Data path: served.engine_pull.EnginePullConnector's pull, between registered NPU pools (frames
staged through host memory on both ends) with `transfer_sync_read`. Its metadata adds target (the
engine's `host:rpc_port`) and base (the producer pool's device address).

This data path follows the published `yr.datasystem.TransferEngine` API (initialize, get_rpc_port,
register_memory, transfer_sync_read, unregister_memory, finalize). It could not be run where it was
written (no Ascend NPU there); its side channel and pool bookkeeping are the ones MoriTransferEngineConnector
shares and are tested with it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from omni_mesh.connectors import backends
from omni_mesh.connectors.config import YuanrongTransferEngineConfig
from omni_mesh.connectors.datasystem import errors
from omni_mesh.connectors.datasystem.ascend import ascend_runtime_missing
from omni_mesh.connectors.datasystem.keys import client_log_dir
from omni_mesh.connectors.errors import ConnectorUnavailable
from omni_mesh.connectors.served.engine_pull import EnginePullConnector
from omni_mesh.ports import free_port

__all__ = ["YuanrongTransferEngineConfig", "YuanrongTransferEngineConnector", "ascend_runtime_missing"]

ALTERNATIVES = (
    "on hosts without Ascend NPUs use ZmqConnector (cross-host over TCP, nothing to deploy) or "
    "YuanrongConnector (through a datasystem worker)"
)


class YuanrongTransferEngineConnector(EnginePullConnector):
    """Pull-based NPU transfers with yr.datasystem.TransferEngine (module docstring)."""

    config_class = YuanrongTransferEngineConfig
    scope = "network"

    def _open_backend(self) -> None:
        cfg: YuanrongTransferEngineConfig = self.config
        client_log_dir()
        try:
            TransferEngine = backends.load("yr.datasystem", self._name).TransferEngine  # noqa: N806
        except (ImportError, AttributeError) as exc:
            raise errors.missing_library(self._name, "yr.datasystem.TransferEngine", exc) from exc
        missing = ascend_runtime_missing()
        if missing:
            raise ConnectorUnavailable(f"{self._name} needs an Ascend NPU host: {missing}; {ALTERNATIVES}")
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device with torch)
        except ImportError as exc:
            raise ConnectorUnavailable(
                f"{self._name}: torch_npu is not available ({exc}); install the torch-npu build matching "
                f"your torch and CANN; {ALTERNATIVES}"
            ) from exc
        device = cfg.device_name
        if device == "auto":  # one NPU per local rank, as torchrun and vLLM lay processes out
            device = f"npu:{int(os.environ.get('LOCAL_RANK', 0))}"
        pool_device = device if cfg.memory_pool_device in ("auto", "npu") else cfg.memory_pool_device
        # The engine needs a concrete port up front; another process could take it before the engine
        # binds it, in which case initialize() fails naming the address (set rpc_port to pin one).
        rpc_port = cfg.rpc_port or free_port(self.host)
        address = f"{self.host}:{rpc_port}"
        engine = TransferEngine()
        errors.check_status(
            engine.initialize(address, cfg.protocol, device),
            f"{self._name}: initialize the engine on {address}",
        )
        try:
            self._rpc_port = int(engine.get_rpc_port()) or rpc_port
            self._pool = torch.empty(cfg.memory_pool_size, dtype=torch.uint8, device=pool_device)
            self._base = int(self._pool.data_ptr())
            what = f"{self._name}: register the {cfg.memory_pool_size}-byte pool on {pool_device}"
            errors.check_status(engine.register_memory(self._base, cfg.memory_pool_size), what)
        except BaseException:
            engine.finalize()
            raise
        self._engine = engine

    def _synchronize(self) -> None:
        torch.npu.synchronize()

    def _engine_metadata(self) -> dict[str, Any]:
        return {"target": f"{self.host}:{self._rpc_port}", "base": self._base}

    def _pull(self, metadata: dict[str, Any], local_offset: int, size: int, deadline: float) -> Any:
        target = str(metadata["target"])
        remote = int(metadata["base"]) + int(metadata["offset"])
        result = self._engine.transfer_sync_read(target, self._base + local_offset, remote, size)
        errors.check_status(result, f"transfer_sync_read of {size} bytes from {target}")
        return None  # synchronous: done

    def _close_backend(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.unregister_memory(self._base)
            engine.finalize()
        self._pool = None
