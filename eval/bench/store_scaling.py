"""How the chunk store's costs grow with its size, LMDB against Redis, side by side in one run.

``blendkv bench store --backend lmdb,redis [--sizes 1000,10000,100000] [--out DIR]``

For each model shape (SmolLM2-135M and Llama-3.1-8B K/V, 256-token bf16 chunks: 5.9 MB and
33.6 MB) and each store size N, the store is filled with N filler entries (1-token chunks of
the same model, so that N of them fit on this machine; 10^5 real 256-token chunks would take
590 GB / 3.4 TB), then, with the memory tier off:

* ``put`` of 16 real chunks (p50/p99 ms), ``get`` of them (p50/p99 ms) and ``read_into`` MB/s
  against ``torch.Tensor.copy_`` of the same bytes in the same run;
* ``get`` of random filler entries (p50/p99 us): the lookup cost at that size;
* FAISS search p50 (ms, top-10, 384 dims, one thread) by index kind at the same sizes.

Every timed read is checked bit-exact first. What did not fit is skipped and said so (Redis
keeps everything in RAM: Llama-8B fillers at 10^5 are 13 GB). Writes a JSON file and a PNG of
the curves into ``--out``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from blendkv.eval.bench.redis_server import start_redis
from blendkv.store.fingerprint import ModelFingerprint
from blendkv.store.keys import chunk_key
from blendkv.store.kv_store import KVStore
from blendkv.store.records import NewChunk

SHAPES = {"SmolLM2-135M": (30, 3, 64), "Llama-3.1-8B": (32, 8, 128)}
CHUNK_TOKENS = 256
NUM_REAL = 16
REDIS_RAM_LIMIT = 8 << 30  # fillers Redis may hold on this 24 GiB machine


def _fp(layers: int, heads: int, dim: int) -> ModelFingerprint:
    return ModelFingerprint(
        "LlamaForCausalLM",
        "bench",
        "bfloat16",
        "bench",
        {"rope_theta": 1e5},
        (1,),
        layers,
        heads,
        dim,
    )


def _value(shape, tokens: int, i: int) -> torch.Tensor:
    layers, heads, dim = shape
    kv = torch.full((layers, 2, tokens, heads, dim), float(i % 251), dtype=torch.bfloat16)
    kv.view(-1)[:4] = torch.tensor([i % 7, i % 11, i % 13, i % 17], dtype=torch.bfloat16)
    return kv


def _pcts(seconds: list[float], scale: float) -> tuple[float, float]:
    a = np.asarray(seconds) * scale
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def _open(backend: str, root: Path, fp, redis_url: str | None, tag: str):
    if backend == "lmdb":
        return KVStore(root / tag, fp, memory_tier_bytes=0, sync=False, map_size=1 << 32)
    from blendkv.store.redis_store import RedisKVStore

    return RedisKVStore(redis_url, fp, memory_tier_bytes=0, namespace=f"bench-{tag}")


def bench_store(backend, root, redis_url, model, sizes) -> list[dict]:
    shape = SHAPES[model]
    fp = _fp(*shape)
    filler_bytes = _value(shape, 1, 0).numel() * 2
    real = [_value(shape, CHUNK_TOKENS, 10**9 + i) for i in range(NUM_REAL)]
    rows, filled = [], 0
    store = _open(backend, root, fp, redis_url, f"{backend}-{model}")
    try:
        for size in sizes:
            if backend == "redis" and size * filler_bytes > REDIS_RAM_LIMIT:
                gib = size * filler_bytes / 2**30
                row = {"backend": backend, "model": model, "entries": size}
                rows.append({**row, "skipped": f"{gib:.1f} GiB of fillers in RAM"})
                continue
            t0 = time.perf_counter()
            while filled < size:  # grow the same store to the next size
                n = min(1000, size - filled)
                store.put_many(
                    [
                        NewChunk(chunk_key(fp, (1,), [filled + j]), _value(shape, 1, filled + j))
                        for j in range(n)
                    ]
                )
                filled += n
            fill_s = time.perf_counter() - t0
            rows.append(_measure(store, fp, shape, real, backend, model, size, fill_s))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        store.close()
    return rows


def _measure(store, fp, shape, real, backend, model, size, fill_s) -> dict:
    keys = [chunk_key(fp, (2,), [size, i]) for i in range(NUM_REAL)]
    put_s = []
    for key, kv in zip(keys, real, strict=True):
        t0 = time.perf_counter()
        store.put_many([NewChunk(key, kv)])
        put_s.append(time.perf_counter() - t0)
    out = torch.empty_like(real[0])
    for key, kv in zip(keys, real, strict=True):  # correctness first
        assert store.read_into(key, out) and torch.equal(out, kv), key.hex()
    get_s = []
    for key in keys:
        t0 = time.perf_counter()
        store.get(key)
        get_s.append(time.perf_counter() - t0)
    # Read and memcpy interleaved, best of 3 passes each: load from others hits both alike.
    dst = torch.empty_like(out)
    read_best = copy_best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for key in keys:
            store.read_into(key, out)
        read_best = min(read_best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for kv in real:
            dst.copy_(kv)
        copy_best = min(copy_best, time.perf_counter() - t0)
    rng = np.random.default_rng(size)
    probe_s = []
    for i in rng.integers(0, size, 500):
        key = chunk_key(fp, (1,), [int(i)])
        t0 = time.perf_counter()
        found = store.get(key)
        probe_s.append(time.perf_counter() - t0)
        assert found is not None and float(found.kv.view(-1)[-1]) == float(int(i) % 251)
    nbytes = real[0].numel() * 2
    store.delete(keys)
    put = _pcts(put_s, 1e3)
    get = _pcts(get_s, 1e3)
    probe = _pcts(probe_s, 1e6)
    return {
        "backend": backend,
        "model": model,
        "entries": size,
        "fill_s": round(fill_s, 1),
        "chunk_MB": round(nbytes / 1e6, 1),
        "put_p50_ms": put[0],
        "put_p99_ms": put[1],
        "get_p50_ms": get[0],
        "get_p99_ms": get[1],
        "read_MBps": nbytes * NUM_REAL / read_best / 1e6,
        "memcpy_MBps": nbytes * NUM_REAL / copy_best / 1e6,
        "lookup_p50_us": probe[0],
        "lookup_p99_us": probe[1],
    }


def bench_faiss(sizes) -> list[dict]:
    import faiss

    from blendkv.rag.index import ChunkIndex

    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    rows = []
    for size in sizes:
        vectors = rng.standard_normal((size, 384)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        for kind in ("flat", "ivf", "hnsw"):
            index = ChunkIndex(384, "random", kind, ivf_nlist=max(16, int(size**0.5) // 4))
            t0 = time.perf_counter()
            index.add(np.arange(size), vectors)
            build_s = time.perf_counter() - t0
            lat = []
            for q in rng.integers(0, size, 200):
                t0 = time.perf_counter()
                index.search(vectors[q], 10)
                lat.append(time.perf_counter() - t0)
            p50, p99 = _pcts(lat, 1e3)
            rows.append(
                {
                    "kind": kind,
                    "vectors": size,
                    "build_s": round(build_s, 2),
                    "search_p50_ms": p50,
                    "search_p99_ms": p99,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    rows = [r for r in results["stores"] if "skipped" not in r]
    for (backend, model), style in zip(
        sorted({(r["backend"], r["model"]) for r in rows}), ["-o", "--o", "-s", "--s"], strict=False
    ):
        mine = sorted(
            (r for r in rows if (r["backend"], r["model"]) == (backend, model)),
            key=lambda r: r["entries"],
        )
        x = [r["entries"] for r in mine]
        label = f"{backend}, {model}"
        axes[0].plot(x, [r["get_p50_ms"] for r in mine], style, label=label)
        axes[1].plot(x, [r["lookup_p50_us"] for r in mine], style, label=label)
        axes[2].plot(x, [r["read_MBps"] / r["memcpy_MBps"] for r in mine], style, label=label)
    axes[0].set(title="get of a 256-token chunk, p50 (ms)", ylabel="ms")
    axes[1].set(title="get of a random entry, p50 (us)", ylabel="us")
    axes[2].set(title="read_into MB/s / memcpy MB/s", ylabel="ratio")
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("entries in the store")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(backends: list[str], sizes: list[int], out: Path, redis_url: str | None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="blendkv-scaling-"))
    proc = None
    try:
        if "redis" in backends and redis_url is None:
            proc, redis_url = start_redis(root)
        results: dict = {"sizes": sizes, "stores": [], "faiss": []}
        for model in SHAPES:
            for backend in backends:  # side by side: each size of one model, both backends
                results["stores"] += bench_store(backend, root, redis_url, model, sizes)
        results["faiss"] = bench_faiss(sizes)
    finally:
        if proc is not None:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
    (out / "store_scaling.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "store_scaling.png")
    return results
