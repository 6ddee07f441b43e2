"""Content-addressed chunk keys.

A chunk's K/V depends on the model, on the anchor it was prefilled behind and on its own token
ids, and on nothing else; the key hashes exactly those, in a canonical encoding, so any process
(or any node sharing a store) computes the same key for the same chunk:

    blake2b-128( b"blendkv.chunk.v1" | fingerprint digest (16 bytes)
                 | u32 len | anchor ids as int32 LE | u32 len | chunk ids as int32 LE )
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from .fingerprint import ModelFingerprint

KEY_SIZE = 16
_DOMAIN = b"blendkv.chunk.v1"


def _encode_ids(ids: Sequence[int]) -> bytes:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must lie in [0, 2**31)")
    return struct.pack("<I", arr.size) + arr.astype("<i4").tobytes()


def chunk_key(
    fingerprint: ModelFingerprint | str,
    anchor_token_ids: Sequence[int],
    chunk_token_ids: Sequence[int],
) -> bytes:
    """16-byte key of a chunk's K/V. ``fingerprint`` may be the object or its hex digest."""
    digest = fingerprint.digest() if isinstance(fingerprint, ModelFingerprint) else fingerprint
    h = hashlib.blake2b(digest_size=KEY_SIZE)
    h.update(_DOMAIN)
    h.update(bytes.fromhex(digest))
    h.update(_encode_ids(anchor_token_ids))
    h.update(_encode_ids(chunk_token_ids))
    return h.digest()
