"""One-off A/B (2026-11-25): Redis chunk reads over the store's own RESP connections
(``store/redis_wire.py``: every part received with ``recv_into`` at its offset in one buffer)
against redis-py's ``mget`` and a join (the path before it), in one process, alternating per
request.

A private redis-server on a free port holds the chunks; the memory tier is 1 byte, so every
read goes over the socket; prefetching is off, so the reads run in the request's step. Blend
TTFT (MuSiQue, fp32, default ``BlendConfig()``), the reads' seconds, and the next-token logits
compared across modes.

    .venv/bin/python eval_results/bench/amd/redis_bulk_ab.py [--model GGUF] [--limit N]
"""

import argparse
import json
import statistics

import torch

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.eval.bench_blend import _blended, musique_setup
from blendkv.eval.bench_prefetch import _redis_server

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None)
parser.add_argument("--data", default=None)
parser.add_argument("--limit", type=int, default=3)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--dtype", default="float32")
args = parser.parse_args()
url, server = _redis_server()
examples, spec, llm = musique_setup(args, kv_store_dir=url, kv_store_memory_bytes=1)
manager, cfg = llm.blend_manager(), BlendConfig()
llm.engine.kv_connector.prefetch = False
one = SamplingParams(temperature=0.0, max_tokens=1)
prompts = [_blended(ex, spec) for ex in examples]
for p in prompts:
    llm.generate([p], one, blend=cfg)
manager.flush()
store = manager.store
bulk = store._bulk
modes = {"bulk": bulk, "redis_py": None}
rows = []
for i, p in enumerate(prompts):
    n = len(manager.prepare(p, cfg).prompt.token_ids)
    ttft, read, logits = {m: [] for m in modes}, {m: [] for m in modes}, {}
    for _ in range(args.repeats):
        for mode, reader in modes.items():
            store._bulk = reader
            out = llm.generate([p], one, blend=cfg, logits_from=n - 1)[0]
            assert out.blend_stats.chunks_hit == out.blend_stats.num_chunks, "a chunk missed"
            ttft[mode].append(out.metrics.ttft)
            read[mode].append(out.blend_stats.read_seconds)
            logits[mode] = out.extra["prompt_logits"]
    store._bulk = bulk
    row = {"example": i, "tokens": n, "identical_logits": torch.equal(*logits.values())}
    for mode in modes:
        row[f"ttft_{mode}"] = statistics.median(ttft[mode])
        row[f"read_{mode}"] = statistics.median(read[mode])
    row["ttft_bulk_over_redis_py"] = row["ttft_bulk"] / row["ttft_redis_py"]
    row["read_bulk_over_redis_py"] = row["read_bulk"] / row["read_redis_py"]
    rows.append(row)
    print(json.dumps(row), flush=True)
summary = {
    f"median_{k}": statistics.median(r[k] for r in rows)
    for k in ("ttft_bulk_over_redis_py", "read_bulk_over_redis_py")
}
summary["identical"] = all(r["identical_logits"] for r in rows)
print(json.dumps(summary))
llm.close()
server.kill()
