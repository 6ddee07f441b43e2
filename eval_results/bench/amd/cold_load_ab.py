"""One-off A/B (2026-11-25): pipelined against serial K/V loading when the chunks' LMDB pages
are not in memory (a long-running engine whose page cache lost them), and when they are.

In one process, alternating per request: before each "cold" request the pages of the prompt's
chunk values are paged out with ``madvise(MADV_PAGEOUT)`` over their range in LMDB's memory map
(Linux 5.4+; ``mincore`` checks how many stayed resident), so the loading thread (pipelined)
or the serial writes fault them in from the disk. Every chunk was read once before (its
checksum checked), as in a server that has served it. Blend TTFT (MuSiQue, fp32), the load
seconds the stats report, and the first answer token's logits compared across modes.

    .venv/bin/python eval_results/bench/amd/cold_load_ab.py [--model GGUF] [--limit N]
"""

import json
import statistics

from ab_common import page_out, setup

args, llm, manager, cfg, one, prompts = setup(repeats=3)
store = manager.store
connector = llm.engine.kv_connector
modes = {"pipelined": True, "serial": False}
rows = []
for i, p in enumerate(prompts):
    plan = manager.prepare(p, cfg)
    n = len(plan.prompt.token_ids)
    ttft = {f"{m}_{t}": [] for m in modes for t in ("cold", "warm")}
    load = {k: [] for k in ttft}
    read = {k: [] for k in ttft}
    left = []
    logits = {}
    for _ in range(args.repeats):
        for mode, pipelined in modes.items():
            connector.pipelined = pipelined
            for temp in ("cold", "warm"):
                if temp == "cold":
                    left.append(page_out(store, plan.chunk_keys))
                out = llm.generate([p], one, blend=cfg, logits_from=n - 1)[0]
                ttft[f"{mode}_{temp}"].append(out.metrics.ttft)
                load[f"{mode}_{temp}"].append(out.blend_stats.write_seconds)
                read[f"{mode}_{temp}"].append(out.blend_stats.read_seconds)
                logits[f"{mode}_{temp}"] = out.extra["prompt_logits"]
    connector.pipelined = True
    ref = logits["serial_warm"]
    row = {"example": i, "tokens": n, "resident_after_pageout_max": max(left)}
    row["identical_logits"] = all(bool((v == ref).all()) for v in logits.values())
    for k in ttft:
        row[f"ttft_{k}"] = statistics.median(ttft[k])
        row[f"write_{k}"] = statistics.median(load[k])
        row[f"read_{k}"] = statistics.median(read[k])
    row["cold_pipelined_over_serial"] = row["ttft_pipelined_cold"] / row["ttft_serial_cold"]
    row["warm_pipelined_over_serial"] = row["ttft_pipelined_warm"] / row["ttft_serial_warm"]
    rows.append(row)
    print(json.dumps(row), flush=True)
summary = {
    f"median_{k}": statistics.median(r[k] for r in rows)
    for k in ("cold_pipelined_over_serial", "warm_pipelined_over_serial")
}
print(json.dumps(summary))
