"""Shared helpers of the store tests; also run as a script by the fault tests' subprocesses."""

from __future__ import annotations

import sys
import time

import torch

from blendkv.store.fingerprint import ModelFingerprint
from blendkv.store.keys import chunk_key
from blendkv.store.kv_store import KVStore
from blendkv.store.records import NewChunk

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 4
ANCHOR = (1,)


def make_fingerprint(**overrides) -> ModelFingerprint:
    fields = dict(
        architecture="LlamaForCausalLM",
        weights_hash="w" * 8,
        dtype="bfloat16",
        tokenizer_hash="t" * 8,
        rope={"rope_theta": 10000.0, "rope_scaling": None},
        anchor_token_ids=ANCHOR,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
    )
    fields.update(overrides)
    return ModelFingerprint(**fields)


def make_kv(seed: int, num_tokens: int = 8, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, 2, num_tokens, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype)


def key_of(i: int) -> bytes:
    return chunk_key(make_fingerprint(), ANCHOR, [i])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included), not numeric equality."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = lambda t: t.contiguous().view(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(bits(a), bits(b))


NUM_CONCURRENT = 48


def reader_main(path: str, readonly: bool, stop_at: float, ready, results) -> None:
    """Read chunks in a loop while another process writes; report (exact, none, bad) counts."""
    seen = bad = none = 0
    with KVStore(path, make_fingerprint(), readonly=readonly, memory_tier_bytes=0) as s:
        ready.put(True)
        i = 0
        while time.time() < stop_at and seen < NUM_CONCURRENT:
            i = (i * 7 + 3) % NUM_CONCURRENT
            out = torch.empty(2, 2, 512, 2, 4, dtype=torch.bfloat16)
            got = s.get(key_of(i))
            if got is None:
                none += 1
            elif same_bits(got.kv, make_kv(i, 512)):
                if s.read_into(key_of(i), out) and same_bits(out, got.kv):
                    seen += 1
                else:
                    bad += 1
            else:
                bad += 1
    results.put((seen, none, bad))


def _writer_main(path: str, num_batches: int, batch: int, num_tokens: int) -> None:
    """Write batches forever-ish, announcing each commit on stdout (killed by the test)."""
    store = KVStore(path, make_fingerprint(), map_size=1 << 20)
    for b in range(num_batches):
        ids = range(b * batch, (b + 1) * batch)
        store.put_many([NewChunk(key_of(i), make_kv(i, num_tokens), doc_id="d") for i in ids])
        print(f"committed {b}", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    _writer_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
