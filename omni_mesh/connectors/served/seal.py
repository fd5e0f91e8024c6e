"""Sealed payload bytes: an OpenSSL AEAD per transfer, off libzmq's CURVE (one core, ~0.25 GB/s).

A consumer's GET over the CURVE-protected side channel carries an *offer*: a fresh session id and a
fresh 256-bit key (CURVE keeps both secret and proves they come from the mesh). The producer answers
with a description of the transfer (algorithm, bulk port, part lengths, chunk size) and streams the
payload over its plain bulk socket, in chunks sealed with that key: nonce = the chunk's index (a key
seals one transfer only, so nonces never repeat), AAD = the edge key, the transfer's chunk count and
the chunk's index, part and offset. The consumer opens each chunk with the values *it* expects, so a
chunk altered, replayed, reordered, cut short or moved to another transfer fails its tag: an error
naming the edge and key, never wrong data. Before the producer streams anything, the consumer proves
it holds the key (`proof`): a stranger on the bulk port gets nothing and makes nothing be written.

`none` skips the sealing (the peers are still authenticated, the bytes travel in clear).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

AES = "aes-256-gcm"
CHACHA = "chacha20-poly1305"
NONE = "none"
AUTO = "auto"
CHOICES = (AUTO, AES, CHACHA, NONE)
_CIPHERS: dict[str, Any] = {AES: AESGCM, CHACHA: ChaCha20Poly1305}

TAG_BYTES = 16
#: Sealed chunks: about 1/16 of the payload, within these bounds. Large enough that per-chunk costs
#: vanish, small enough that sealing, the socket and opening overlap from the first chunks on (the
#: first chunk's sealing and the last one's opening are the only time they do not), and that a chunk
#: and its sealed copy stay in a core's L2 cache (2 MiB chunks were 10-25 % slower at 16 MiB here).
MIN_CHUNK_BYTES = 256 << 10
MAX_CHUNK_BYTES = 1 << 20
OFFER_VERSION = b"\x01"
SID_BYTES = 16
KEY_BYTES = 32
OFFER_BYTES = 1 + SID_BYTES + KEY_BYTES
_AAD = struct.Struct(">QIIIQ")  # chunk count, index, part, (padding), offset in the part


class SealError(Exception):
    """A chunk that failed its tag, or a transfer description that makes no sense."""


@functools.cache
def best_algorithm() -> str:
    """AES-256-GCM where the CPU has AES instructions (x86 `aes`, Arm `aes`), ChaCha20-Poly1305 otherwise."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return AES if "aes" in line.split(":", 1)[1].split() else CHACHA
    except OSError:
        pass
    return AES  # no cpuinfo (not Linux): OpenSSL's AES-GCM is the common fast case


def resolve(choice: str) -> str:
    """The algorithm a config's `encryption` names (`auto`: the best for this CPU)."""
    return best_algorithm() if choice == AUTO else choice


class Session:
    """One transfer's secrets, as the consumer makes them and the producer reads them from the offer."""

    __slots__ = ("sid", "key")

    def __init__(self, sid: bytes, key: bytes) -> None:
        self.sid, self.key = sid, key

    @classmethod
    def fresh(cls) -> Session:
        return cls(os.urandom(SID_BYTES), os.urandom(KEY_BYTES))

    @classmethod
    def from_offer(cls, offer: bytes) -> Session:
        if len(offer) != OFFER_BYTES or offer[:1] != OFFER_VERSION:
            raise SealError(f"an offer of {len(offer)} bytes, not version 1 ({OFFER_BYTES} bytes)")
        return cls(offer[1 : 1 + SID_BYTES], offer[1 + SID_BYTES :])

    def offer(self) -> bytes:
        return OFFER_VERSION + self.sid + self.key

    def proof(self) -> bytes:
        """What the consumer sends on the bulk socket to be served: it holds the key of this session."""
        return hmac.digest(self.key, b"omni-mesh bulk pull" + self.sid, hashlib.sha256)

    def proves(self, proof: bytes) -> bool:
        return hmac.compare_digest(self.proof(), proof)


def chunk_size(total: int) -> int:
    """The chunk size for a payload of `total` bytes (a power of two, see MIN_/MAX_CHUNK_BYTES)."""
    size = MIN_CHUNK_BYTES
    while size < MAX_CHUNK_BYTES and size * 16 < total:
        size *= 2
    return size


def plan(lengths: list[int], chunk: int) -> list[tuple[int, int, int]]:
    """The chunks of a transfer: (part, offset, length), parts in order; empty parts have none."""
    chunks = []
    for part, length in enumerate(lengths):
        chunks += [(part, offset, min(chunk, length - offset)) for offset in range(0, length, chunk)]
    return chunks


class Sealer:
    """Seals and opens the chunks of one transfer (algorithm `name`, key of `session`, edge `key`)."""

    __slots__ = ("_aead", "_prefix", "count")

    def __init__(self, name: str, session: Session, key: str, count: int) -> None:
        self._aead = _CIPHERS[name](session.key)
        self._prefix = key.encode() + b"\0"
        self.count = count

    def _nonce_aad(self, index: int, part: int, offset: int) -> tuple[bytes, bytes]:
        return index.to_bytes(12, "big"), self._prefix + _AAD.pack(self.count, index, part, 0, offset)

    def seal_into(self, index: int, part: int, offset: int, data: Any, out: Any) -> None:
        """`data` sealed into `out` (len(data) + TAG_BYTES): OpenSSL writes it there, no copy."""
        nonce, aad = self._nonce_aad(index, part, offset)
        self._aead.encrypt_into(nonce, data, aad, out)

    def open_into(self, index: int, part: int, offset: int, sealed: Any, out: Any) -> None:
        """`sealed` opened into `out`; SealError if its tag does not match what this chunk must be."""
        nonce, aad = self._nonce_aad(index, part, offset)
        try:
            self._aead.decrypt_into(nonce, sealed, aad, out)
        except (InvalidTag, ValueError) as exc:
            raise SealError(str(exc) or type(exc).__name__) from None
