"""Mesh keys: who may talk on the control plane and on the side channels our connectors own.

Every socket we bind runs ZeroMQ CURVE as a server with the mesh's key pair, and admits a client only
if it authenticates with that same key pair: a ZAP handler (`zap_reply`) checks the client's public
key, and CURVE itself proves the client holds the matching secret key. A stranger without the keys
cannot complete the handshake, so it can neither send a message nor read one.

Where the keys come from, first match wins:
  1. `set_mesh_keys()` in this process (tests, embedding);
  2. OMNI_MESH_CURVE_PUBLIC_KEY and OMNI_MESH_CURVE_SECRET_KEY (Z85 text; `omni-mesh up` passes
     ephemeral keys to its children this way);
  3. OMNI_MESH_KEYS_DIR, a directory written by `omni-mesh keys generate DIR`, or the `mesh.key_secret`
     file in it (mount that file as a compose or Kubernetes secret).
OMNI_MESH_INSECURE=1 turns CURVE off, loudly: for debugging only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from omni_mesh.defaults import ENV_INSECURE as ENV_INSECURE

log = logging.getLogger("omni_mesh.security")

ENV_PUBLIC = "OMNI_MESH_CURVE_PUBLIC_KEY"
ENV_SECRET = "OMNI_MESH_CURVE_SECRET_KEY"
ENV_KEYS_DIR = "OMNI_MESH_KEYS_DIR"
KEY_BASENAME = "mesh"  # DIR/mesh.key (public) and DIR/mesh.key_secret (both keys, mode 0600)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks every socket's context for a verdict
ZAP_DOMAIN = b"omni-mesh"


class MeshKeyError(ValueError):
    """Mesh keys are missing or unreadable; the message says where they were looked for."""


@dataclass(frozen=True)
class MeshKeys:
    """The mesh's CURVE key pair, as Z85 text (40 bytes each)."""

    public: bytes
    secret: bytes

    def __post_init__(self) -> None:
        for name, key in (("public", self.public), ("secret", self.secret)):
            if not isinstance(key, bytes) or len(key) != 40:
                raise MeshKeyError(f"the mesh {name} key must be 40 characters of Z85 text")
        try:
            derived = zmq.curve_public(self.secret)
        except zmq.ZMQError as exc:
            raise MeshKeyError(f"the mesh secret key is not valid Z85: {exc}") from None
        if derived != self.public:
            raise MeshKeyError("the mesh public key does not belong to the secret key")

    @classmethod
    def generate(cls) -> MeshKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> MeshKeys:
        """From DIR/mesh.key_secret, or from the secret-key file itself (a compose secret is one file)."""
        path = Path(directory)
        if not path.is_file():
            path = path / f"{KEY_BASENAME}.key_secret"
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise MeshKeyError(
                f"cannot read mesh keys from {path}: {exc}; create them with `omni-mesh keys generate {directory}`"
            ) from None
        if secret is None:
            raise MeshKeyError(f"{path} holds no secret key; create keys with `omni-mesh keys generate {directory}`")
        return cls(public, secret)

    def write(self, directory: str | os.PathLike) -> Path:
        """Write DIR/mesh.key and DIR/mesh.key_secret (0600); refuses to overwrite existing keys."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        secret_path = root / f"{KEY_BASENAME}.key_secret"
        public_path = root / f"{KEY_BASENAME}.key"
        for path in (secret_path, public_path):
            if path.exists():
                raise MeshKeyError(f"{path} exists already: keys are never overwritten (remove it first)")
        header = "#   omni-mesh mesh keys: every coordinator and stage replica of one mesh uses the same pair\n"
        body = f'metadata\ncurve\n    public-key = "{self.public.decode()}"\n'
        fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(header + body + f'    secret-key = "{self.secret.decode()}"\n')
        public_path.write_text(header + body)
        return secret_path

    def to_env(self) -> dict[str, str]:
        """The environment that hands these keys to a child process."""
        return {ENV_PUBLIC: self.public.decode(), ENV_SECRET: self.secret.decode()}


_UNSET = object()
_keys: MeshKeys | None | object = _UNSET
_lock = threading.Lock()


def insecure_requested() -> bool:
    return os.environ.get(ENV_INSECURE, "").strip().lower() in ("1", "true", "yes", "on")


def keys_from_environment() -> MeshKeys | None:
    """The keys the environment names (module docstring), or None when it names none."""
    public, secret = os.environ.get(ENV_PUBLIC), os.environ.get(ENV_SECRET)
    if public or secret:
        if not (public and secret):
            raise MeshKeyError(f"set both {ENV_PUBLIC} and {ENV_SECRET}, or neither")
        return MeshKeys(public.strip().encode(), secret.strip().encode())
    directory = os.environ.get(ENV_KEYS_DIR)
    return MeshKeys.load(directory) if directory else None


def mesh_keys() -> MeshKeys | None:
    """This process's mesh keys; None when CURVE is off (opted out, or nothing configured)."""
    global _keys
    with _lock:
        if _keys is _UNSET:
            if insecure_requested():
                log.warning(
                    "%s is set: the control plane and connector side channels run WITHOUT authentication "
                    "or encryption; anyone who reaches their ports can join the mesh. Debugging only.",
                    ENV_INSECURE,
                )
                _keys = None
            else:
                _keys = keys_from_environment()
        return _keys  # type: ignore[return-value]


def set_mesh_keys(keys: MeshKeys | None) -> None:
    """Use `keys` in this process from now on (None: CURVE off); sockets made earlier keep theirs."""
    global _keys
    with _lock:
        _keys = keys


def reset_mesh_keys() -> None:
    """Forget the keys, so the next `mesh_keys()` reads the environment again."""
    set_mesh_keys(_UNSET)  # type: ignore[arg-type]


def secure_server(sock: zmq.Socket, keys: MeshKeys | None) -> None:
    """Make `sock` (before bind) a CURVE server that its context's ZAP handler vets; no-op without keys."""
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN


def secure_client(sock: zmq.Socket, keys: MeshKeys | None) -> None:
    """Make `sock` (before connect) a CURVE client with the mesh keys; no-op without keys."""
    if keys is None:
        return
    sock.curve_serverkey = keys.public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def bind_zap(ctx: zmq.Context, keys: MeshKeys | None, *, socket_class: type | None = None) -> zmq.Socket | None:
    """A REP socket answering this context's ZAP requests (poll it and pass each request to
    `zap_reply`); None without keys. One per context: the owner of the bound server sockets keeps it."""
    if keys is None:
        return None
    sock = ctx.socket(zmq.REP, socket_class=socket_class) if socket_class else ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(ZAP_ENDPOINT)
    return sock


class Refusals:
    """Counts refused peers and logs them at most once per `interval_s` (a flood must not fill the log)."""

    def __init__(self, owner: str, interval_s: float = 10.0) -> None:
        self.owner = owner
        self.count = 0
        self._interval_s = interval_s
        self._next_log = 0.0
        self._unlogged = 0

    def refuse(self, what: str) -> None:
        self.count += 1
        self._unlogged += 1
        now = time.monotonic()
        if now >= self._next_log:
            more = f" (and {self._unlogged - 1} more since the last report)" if self._unlogged > 1 else ""
            log.warning("%s refused %s%s", self.owner, what, more)
            self._next_log = now + self._interval_s
            self._unlogged = 0


def zap_reply(request: list[bytes], keys: MeshKeys, refusals: Refusals | None = None) -> list[bytes]:
    """The verdict on one ZAP request: 200 for a CURVE client holding the mesh key, 400 otherwise."""
    if len(request) < 6:
        return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
    version, request_id, domain, address, _identity, mechanism, *credentials = request
    allowed = (
        version == b"1.0"
        and domain == ZAP_DOMAIN
        and mechanism == b"CURVE"
        and len(credentials) == 1
        and credentials[0] == zmq.utils.z85.decode(keys.public)
    )
    if allowed:
        return [b"1.0", request_id, b"200", b"OK", b"mesh", b""]
    if refusals is not None:
        peer = address.decode(errors="replace") or "a peer"
        refusals.refuse(f"{peer}: {mechanism.decode(errors='replace') or 'no'} credentials not of this mesh")
    return [b"1.0", request_id, b"400", b"not a key of this mesh", b"", b""]
