"""Secure sum by pairwise additive masking (the one-shot core of Bonawitz et al.'s SecAgg).

Each client holds an X25519 key pair. After the server relays all public keys, every pair of
clients shares a secret nobody else knows; from it both derive the same pseudo-random mask, which
one adds and the other subtracts. Each client sends its fixed-point vector plus its masks, modulo
2^64: the server sees uniformly random numbers from every client, and only their sum, in which all
masks cancel, is meaningful. No dropout recovery: if a client fails between the two steps, the sum
cannot be opened and the run stops (fine for a one-off setup round; SecAgg+ is on the roadmap).
"""

from __future__ import annotations

import hashlib

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from fedcond.errors import FedcondError

KEY_BYTES = 32
# Fixed point with 2^-30 resolution: a sum stays exact below 2^33 (~8.6e9) in magnitude.
FIXED_POINT_SCALE = float(2**30)


def new_private_key() -> bytes:
    """A fresh X25519 private key, raw bytes (kept on the client)."""
    return X25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def public_key(private_key: bytes) -> bytes:
    """The raw public key that goes with ``private_key``."""
    private = X25519PrivateKey.from_private_bytes(private_key)
    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def pack_keys(keys: list[bytes]) -> bytes:
    """Concatenate public keys in a canonical (sorted) order for broadcasting."""
    if any(len(key) != KEY_BYTES for key in keys):
        raise FedcondError("secure sum received a malformed public key; a client runs another fedcond version")
    return b"".join(sorted(keys))


def unpack_keys(packed: bytes) -> list[bytes]:
    return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


def _pair_mask(shared_secret: bytes, session: bytes, length: int) -> np.ndarray:
    seed = hashlib.sha256(b"fedcond-secure-sum" + session + shared_secret).digest()
    generator = np.random.Generator(np.random.PCG64(int.from_bytes(seed, "little")))
    return generator.integers(0, 2**64, size=length, dtype=np.uint64, endpoint=False)


def to_fixed_point(values: np.ndarray) -> np.ndarray:
    """Encode floats as two's-complement fixed point in uint64 (addition wraps modulo 2^64)."""
    scaled = np.round(np.asarray(values, dtype=np.float64) * FIXED_POINT_SCALE)
    if not np.all(np.abs(scaled) < 2**62):
        raise FedcondError("secure sum input is too large or not finite; check the client's fingerprint")
    return scaled.astype(np.int64).view(np.uint64)


def from_fixed_point(encoded: np.ndarray) -> np.ndarray:
    return encoded.view(np.int64).astype(np.float64) / FIXED_POINT_SCALE


def masked_share(values: np.ndarray, private_key: bytes, packed_public_keys: bytes, session: bytes) -> np.ndarray:
    """This client's contribution: its fixed-point values plus one mask per peer, modulo 2^64."""
    own_public = public_key(private_key)
    peers = unpack_keys(packed_public_keys)
    if own_public not in peers:
        raise FedcondError("secure sum: this client's public key was not relayed; restart the run")
    private = X25519PrivateKey.from_private_bytes(private_key)
    share = to_fixed_point(values)
    with np.errstate(over="ignore"):
        for peer in peers:
            if peer == own_public:
                continue
            mask = _pair_mask(private.exchange(X25519PublicKey.from_public_bytes(peer)), session, len(share))
            # The lower key adds and the higher subtracts, so each pair's masks cancel in the sum.
            share = share + mask if own_public < peer else share - mask
    return share


def open_sum(shares: list[np.ndarray]) -> np.ndarray:
    """Sum of all shares: the masks cancel, leaving the sum of the clients' values."""
    if not shares:
        raise FedcondError("secure sum received no shares; check that clients answered")
    total = np.zeros_like(shares[0])
    with np.errstate(over="ignore"):
        for share in shares:
            total = total + share
    return from_fixed_point(total)
