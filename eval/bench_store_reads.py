"""A/B of how a blended request reads its chunks from LMDB, in one process, alternating.

    python -m blendkv.eval.bench_store_reads [--model PATH] [--limit 3] [--rounds 3]
        [--methods reuse,blend] [--dtype float32] [--json PATH]

- ``views`` (the default on the CPU): one read snapshot per step; every chunk is a zero-copy
  view of LMDB's memory map, read layer by layer by the loading thread while the forward runs
  (:meth:`KVStore.snapshot`).
- ``copies`` (the path before it): ``store.get`` copies each chunk out of the map into a new
  tensor before the forward.

The memory tier is off (1 byte), so every read goes to LMDB (warm in the page cache after the
first). For each MuSiQue example and method (``reuse`` = ratio 0, ``blend`` = BlendConfig's
default), the two modes alternate ``--rounds`` times. Correctness first: both modes' next-token
logits must be bit-identical on every example. Prints each median TTFT and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from blendkv import SamplingParams
    from blendkv.blend.config import BlendConfig
    from blendkv.eval.bench_blend import _blended, musique_setup

    p = argparse.ArgumentParser(prog="python -m blendkv.eval.bench_store_reads")
    p.add_argument("--model", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", default="reuse,blend")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    # kv_store_memory_bytes=1: nothing fits the memory tier, every read goes to LMDB
    examples, spec, llm = musique_setup(args, kv_store_memory_bytes=1)
    manager = llm.blend_manager()
    loader = llm.engine.kv_connector._loader
    one = SamplingParams(temperature=0.0, max_tokens=1)
    configs = {"reuse": BlendConfig(recompute_ratio=0.0), "blend": BlendConfig()}
    methods = [m for m in args.methods.split(",") if m]
    prompts = [_blended(ex, spec) for ex in examples]
    for prompt in prompts:  # warm the store and the page cache (and the first-read checksums)
        manager.precompute(manager.prepare(prompt, configs["blend"]).prompt.chunks)
        llm.generate([prompt], one, blend=configs["reuse"])

    def run(prompt, cfg, zero_copy: bool):
        loader.zero_copy_reads = zero_copy
        n = len(manager.prepare(prompt, cfg).prompt.token_ids)
        out = llm.generate([prompt], one, blend=cfg, logits_from=n - 1)[0]
        assert out.blend_stats.chunks_hit == out.blend_stats.num_chunks, "a chunk missed"
        return out

    rows, identical = [], True
    for i, prompt in enumerate(prompts):
        for method in methods:
            cfg = configs[method]
            ttft = {"views": [], "copies": []}
            read = {"views": [], "copies": []}
            logits = {}
            for _ in range(args.rounds):
                for mode in ("views", "copies"):
                    out = run(prompt, cfg, mode == "views")
                    ttft[mode].append(out.metrics.ttft)
                    read[mode].append(out.blend_stats.read_seconds)
                    logits[mode] = out.extra["prompt_logits"]
            same = torch.equal(logits["views"], logits["copies"])
            identical &= same
            row = {"example": i, "method": method, "identical_logits": same}
            for mode in ttft:
                row[f"ttft_{mode}"] = statistics.median(ttft[mode])
                row[f"read_s_{mode}"] = statistics.median(read[mode])
            row["ratio"] = row["ttft_views"] / row["ttft_copies"]
            rows.append(row)
            print(json.dumps(row))
    loader.zero_copy_reads = True
    print(f"\ncorrectness: logits bit-identical in both modes on every request: {identical}")
    head = f"{'method':8} {'views TTFT':>11} {'copies TTFT':>12} {'ratio':>7}"
    print(f"{head} {'reads before forward':>22}")
    summary = {"model": llm.engine.info.model_name, "dtype": args.dtype, "identical": identical}
    for method in methods:
        sel = [r for r in rows if r["method"] == method]
        views = statistics.median(r["ttft_views"] for r in sel)
        copies = statistics.median(r["ttft_copies"] for r in sel)
        ratio = statistics.median(r["ratio"] for r in sel)
        rv = statistics.median(r["read_s_views"] for r in sel)
        rc = statistics.median(r["read_s_copies"] for r in sel)
        cols = f"{method:8} {views:>10.3f}s {copies:>11.3f}s {ratio:>6.3f}x"
        print(f"{cols} {rv:>12.3f} / {rc:.3f} s")
        summary[method] = {"ttft_views_s": views, "ttft_copies_s": copies, "ratio": ratio}
    print(json.dumps({"store_reads_bench": summary}))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    llm.close()
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
