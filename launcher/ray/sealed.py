"""The job secret handed to a Ray actor without it crossing Ray's RPC in clear.

Ray's RPC (gRPC between the driver, the GCS and the raylets) is unencrypted unless the
cluster enables Ray's TLS, so an actor-call argument can be read by anyone who can watch
the network between nodes. The secret therefore travels sealed: the actor makes a
Diffie-Hellman key pair (``KeyPair``) and returns its public value; the driver makes a pair
of its own, derives the shared key and sends the secret encrypted and authenticated with
it (``seal``); the actor derives the same key and opens it (``open_sealed``). Someone who
records every byte of both calls learns neither the key nor the secret.

What this does not do: authenticate the actor. Ray itself has no authentication: whoever
can reach the cluster's ports can run code on its nodes, and so read any worker's memory.
That is said in the README, with how to enable Ray's TLS.

The group is RFC 3526's 2048-bit MODP group (group 14), with private exponents of 256
random bits; the key is SHA-256 of the shared value, the cipher a SHA-256 keystream (one
key per actor: never reused), the tag HMAC-SHA256. Standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets

# RFC 3526, section 3: the 2048-bit MODP group; generator 2.
_P = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A08798E3404DD"
    "EF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B0BFF5CB6F406B7ED"
    "EE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA48361C55D39A69163FA8FD24CF5F"
    "83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804F1746C08CA18217C32905E462E36CE3B"
    "E39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52C9DE2BCBF6955817183995497CEA956AE515D2261898FA0510"
    "15728E5A8AACAA68FFFFFFFFFFFFFFFF",
    16,
)
_G = 2
_CONTEXT = b"lightning-elastic ray job secret v1"


class SealError(ValueError):
    """A sealed secret that does not open: tampered with, or for another key."""


@dataclasses.dataclass(frozen=True)
class Sealed:
    """What crosses Ray's RPC: the driver's public value, the ciphertext and its tag."""

    public: int
    ciphertext: bytes
    tag: bytes

    def __repr__(self) -> str:
        return f"Sealed({len(self.ciphertext)} bytes)"


class KeyPair:
    def __init__(self) -> None:
        self._private = secrets.randbits(256) | 1 << 255
        self.public = pow(_G, self._private, _P)

    def __repr__(self) -> str:
        return "KeyPair(...)"

    def shared_key(self, peer_public: int) -> bytes:
        if not 1 < peer_public < _P - 1:
            raise SealError("the peer's public value is out of range")
        shared = pow(peer_public, self._private, _P)
        return hashlib.sha256(_CONTEXT + shared.to_bytes(256, "big")).digest()


def _keystream(key: bytes, length: int) -> bytes:
    blocks = (hashlib.sha256(key + b"stream" + n.to_bytes(4, "big")).digest() for n in range(length // 32 + 1))
    return b"".join(blocks)[:length]


def _tag(key: bytes, ciphertext: bytes) -> bytes:
    return hmac.new(key + b"tag", ciphertext, hashlib.sha256).digest()


def seal(secret: str, peer_public: int) -> Sealed:
    """``secret`` for the holder of the key pair whose public value is ``peer_public``."""
    mine = KeyPair()
    key = mine.shared_key(peer_public)
    data = secret.encode()
    ciphertext = bytes(a ^ b for a, b in zip(data, _keystream(key, len(data)), strict=True))
    return Sealed(mine.public, ciphertext, _tag(key, ciphertext))


def open_sealed(pair: KeyPair, sealed: Sealed) -> str:
    key = pair.shared_key(sealed.public)
    if not hmac.compare_digest(_tag(key, sealed.ciphertext), sealed.tag):
        raise SealError("the sealed job secret does not open with this actor's key")
    data = bytes(a ^ b for a, b in zip(sealed.ciphertext, _keystream(key, len(sealed.ciphertext)), strict=True))
    return data.decode()
