"""One-off A/B (2026-11-25): deferred LMDB reads (a thread fetches the chunk values while the
full layer computes; ``ChunkLoader.defer_reads``, the default) against reading them before the
forward, with the chunks' pages cold (paged out) and warm, on the engine's default loading
mode here (serial writes: 2 cores, no spare one).

In one process, alternating per request: before each "cold" request the pages of the prompt's
chunk values are paged out with ``madvise(MADV_PAGEOUT)`` (Linux 5.4+; ``mincore`` checks how
many stayed resident), as in ``cold_load_ab.py``. Blend TTFT (MuSiQue, fp32, the default
CacheBlend's blend@0.15: its full layer 0 is what the reads hide behind; the default
ProphetKV's query pass reads every layer's K/V first, so it has nothing to hide them behind),
the reads' seconds and their hidden part, and the first answer token's
logits compared across modes.

    .venv/bin/python eval_results/bench/amd/deferred_reads_ab.py [--model GGUF] [--limit N]
"""

import json
import statistics

from ab_common import page_out, setup

from blendkv.blend.config import BlendConfig

args, llm, manager, _, one, prompts = setup(repeats=3)
cfg = BlendConfig(selection="v_deviation", recompute_ratio=0.15)
store = manager.store
loader = llm.engine.kv_connector._loader
modes = {"deferred": True, "before": False}
rows = []
for i, p in enumerate(prompts):
    plan = manager.prepare(p, cfg)
    n = len(plan.prompt.token_ids)
    keys = [f"{m}_{t}" for m in modes for t in ("cold", "warm")]
    left, logits = [], {}
    ttft, read, hidden = ({k: [] for k in keys} for _ in range(3))
    for _ in range(args.repeats):
        for mode, defer in modes.items():
            loader.defer_reads = defer
            for temp in ("cold", "warm"):
                if temp == "cold":
                    left.append(page_out(store, plan.chunk_keys))
                out = llm.generate([p], one, blend=cfg, logits_from=n - 1)[0]
                k = f"{mode}_{temp}"
                ttft[k].append(out.metrics.ttft)
                read[k].append(out.blend_stats.read_seconds)
                hidden[k].append(out.blend_stats.read_hidden_seconds)
                logits[k] = out.extra["prompt_logits"]
    loader.defer_reads = True
    ref = logits["before_warm"]
    row = {"example": i, "tokens": n, "resident_after_pageout_max": max(left)}
    row["identical_logits"] = all(bool((v == ref).all()) for v in logits.values())
    for k in keys:
        row[f"ttft_{k}"] = statistics.median(ttft[k])
        row[f"read_{k}"] = statistics.median(read[k])
        row[f"read_hidden_{k}"] = statistics.median(hidden[k])
    row["cold_deferred_over_before"] = row["ttft_deferred_cold"] / row["ttft_before_cold"]
    row["warm_deferred_over_before"] = row["ttft_deferred_warm"] / row["ttft_before_warm"]
    rows.append(row)
    print(json.dumps(row), flush=True)
summary = {
    f"median_{k}": statistics.median(r[k] for r in rows)
    for k in ("cold_deferred_over_before", "warm_deferred_over_before")
}
print(json.dumps(summary))
