"""A/B of reading queued requests' chunks ahead of their step (``prefetch_kv``) against
reading them in the step that prefills them, in one process: per round, one engine configured
each way over the same store, one after the other.

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
    tmp = Path(tempfile.mkdtemp(prefix="blendkv-bench-prefetch-"))
    store_dir = str(tmp / "store")  # both modes' engines read it (LMDB: one at a time)
    if args.store == "redis":
        server, store_dir = start_redis(tmp / "redis")
    elif args.store.startswith("redis://"):
        store_dir = args.store
    runs = {"off": [], "on": []}
    try:
        for _ in range(args.rounds):
            for mode in runs:
                # One fused prefill per step (each costs more than the budget, so each goes
                # alone): both modes then batch alike, whatever the order the reads finish in.
                examples, spec, llm = musique_setup(
                    args,
                    kv_store_dir=store_dir,
                    max_num_batched_tokens=512,
                    prefetch_kv=mode == "on",
                )
                try:
                    prompts = [_blended(ex, spec) for ex in examples]
                    runs[mode].append(_run_mode(llm, prompts, page_out))
                finally:
                    llm.close()
    finally:
        if server is not None:
            server.kill()
    return _report(args, runs, len(prompts))


def _run_mode(llm, prompts, page_out) -> dict:
    """One engine's runs: the burst, then per prompt beside a decode and alone."""
    runs = _ModeRuns(llm, prompts, page_out)
    wall, outs = runs.burst()
    run = {"burst": (wall, [o.metrics.ttft for o in outs]), "examples": [], "logits": []}
    run["logits"] += [o.extra["prompt_logits"] for o in outs]
    for i in range(len(prompts)):
        out, gap = runs.beside_decode(i)
        single = runs.alone(i)
        stats = out.blend_stats
        run["examples"].append(
            (runs.lengths[i], out.metrics.ttft, gap, stats.chunks_prefetched, single.metrics.ttft)
        )
        run["logits"] += [out.extra["prompt_logits"], single.extra["prompt_logits"]]
    run["model"], run["store"] = llm.engine.info.model_name, runs.store.tier
    return run


class _ModeRuns:
    """The scenarios on one engine, every chunk read cold: its prompts' chunks are stored
    (each prompt run once) when it is made."""

    def __init__(self, llm, prompts, page_out):
        self.engine, manager = llm.engine, llm.blend_manager()
        self.store, self.page_out, self.prompts = manager.store, page_out, prompts
        self.cfg = BlendConfig()
        self.one = SamplingParams(temperature=0.0, max_tokens=1)
        states = [manager.prepare(prompt, self.cfg) for prompt in prompts]
        self.lengths = [len(state.prompt.token_ids) for state in states]
        for prompt in prompts:  # every chunk in the store, read once (checksums checked)
            llm.generate([prompt], self.one, blend=self.cfg)
        manager.flush()
        self.keys = [k for state in states for k in state.chunk_keys]

    def cold(self) -> None:
        if self.store.tier == "lmdb":
            self.page_out(self.store, self.keys)
        self.store.memory_tier.clear()

    def add(self, i: int) -> str:
        """Prompt ``i``, blended, one token, its last row's logits kept."""
        return self.engine.add_request(
            self.prompts[i], self.one, blend=self.cfg, logits_from=self.lengths[i] - 1
        )

    def burst(self):
        self.cold()
        t0 = time.perf_counter()
        ids = [self.add(i) for i in range(len(self.prompts))]
        outs = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    outs[out.request_id] = out
        return time.perf_counter() - t0, [outs[i] for i in ids]

    def beside_decode(self, i: int):
        engine = self.engine
        params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        decode_id = engine.add_request("Count from one to a thousand: one, two,", params)
        for _ in range(3):
            engine.step()
        self.cold()
        blend_id = self.add(i)
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

    def alone(self, i: int):
        self.cold()
        rid = self.add(i)
        while True:
            for out in self.engine.step():
                if out.request_id == rid and out.finished:
                    return out


def _report(args, runs: dict, num_prompts: int) -> int:
    """Medians over rounds per mode, the on/off ratios; correctness: every request's logits
    bit-identical across modes and rounds."""
    first = runs["off"][0]["logits"]
    identical = all(
        torch.equal(a, b)
        for r in runs["off"] + runs["on"]
        for a, b in zip(first, r["logits"], strict=True)
    )
    rows = []
    for i in range(len(runs["off"][0]["examples"])):
        row = {"example": i, "tokens": runs["off"][0]["examples"][i][0]}
        for mode, rs in runs.items():
            vals = [r["examples"][i] for r in rs]
            row[f"ttft_{mode}"] = statistics.median(v[1] for v in vals)
            row[f"decode_gap_{mode}"] = statistics.median(v[2] for v in vals)
            row[f"chunks_prefetched_{mode}"] = min(v[3] for v in vals)
            row[f"ttft_alone_{mode}"] = statistics.median(v[4] for v in vals)
        row["ttft_on_over_off"] = row["ttft_on"] / row["ttft_off"]
        row["gap_on_over_off"] = row["decode_gap_on"] / row["decode_gap_off"]
        row["alone_on_over_off"] = row["ttft_alone_on"] / row["ttft_alone_off"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {
        "model": runs["off"][0]["model"],
        "store": runs["off"][0]["store"],
        "dtype": args.dtype,
        "identical": identical,
    }
    for mode, rs in runs.items():
        summary[f"burst_wall_{mode}"] = statistics.median(r["burst"][0] for r in rs)
        summary[f"burst_median_ttft_{mode}"] = statistics.median(
            statistics.median(r["burst"][1]) for r in rs
        )
    summary["burst_wall_on_over_off"] = summary["burst_wall_on"] / summary["burst_wall_off"]
    for key in ("ttft_on_over_off", "gap_on_over_off", "alone_on_over_off"):
        summary[f"median_{key}"] = statistics.median(r[key] for r in rows)
    print(f"\ncorrectness: logits bit-identical in both modes on every request: {identical}")
    print(
        f"burst of {num_prompts}: wall {summary['burst_wall_off']:.3f} s -> "
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
