"""``blendkv eval --kv-codec none,int8,int4``: every reuse/blend method once per stored-K/V codec.

One engine, one chunk store per codec (``none`` is the engine's own store; the others are
private stores made with that codec, :mod:`blendkv.store.codecs`). :meth:`CodecStores.use`
points the blend manager at a codec's store for one request, so a method's runs on every codec
interleave per example like the methods do (drift hits them alike) and share the model. Chunk
keys do not depend on the codec, so each store holds the same chunks, encoded its way. A
method run on codec ``c`` other than ``none`` is recorded as ``METHOD[c]``, next to ``METHOD``
(the ``none`` run), which the report's paired intervals compare it with.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

from blendkv.errors import ConfigError

CODEC_NAMES = ("none", "int8", "int4")


def parse_codecs(text: str) -> list[str]:
    """``"none,int8"`` -> ``["none", "int8"]``; ``none`` always first (the reference)."""
    codecs = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in codecs if c not in CODEC_NAMES]
    if bad or not codecs:
        raise ConfigError(
            f"--kv-codec takes a comma-separated list of {', '.join(CODEC_NAMES)}, got {text!r}"
        )
    rest = [c for c in dict.fromkeys(codecs) if c != "none"]
    return ["none", *rest]


def codec_method_name(method: str, codec: str) -> str:
    """The record name of ``method`` run on a ``codec`` store."""
    return method if codec == "none" else f"{method}[{codec}]"


def uses_store(kind: str) -> bool:
    """Whether a method of ``kind`` reads stored chunk K/V (``reuse`` is a blend at 0.0; the
    others ignore the codec)."""
    return kind == "blend"


def codec_variants(methods: list, codecs: list[str]) -> list[tuple[Any, str]]:
    """``(method, codec)`` pairs to run: every method on ``none``, then each store-reading
    method on each other codec, renamed ``METHOD[codec]``."""
    out = [(m, "none") for m in methods]
    for codec in codecs:
        if codec != "none":
            out += [
                (replace(m, name=codec_method_name(m.name, codec)), codec)
                for m in methods
                if uses_store(m.kind)
            ]
    return out


class CodecStores:
    """One chunk store per codec behind one engine's blend manager."""

    def __init__(self, manager, codecs: list[str]) -> None:
        from blendkv.store import KVStore
        from blendkv.store.writer import BackgroundWriter

        self.manager = manager
        self.codecs = codecs
        self._tmp = tempfile.TemporaryDirectory(prefix="blendkv-eval-codecs-")
        base = manager.fingerprint
        self._sets = {"none": (base, manager.store, manager.writer)}
        try:
            for codec in codecs:
                if codec == "none":
                    continue
                fingerprint = base.with_codec(codec)
                store = KVStore(f"{self._tmp.name}/{codec}", fingerprint, sync=False)
                self._sets[codec] = (fingerprint, store, BackgroundWriter(store))
        except BaseException:
            self.close()
            raise

    def using(self, codec: str):
        """:meth:`use`, or nothing for ``none`` (the engine's own store)."""
        return nullcontext() if codec == "none" else self.use(codec)

    @contextmanager
    def use(self, codec: str) -> Iterator[None]:
        """Serve (and write back) chunk K/V from ``codec``'s store inside the block."""
        m = self.manager
        saved = (m.fingerprint, m.store, m.writer)
        m.fingerprint, m.store, m.writer = self._sets[codec]
        try:
            yield
        finally:
            m.writer.flush()
            m.fingerprint, m.store, m.writer = saved

    def fill(self, keys: list[bytes]) -> None:
        """Put ``none``'s values of ``keys`` into every other codec's store (each encodes them
        its way): the same chunks without computing them again."""
        manager = self.manager
        manager.flush()
        base = self._sets["none"][1]
        for codec in self.codecs:
            if codec == "none":
                continue
            store = self._sets[codec][1]
            for key in keys:
                if key not in store:
                    chunk = base.get(key, skip_memory_tier=True)
                    if chunk is not None:
                        store.put(key, chunk.kv)

    def bytes_per_token(self, codec: str, keys: list[bytes], num_tokens: int) -> float | None:
        """Stored bytes of the values of ``keys`` (what ``get_encoded`` returns: encoded values'
        tensors, scales and outlier keys included) per token of them."""
        from blendkv.store.codecs import kv_nbytes

        store = self._sets[codec][1]
        if not num_tokens:
            return None
        total = 0
        for key in keys:  # one value at a time: all of them at once are the whole store
            value = store.get_encoded(key, skip_memory_tier=True)
            if value is None:
                return None
            total += kv_nbytes(value)
        return total / num_tokens

    def close(self) -> None:
        for codec, (_, store, writer) in self._sets.items():
            if codec != "none":  # the engine's own store closes with it
                writer.close()
                store.close()
        self._sets = {k: v for k, v in self._sets.items() if k == "none"}
        self._tmp.cleanup()
