"""One-off A/B (2026-11-25): ProphetKV's query rows (the default ``BlendConfig()``) attended
and scored by one C++ call (``rows_attention`` with ``mass``: a second pass over the scores)
against the torch product it replaced (``attention_with_mass``).

Same process, alternating per request (``torch_attention.query_rows_attention`` patched to
take the torch path). Blend TTFT (MuSiQue, fp32, warm store), the chunks' recomputed rows
(the selection the scores made) and the first answer token's logits compared.

    .venv/bin/python eval_results/bench/amd/query_mass_kernel_ab.py [--model GGUF] [--limit N]
"""

import json
import statistics

from ab_common import setup

from blendkv.kernels import attention_mass
from blendkv.kernels import torch_attention as backend_module

args, llm, manager, cfg, one, prompts = setup(repeats=3)
kernel = backend_module.query_rows_attention


def torch_path(compiled, *rest):
    return attention_mass.query_rows_attention(None, *rest)


modes = {"cpp": kernel, "torch": torch_path}
rows = []
for i, p in enumerate(prompts):
    n = len(manager.prepare(p, cfg).prompt.token_ids)
    ttft = {m: [] for m in modes}
    logits, recomputed = {}, {}
    for _ in range(args.repeats):
        for mode, fn in modes.items():
            backend_module.query_rows_attention = fn
            out = llm.generate([p], one, blend=cfg, logits_from=n - 1)[0]
            ttft[mode].append(out.metrics.ttft)
            logits[mode] = out.extra["prompt_logits"]
            recomputed[mode] = out.blend_stats.reused_tokens_recomputed
    backend_module.query_rows_attention = kernel
    diff = float((logits["cpp"] - logits["torch"]).abs().max())
    row = {"example": i, "tokens": n, "max_logit_diff": diff}
    row["same_first_token"] = int(logits["cpp"].argmax()) == int(logits["torch"].argmax())
    row["recomputed"] = recomputed
    row.update({f"ttft_{m}": statistics.median(v) for m, v in ttft.items()})
    row["cpp_over_torch"] = row["ttft_cpp"] / row["ttft_torch"]
    rows.append(row)
    print(json.dumps(row), flush=True)
print(json.dumps({"median_cpp_over_torch": statistics.median(r["cpp_over_torch"] for r in rows)}))
