"""MoriTransferEngineConnector: RDMA / XGMI pulls with AMD's MORI IO engine (`mori.io.IOEngine`).

Needs `pip install amd-mori` (wheels for CPython 3.10 and 3.12 on x86_64 Linux only), the ROCm 7
runtime (libamdhip64.so.7, libhsa-runtime64.so.1) and either RDMA NICs (`backend_type: rdma`, RoCE or
InfiniBand) or AMD GPUs joined by Infinity Fabric (`backend_type: xgmi`, pool on the GPU). MORI has no
TCP backend. Without the library, construction fails at once saying why and how to install it; on
hosts without that hardware use ZmqConnector.

Data path: served.engine_pull.EnginePullConnector's pull. The producer's registered pool is host
memory, or a GPU through a host staging buffer; its metadata adds its packed EngineDesc ("engine")
and pool MemoryDesc ("mem"), which a consumer registers once; the read is `IOEngine.read`, and one
still running at the deadline keeps its destination slot until the engine reports it finished.

Written against MORI's published Python API (ROCm/mori `python/mori/io`: IOEngine, IOEngineConfig,
BackendType, RdmaBackendConfig, XgmiBackendConfig, PollCqMode, EngineDesc/MemoryDesc pack/unpack,
TransferStatus). It could not be run where it was written (no ROCm, no RDMA); its tests drive it
against a fake `mori.io`.
"""

from __future__ import annotations

import importlib
import os
import secrets
import socket
import sys
import threading
import time
from typing import Any

import torch

from omni_mesh.connectors.config import MoriConfig
from omni_mesh.connectors.errors import ConnectorError, ConnectorUnavailable
from omni_mesh.connectors.served.engine_pull import EnginePullConnector


class MoriTransferEngineConnector(EnginePullConnector):
    """Pull-based RDMA/XGMI transfers with MORI's IOEngine (module docstring)."""

    config_class = MoriConfig
    scope = "network"

    def _open_backend(self) -> None:
        cfg: MoriConfig = self.config
        try:
            io = importlib.import_module("mori.io")
        except (ImportError, OSError) as exc:  # OSError: the ROCm shared libraries are missing
            version = f"{sys.version_info.major}.{sys.version_info.minor}"
            raise ConnectorUnavailable(
                f"{self._name}: AMD's MORI (mori.io) cannot be imported ({type(exc).__name__}: {exc}); "
                "install it with `pip install amd-mori` (wheels exist for CPython 3.10 and 3.12 on x86_64 "
                f"Linux only; this is CPython {version}) on a host with the ROCm 7 runtime (libamdhip64.so.7,"
                " libhsa-runtime64.so.1) and RDMA NICs or XGMI-linked AMD GPUs; elsewhere use ZmqConnector"
            ) from exc
        self._io = io
        if cfg.device_name:
            os.environ["MORI_RDMA_DEVICES"] = cfg.device_name  # MORI picks its NICs from the environment
        key = f"omni-mesh-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        where = f"{cfg.backend_type} IOEngine {key!r} on {self.host}:{cfg.port or 'any'}"
        try:
            engine = io.IOEngine(key, io.IOEngineConfig(host=self.host, port=cfg.port))
            if cfg.backend_type == "rdma":
                mode = io.PollCqMode.POLLING if cfg.poll_cq_mode == "polling" else io.PollCqMode.EVENT
                backend = io.RdmaBackendConfig(
                    qp_per_transfer=cfg.qp_per_transfer,
                    post_batch_size=cfg.post_batch_size,
                    num_worker_threads=cfg.num_worker_threads,
                    poll_cq_mode=mode,
                )
                engine.create_backend(io.BackendType.RDMA, backend)
            else:
                backend = io.XgmiBackendConfig(
                    num_streams=cfg.xgmi_num_streams, num_events=cfg.xgmi_num_events
                )
                engine.create_backend(io.BackendType.XGMI, backend)
            pool = torch.empty(cfg.memory_pool_size, dtype=torch.uint8, device=cfg.memory_pool_device)
            if pool.device.type == "cpu" and torch.cuda.is_available():
                pool = pool.pin_memory()  # page-locked host memory for GPU-side engines
            memory = engine.register_torch_tensor(pool)
            self._engine_desc = engine.get_engine_desc().pack()
            self._mem_desc = memory.pack()
        except Exception as exc:  # MORI raises its own kinds: the engine did not start
            raise ConnectorUnavailable(
                f"{self._name}: cannot start the {where}: {type(exc).__name__}: {exc}"
            ) from exc
        self._engine, self._pool, self._memory = engine, pool, memory
        self._remotes: dict[str, Any] = {}  # engine key -> EngineDesc registered with our engine
        self._remotes_lock = threading.Lock()

    def _synchronize(self) -> None:
        torch.cuda.synchronize(self._pool.device)

    def _engine_metadata(self) -> dict[str, Any]:
        return {"engine": self._engine_desc, "mem": self._mem_desc}

    def _remote_engine(self, packed: bytes) -> Any:
        desc = self._io.EngineDesc.unpack(packed)
        with self._remotes_lock:
            if desc.key not in self._remotes:
                self._engine.register_remote_engine(desc)
                self._remotes[desc.key] = desc
        return desc

    def _pull(self, metadata: dict[str, Any], local_offset: int, size: int, deadline: float) -> Any:
        try:
            desc = self._remote_engine(bytes(metadata["engine"]))
            remote_memory = self._io.MemoryDesc.unpack(bytes(metadata["mem"]))
            uid = self._engine.allocate_transfer_uid()
            status = self._engine.read(
                self._memory, local_offset, remote_memory, int(metadata["offset"]), size, uid
            )
        except Exception as exc:
            raise ConnectorError(
                f"{self._name}: cannot start the read of {size} bytes: {type(exc).__name__}: {exc}"
            ) from exc
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        wait_for = getattr(status, "WaitFor", None)
        if wait_for is not None:
            wait_for(remaining_ms)  # releases the GIL while it waits
        else:  # older MORI: no blocking wait on a status
            while status.InProgress() and time.monotonic() < deadline:
                time.sleep(0.0002)
        if status.InProgress():
            return status  # still running: EnginePullConnector parks our slot until it finishes
        if not status.Succeeded():
            raise ConnectorError(
                f"{self._name}: {self.config.backend_type} read of {size} bytes from engine {desc.key!r} failed: "
                f"{status.Message()} (code {status.Code()})"
            )
        return None

    def _transfer_done(self, handle: Any) -> bool:
        return not handle.InProgress()

    def _close_backend(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        with self._remotes_lock:
            remotes, self._remotes = list(self._remotes.values()), {}
        for desc in remotes:
            engine.deregister_remote_engine(desc)
        engine.deregister_memory(self._memory)
        self._pool = self._memory = None
