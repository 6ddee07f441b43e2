"""The model fingerprint a store is built for, and its stable serialisation.

K/V computed by one model is garbage for another (other weights, dtype, tokenizer, RoPE
config or anchor), so a store records the fingerprint of the model that filled it and refuses
to serve K/V to any other. The engine computes the fingerprint from its model; this module only
defines the type, its canonical JSON form and its digest.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .codecs import CODECS


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace: equal values give equal strings."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that changes a model's per-chunk K/V; a store opens only for its own.

    Attributes:
        architecture: the model class (e.g. "LlamaForCausalLM").
        weights_hash: a hash of the model's weight files.
        dtype: the dtype of the K/V (e.g. "float32", "bfloat16").
        tokenizer_hash: a hash of the tokenizer (its vocabulary and settings).
        rope: the rotary embedding's settings, as canonical JSON (a dict given here, e.g. the
            HF ``rope_scaling`` plus ``rope_theta``, is stored so, keeping the dataclass
            hashable and stable).
        anchor_token_ids: the tokens every chunk was prefilled behind (BOS or a system
            prefix).
        num_layers: decoder layers.
        num_kv_heads: K/V heads per layer.
        head_dim: the size of one head.
        kv_codec: how the store encodes K/V (:mod:`blendkv.store.codecs`): a store serves and
            takes values of its own codec only. It is a property of the store, not of the
            model's K/V, so it is left out of :meth:`digest` (chunk keys do not change with the
            codec) and out of the JSON when it is ``none`` (stores made before codecs read as
            ``none``).
    """

    architecture: str
    weights_hash: str
    dtype: str
    tokenizer_hash: str
    rope: str
    anchor_token_ids: tuple[int, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_codec: str = "none"

    def __post_init__(self) -> None:
        if isinstance(self.rope, dict):
            object.__setattr__(self, "rope", canonical_json(self.rope))
        if not isinstance(self.rope, str):
            raise ValueError(f"rope must be a dict or a JSON string, got {type(self.rope)}")
        object.__setattr__(self, "anchor_token_ids", tuple(int(t) for t in self.anchor_token_ids))
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("architecture", "weights_hash", "dtype", "tokenizer_hash"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string")
        if self.kv_codec not in CODECS:
            raise ValueError(f"kv_codec must be one of {CODECS}, got {self.kv_codec!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``kv_codec`` left out when it is ``none``)."""
        d = dataclasses.asdict(self)
        d["anchor_token_ids"] = list(self.anchor_token_ids)
        if d["kv_codec"] == "none":
            del d["kv_codec"]
        return d

    def to_json(self) -> str:
        """The canonical JSON of :meth:`to_dict` (what a store keeps)."""
        return canonical_json(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelFingerprint:
        """The fingerprint :meth:`to_json` wrote; ``ValueError`` on other fields."""
        d = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) | {"kv_codec"} != names:
            raise ValueError(f"fingerprint fields {sorted(d)} != expected {sorted(names)}")
        return cls(**d)

    def digest(self) -> str:
        """Stable hex digest (blake2b-128 of the canonical JSON without ``kv_codec``); equal
        across processes and codecs."""
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:  # every chunk key hashes it: computed once (the fields are frozen)
        model = self.to_dict()
        model.pop("kv_codec", None)
        return hashlib.blake2b(canonical_json(model).encode(), digest_size=16).hexdigest()

    def with_codec(self, kv_codec: str) -> ModelFingerprint:
        """This fingerprint for a store of codec ``kv_codec``."""
        return dataclasses.replace(self, kv_codec=kv_codec)

    def diff(self, other: ModelFingerprint) -> tuple[str, ...]:
        """Names of the fields whose values differ, in declaration order."""
        return tuple(
            f.name
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        )


def mismatch_message(location: object, given: ModelFingerprint, stored: ModelFingerprint) -> str:
    """What a refused open says: the differing fields and how to open the store.

    A store that differs only in dtype (``dtype="auto"`` resolved differently, or an explicit
    dtype) names the dtype to pass; any other difference needs the model it was built with.
    """
    fields = given.diff(stored)
    if fields == ("kv_codec",):
        return (
            f"store {location} holds K/V encoded with codec {stored.kv_codec!r}, not "
            f"{given.kv_codec!r}: open it with kv_codec={stored.kv_codec!r} (or leave kv_codec "
            f"unset to follow the store), or re-encode it with `blendkv store convert SRC DST "
            f"--codec {given.kv_codec}`"
        )
    if fields == ("anchor_token_ids",):
        return (
            f"store {location} holds chunks precomputed behind another anchor "
            f"({len(stored.anchor_token_ids)} tokens, not {len(given.anchor_token_ids)}): leave "
            "anchor_system and anchor_instruction unset to follow the store, or use another store"
        )
    if fields == ("dtype",):
        return (
            f"store {location} was built with dtype {stored.dtype}; this model is "
            f"{given.dtype}: pass dtype={stored.dtype!r} (or dtype='auto' to follow the "
            f"store), or use another store (command line: --dtype {stored.dtype} or auto)"
        )
    detail = "; ".join(
        f"{f}: store={getattr(stored, f)!r} given={getattr(given, f)!r}" for f in fields
    )
    return (
        f"store {location} was built for another model; differing fields: {detail}. Open it "
        "with the model it was built with, or use another store"
    )
