"""A/B of reading queued requests' chunks ahead of their step (``prefetch_kv``) against
reading them in the step that prefills them, in one process, alternating.

    blendkv bench prefetch [--model PATH] [--limit 3] [--rounds 2]
        [--store lmdb|redis|redis://HOST:PORT/DB] [--dtype float32] [--json PATH]

Every read is cold (LMDB's pages paged out, or Redis values over the socket). Scenarios:
**burst** (``--limit`` prompts at once: wall time, median TTFT), **beside a decode** (the
blended request's TTFT, the decode's longest gap) and **alone** (TTFT). Correctness first:
next-token logits must be bit-identical in both modes. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig


def main(args: argparse.Namespace) -> int:
    from blendkv.eval.bench.blend import _blended, musique_setup
    from blendkv.eval.bench.page_cache import page_out
    from blendkv.eval.bench.redis_server import start_redis

    server = None
    store_dir = None
    if args.store == "redis":
        server, store_dir = start_redis(Path(tempfile.mkdtemp(prefix="blendkv-bench-redis-")))
    elif args.store.startswith("redis://"):
        store_dir = args.store
    # One fused prefill per step (each costs more than the budget, so each goes alone): both
    # modes then batch alike, whatever the order the reads finish in.
    examples, spec, llm = musique_setup(args, kv_store_dir=store_dir, max_num_batched_tokens=512)
    try:
        return _run(args, llm, [_blended(ex, spec) for ex in examples], page_out)
    finally:
        llm.close()
        if server is not None:
            server.kill()


def _run(args, llm, prompts, page_out) -> int:
    engine, manager = llm.engine, llm.blend_manager()
    connector = engine.kv_connector
    store = manager.store
    cfg = BlendConfig()
    one = SamplingParams(temperature=0.0, max_tokens=1)
    states = [manager.prepare(prompt, cfg) for prompt in prompts]
    lengths = [len(state.prompt.token_ids) for state in states]
    for prompt in prompts:  # every chunk in the store, read once (checksums checked)
        llm.generate([prompt], one, blend=cfg)
    manager.flush()
    keys = [k for state in states for k in state.chunk_keys]

    def cold() -> None:
        if store.tier == "lmdb":
            page_out(store, keys)
        store.memory_tier.clear()

    def burst():
        cold()
        t0 = time.perf_counter()
        ids = [
            engine.add_request(prompt, one, blend=cfg, logits_from=n - 1)
            for prompt, n in zip(prompts, lengths, strict=True)
        ]
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
        wall = time.perf_counter() - t0
        return wall, [outs[i] for i in ids]

    def alone(i: int):
        cold()
        rid = engine.add_request(prompts[i], one, blend=cfg, logits_from=lengths[i] - 1)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    done = out
        return done

    def beside_decode(i: int):
        params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        decode_id = engine.add_request("Count from one to a thousand: one, two,", params)
        for _ in range(3):
            engine.step()
        cold()
        blend_id = engine.add_request(prompts[i], one, blend=cfg, logits_from=lengths[i] - 1)
        last, gap, blended = time.perf_counter(), 0.0, None
        while blended is None:
            for out in engine.step():
                now = time.perf_counter()
                if out.request_id == decode_id:
                    gap, last = max(gap, now - last), now
                elif out.request_id == blend_id:
                    blended = out
        gap = max(gap, time.perf_counter() - last)
        engine.abort_request(decode_id)
        return blended, gap

    rows, identical = [], True
    logits: dict[tuple, dict[str, torch.Tensor]] = {}
    burst_runs = {"off": [], "on": []}
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            connector.prefetch = mode == "on"
            wall, outs = burst()
            burst_runs[mode].append((wall, [o.metrics.ttft for o in outs]))
            for i, out in enumerate(outs):
                logits.setdefault(("burst", i), {})[mode] = out.extra["prompt_logits"]
    for i in range(len(prompts)):
        runs = {"off": [], "on": []}
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                connector.prefetch = mode == "on"
                out, gap = beside_decode(i)
                single = alone(i)
                stats = out.blend_stats
                runs[mode].append((out.metrics.ttft, gap, stats.chunks_prefetched, single))
                logits.setdefault(("decode", i), {})[mode] = out.extra["prompt_logits"]
                logits.setdefault(("alone", i), {})[mode] = single.extra["prompt_logits"]
        row = {"example": i, "tokens": lengths[i]}
        for mode, vals in runs.items():
            row[f"ttft_{mode}"] = statistics.median(v[0] for v in vals)
            row[f"decode_gap_{mode}"] = statistics.median(v[1] for v in vals)
            row[f"chunks_prefetched_{mode}"] = min(v[2] for v in vals)
            row[f"ttft_alone_{mode}"] = statistics.median(v[3].metrics.ttft for v in vals)
        row["ttft_on_over_off"] = row["ttft_on"] / row["ttft_off"]
        row["gap_on_over_off"] = row["decode_gap_on"] / row["decode_gap_off"]
        row["alone_on_over_off"] = row["ttft_alone_on"] / row["ttft_alone_off"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    connector.prefetch = None  # the engine's default again
    for pair in logits.values():
        identical &= torch.equal(pair["off"], pair["on"])
    summary = {
        "model": engine.info.model_name,
        "store": store.tier,
        "dtype": args.dtype,
        "identical": identical,
    }
    for mode, vals in burst_runs.items():
        summary[f"burst_wall_{mode}"] = statistics.median(v[0] for v in vals)
        summary[f"burst_median_ttft_{mode}"] = statistics.median(
            statistics.median(v[1]) for v in vals
        )
    summary["burst_wall_on_over_off"] = summary["burst_wall_on"] / summary["burst_wall_off"]
    for key in ("ttft_on_over_off", "gap_on_over_off", "alone_on_over_off"):
        summary[f"median_{key}"] = statistics.median(r[key] for r in rows)
    print(f"\ncorrectness: logits bit-identical in both modes on every request: {identical}")
    print(
        f"burst of {len(prompts)}: wall {summary['burst_wall_off']:.3f} s -> "
        f"{summary['burst_wall_on']:.3f} s ({summary['burst_wall_on_over_off']:.3f}x), median "
        f"TTFT {summary['burst_median_ttft_off']:.3f} -> {summary['burst_median_ttft_on']:.3f} s"
    )
    print(
        f"beside a decode: blended TTFT {summary['median_ttft_on_over_off']:.3f}x, the decode's "
        f"longest gap {summary['median_gap_on_over_off']:.3f}x (prefetch on over off)"
    )
    print(f"alone (an idle engine): TTFT {summary['median_alone_on_over_off']:.3f}x")
    print(json.dumps({"prefetch_bench": summary}))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    return 0 if identical else 1
