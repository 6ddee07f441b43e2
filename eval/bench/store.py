"""Store benchmark: ``blendkv bench store [--quick]``; with ``--backend lmdb,redis`` the
scaling benchmark of :mod:`blendkv.eval.bench.store_scaling` (costs against store size) instead.

Side by side in one run (ratios matter; absolute times drift on shared machines):

1. reading chunk K/V from a warm store into a preallocated tensor (``read_into``, with and
   without checksum verification) vs ``torch.Tensor.copy_`` of the same bytes between
   preallocated buffers;
2. write throughput (``put``, fsync on commit);
3. lookup latency (``get`` of small values, memory tier off) at 10^3 and 10^5 entries;
4. FAISS search latency (flat inner product, 384 dims) at 10^4 and 10^5 vectors.

Every timed path is checked bit-exact first. Data goes to a temp dir that is deleted after.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from blendkv.store.fingerprint import ModelFingerprint
from blendkv.store.keys import chunk_key
from blendkv.store.kv_store import KVStore
from blendkv.store.records import NewChunk

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; 512-token chunks in bfloat16.
LAYERS, KV_HEADS, HEAD_DIM, TOKENS = 30, 3, 64, 512
CHUNK_SHAPE = (LAYERS, 2, TOKENS, KV_HEADS, HEAD_DIM)
CHUNK_BYTES = int(np.prod(CHUNK_SHAPE)) * 2  # 11,796,480 bytes = 11.25 MiB


def _fingerprint(layers: int, heads: int, head_dim: int) -> ModelFingerprint:
    return ModelFingerprint(
        "LlamaForCausalLM",
        "bench",
        "bfloat16",
        "bench",
        {"rope_theta": 1e5},
        (1,),
        layers,
        heads,
        head_dim,
    )


def _chunk(base: torch.Tensor, i: int) -> torch.Tensor:
    kv = base.clone()
    kv.view(-1)[:4] = i  # make every chunk distinct, cheaply
    return kv


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def bench_read_write(root: Path, num_chunks: int, repeats: int) -> dict:
    fp = _fingerprint(LAYERS, KV_HEADS, HEAD_DIM)
    base = torch.randn(CHUNK_SHAPE).to(torch.bfloat16)
    keys = [chunk_key(fp, (1,), [i]) for i in range(num_chunks)]
    res: dict = {"chunk_bytes": CHUNK_BYTES, "num_chunks": num_chunks}
    with KVStore(root / "kv", fp, memory_tier_bytes=0, map_size=1 << 30) as store:
        start = time.perf_counter()
        for i, key in enumerate(keys):
            store.put(key, _chunk(base, i))
        elapsed = time.perf_counter() - start
        res["write_MBps"] = num_chunks * CHUNK_BYTES / elapsed / 1e6
    src = torch.empty((num_chunks, *CHUNK_SHAPE), dtype=torch.bfloat16)
    for i in range(num_chunks):
        src[i] = _chunk(base, i)
    modes = {"checked": True, "once": "once", "unchecked": False}
    best = {}
    for name, verify in modes.items():
        best.update(_best_reads(root / "kv", fp, keys, src, verify, name, repeats))
    gbps = lambda seconds: num_chunks * CHUNK_BYTES / seconds / 1e9  # noqa: E731
    for name in modes:
        res[f"{name}_GBps"] = gbps(best[name])
    res["memcpy_GBps"] = gbps(min(best[f"{name}_memcpy"] for name in modes))
    # each read against the copies timed beside it
    res["read_vs_memcpy"] = best["checked_memcpy"] / best["checked"]
    res["read_once_vs_memcpy"] = best["once_memcpy"] / best["once"]
    res["read_unchecked_vs_memcpy"] = best["unchecked_memcpy"] / best["unchecked"]
    return res


def _best_reads(path, fp, keys, src, verify, name: str, repeats: int) -> dict:
    """Best seconds of reading every chunk from a store opened with ``verify_reads=verify``
    (after one checked pass: a "once" store has verified each chunk by then), interleaved
    with a ``copy_`` of the same bytes between preallocated buffers (``<name>_memcpy``), so
    that load from other users of the machine hits both alike."""
    out, dst = torch.empty_like(src[0]), torch.empty_like(src[0])

    def memcpy() -> None:
        for i in range(len(keys)):
            dst.copy_(src[i])

    best = {name: float("inf"), f"{name}_memcpy": float("inf")}
    with KVStore(path, fp, memory_tier_bytes=0, map_size=1 << 30, verify_reads=verify) as store:
        for i, key in enumerate(keys):  # correctness first; also warms the page cache
            assert store.read_into(key, out) and _bits_equal(out, src[i]), i

        def read() -> None:
            for key in keys:
                store.read_into(key, out)

        for _ in range(repeats):
            for label, fn in ((name, read), (f"{name}_memcpy", memcpy)):
                start = time.perf_counter()
                fn()
                best[label] = min(best[label], time.perf_counter() - start)
        assert _bits_equal(out, src[-1]) and _bits_equal(dst, src[-1])
    return best


def bench_lookup(root: Path, num_entries: int, probes: int = 2000) -> dict:
    fp = _fingerprint(2, 2, 4)
    shape = (2, 2, 8, 2, 4)
    # LRU touches written at close only: the timed path is the read, not the batched writes
    path = root / f"small{num_entries}"
    with KVStore(path, fp, memory_tier_bytes=0, sync=False, touch_flush_every=10**9) as store:
        batch = []
        for i in range(num_entries):
            kv = torch.full(shape, float(i % 256), dtype=torch.bfloat16)
            batch.append(NewChunk(chunk_key(fp, (1,), [i]), kv))
            if len(batch) == 1000 or i == num_entries - 1:
                store.put_many(batch)
                batch = []
        rng = np.random.default_rng(0)
        ids = rng.integers(0, num_entries, probes)
        keys = [chunk_key(fp, (1,), [int(i)]) for i in ids]
        assert float(store.get(keys[0]).kv.view(-1)[0]) == float(ids[0] % 256)
        lat = np.empty(probes)
        for j, key in enumerate(keys):
            t0 = time.perf_counter()
            store.get(key)
            lat[j] = time.perf_counter() - t0
        miss = chunk_key(fp, (1,), [num_entries + 1])
        t0 = time.perf_counter()
        for _ in range(probes):
            store.get(miss)
        miss_us = (time.perf_counter() - t0) / probes * 1e6
    return {
        "entries": num_entries,
        "get_p50_us": float(np.percentile(lat, 50) * 1e6),
        "get_p99_us": float(np.percentile(lat, 99) * 1e6),
        "miss_us": miss_us,
    }


def bench_faiss(num_vectors: int, queries: int = 200) -> dict:
    import faiss

    from blendkv.rag.index import ChunkIndex

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((num_vectors, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = ChunkIndex(384, "random", "flat")
    index.add(np.arange(num_vectors), vectors)
    assert index.search(vectors[123], 1)[0][0] == 123
    res = {"vectors": num_vectors}
    default_threads = faiss.omp_get_max_threads()
    # One query is too little work to split: OpenMP threads spin-wait on a busy machine.
    for threads in (default_threads, 1):
        faiss.omp_set_num_threads(threads)
        lat = np.empty(queries)
        for j in range(queries):
            q = vectors[rng.integers(num_vectors)]
            t0 = time.perf_counter()
            index.search(q, 10)
            lat[j] = time.perf_counter() - t0
        res[f"p50_ms_{threads}thr"] = float(np.percentile(lat, 50) * 1e3)
        res[f"p99_ms_{threads}thr"] = float(np.percentile(lat, 99) * 1e3)
    faiss.omp_set_num_threads(default_threads)
    return res


def main(args: argparse.Namespace) -> dict:
    if args.backend is not None:
        from blendkv.eval.bench.store_scaling import run

        sizes = [int(x) for x in args.sizes.split(",")]
        return run(args.backend, sizes, Path(args.out), args.redis_url)
    num_chunks = args.chunks or (16 if args.quick else 128)
    root = Path(tempfile.mkdtemp(prefix="blendkv-bench-", dir=args.dir))
    free = shutil.disk_usage(root).free
    need = int(num_chunks * CHUNK_BYTES * 1.3) + (1 << 30)
    if free < need:
        num_chunks = max(4, int((free - (1 << 30)) / (CHUNK_BYTES * 1.3)))
        print(f"only {free >> 20} MiB free: scaled the read bench to {num_chunks} chunks")
    total_gb = num_chunks * CHUNK_BYTES / 1e9
    print(
        f"chunk {CHUNK_SHAPE} bf16 = {CHUNK_BYTES:,} bytes; {num_chunks} chunks = "
        f"{total_gb:.2f} GB (1000 would be 11.8 GB, too much to keep warm)"
    )
    try:
        results = {"quick": args.quick, "torch_threads": torch.get_num_threads()}
        results["read_write"] = bench_read_write(root, num_chunks, repeats=2 if args.quick else 3)
        sizes = (1_000, 10_000) if args.quick else (1_000, 100_000)
        results["lookup"] = [bench_lookup(root, n) for n in sizes]
        results["faiss"] = [bench_faiss(n) for n in (10_000, 100_000)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rw = results["read_write"]
    print(f"{'measure':52s} {'value':>15s}")
    rows = [
        ("read_into, checksum on (GB/s)", rw["checked_GBps"]),
        ("read_into, checksum first read only (GB/s)", rw["once_GBps"]),
        ("read_into, checksum off (GB/s)", rw["unchecked_GBps"]),
        ("torch copy_ of the same bytes (GB/s)", rw["memcpy_GBps"]),
        ("read (checked) / memcpy", rw["read_vs_memcpy"]),
        ("read (checked first read only, default) / memcpy", rw["read_once_vs_memcpy"]),
        ("read (unchecked) / memcpy", rw["read_unchecked_vs_memcpy"]),
        ("write, fsync per chunk (MB/s)", rw["write_MBps"]),
    ]
    rows += [
        (f"get p50 / p99 at {r['entries']:,} (us)", (r["get_p50_us"], r["get_p99_us"]))
        for r in results["lookup"]
    ]
    rows += [(f"miss at {r['entries']:,} (us)", r["miss_us"]) for r in results["lookup"]]
    for r in results["faiss"]:
        for key in sorted(k for k in r if k.startswith("p50_ms_")):
            thr = key.removeprefix("p50_ms_")
            name = f"faiss flat top-10 at {r['vectors']:,}, {thr} p50/p99 (ms)"
            rows.append((name, (r[key], r[f"p99_ms_{thr}"])))
    for name, value in rows:
        text = " / ".join(f"{v:.2f}" for v in value) if isinstance(value, tuple) else f"{value:.2f}"
        print(f"{name:52s} {text:>15s}")
    print(json.dumps(results))
    return results
