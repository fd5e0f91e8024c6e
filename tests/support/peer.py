"""A connector in another process, driven by the test one command at a time.

The peer runs this file as a script (`python tests/support/peer.py CONNECTOR CONFIG_JSON`), optionally
wrapped (`ip netns exec NS ...`). Commands and replies are msgpack, hex-encoded, one per line; replies
carry a marker so a backend library's own output on stdout is never taken for one. The first reply
says the peer's pid and the connector's host. Every reply has "ok"; a failed one has "error".

Commands (each may name the edge with "from" and "to"; default thinker -> talker):
  put     key, payload (a name in support.payloads.PAYLOADS, default "every_kind") or nbytes
          -> size, metadata
  get     key, metadata, expect (a payload name, default "every_kind") or nbytes, timeout_s, hold
          -> size, mismatch (None when what arrived is intact; then ok is True)
  release drop what `get ... hold` kept;  health -> health
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack

MARK = "@@peer "
REPLY_TIMEOUT_S = 60.0


def pack(obj: Any) -> str:
    return msgpack.packb(obj, use_bin_type=True).hex()


def unpack(text: str) -> Any:
    return msgpack.unpackb(bytes.fromhex(text.strip()), raw=False, strict_map_key=False)


class Peer:
    """A separate process owning one connector (module docstring); `ask` sends a command, returns its reply."""

    def __init__(
        self,
        connector: str,
        config: dict[str, Any],
        *,
        log: Path | None = None,
        wrap: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log_path = log
        self._log = open(log, "ab") if log else None  # noqa: SIM115 - closed in close()
        argv = [sys.executable, str(Path(__file__).resolve()), connector, pack(config)]
        env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = subprocess.Popen(
            [*(wrap or []), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        self.pid = self.process.pid
        self.info = self.read(REPLY_TIMEOUT_S)  # {"pid", "host"}

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(pack(command) + "\n")
        self.process.stdin.flush()

    def ask(self, *, reply_timeout_s: float = REPLY_TIMEOUT_S, **command: Any) -> dict[str, Any]:
        """`command` is the peer's (timeout_s there is the connector's get deadline); wait for the reply
        at most reply_timeout_s."""
        self.send(**command)
        return self.read(reply_timeout_s)

    def read(self, timeout_s: float) -> dict[str, Any]:
        result: list[dict[str, Any]] = []
        reader = threading.Thread(target=self._read_into, args=(result,), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not result:
            code = self.process.poll()
            self.close()
            state = "no reply" if code is None else f"exited with status {code} before a reply"
            raise AssertionError(f"peer gave {state} within {timeout_s}s; log:\n{self.log_tail()}")
        return result[0]

    def _read_into(self, result: list[dict[str, Any]]) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(MARK):
                result.append(unpack(line[len(MARK) :]))
                return

    def put(self, key: str, **command: Any) -> dict:
        """Put (payload= or nbytes=) under key; its metadata."""
        reply = self.ask(op="put", key=key, **command)
        assert reply["ok"], reply.get("error", reply)
        return reply["metadata"]

    def get(self, key: str, metadata: dict | None, **command: Any) -> dict:
        """The peer gets key and checks it (expect= or nbytes=); the whole reply."""
        return self.ask(op="get", key=key, metadata=metadata, **command)

    def health(self) -> dict:
        return self.ask(op="health")["health"]

    def log_tail(self) -> str:
        if self._log is None or self.log_path is None:
            return "(stderr not captured: pass log=PATH)"
        self._log.flush()
        return self.log_path.read_bytes()[-3000:].decode(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)

    def close(self) -> None:
        """Close the connector and end the process (killed if it does not exit in time)."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                assert self.process.stdin is not None
                self.process.stdin.close()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None and not self._log.closed:
            self._log.close()


# --------------------------------------------------------------------------- the peer process


def _answer(connector: Any, command: dict[str, Any], held: list[Any]) -> dict[str, Any]:
    import torch
    from payloads import mismatch, payload  # this file runs as a script: its folder is on sys.path

    op = command.pop("op")
    edge = (command.get("from", "thinker"), command.get("to", "talker"))
    nbytes = command.get("nbytes")
    if op == "put":
        data = torch.ones(nbytes, dtype=torch.uint8) if nbytes else payload(command.get("payload", "every_kind"))
        ok, size, metadata = connector.put(*edge, command["key"], data)
        return {"ok": ok, "size": size, "metadata": metadata}
    if op == "get":
        wait = command.get("timeout_s") or getattr(connector.config, "get_timeout_s", 30.0)
        result = connector.get_with_deadline(
            *edge, command["key"], command.get("metadata"), deadline=time.monotonic() + wait
        )
        if result is None:
            return {"ok": False, "error": "get returned None"}
        data, size = result
        if nbytes:
            found = None if data.numel() == nbytes else f"payload: {data.numel()} elements, expected {nbytes}"
        else:
            found = mismatch(payload(command.get("expect", "every_kind")), data)
        if command.get("hold"):
            held.append(data)
        del data, result  # views over the pool: let the region go back now
        return {"ok": found is None, "size": size, "mismatch": found, **({"error": found} if found else {})}
    if op == "release":
        held.clear()
        return {"ok": True, "released": True}
    if op == "health":
        return {"ok": True, "health": connector.health()}
    return {"ok": False, "error": f"unknown op {op!r}"}


def _serve(connector_name: str, config: dict[str, Any]) -> None:
    from omni_mesh.connectors import create_connector, register_connector

    if ":" in connector_name:  # a test's own connector class, by its lazy "module:Class" path
        register_connector(connector_name, connector_name)

    def reply(message: dict[str, Any]) -> None:
        print(MARK + pack(message), flush=True)

    connector = create_connector(connector_name, config)
    reply({"ok": True, "pid": os.getpid(), "host": getattr(connector, "host", "")})
    held: list[Any] = []
    try:
        for line in sys.stdin:
            started = time.monotonic()
            try:
                answer = _answer(connector, unpack(line), held)
            except Exception as exc:  # the test wants to see the error text
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            reply({**answer, "elapsed": time.monotonic() - started})
    finally:
        held.clear()
        connector.close()


if __name__ == "__main__":
    _serve(sys.argv[1], unpack(sys.argv[2]))
