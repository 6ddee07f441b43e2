"""One-off A/B (2026-11-25): does reading/writing only the half of the pool a step needs
(K for ProphetKV's query mass and the default K correction) speed up a CPU blend?

"both" emulates the code before (read_kv of K and V for the query mass; read K and V of the
recomputed and kept rows and write both back in the correction) by touching the other half
too; "k_only" is the code now. Same process, alternating, logits checked bit-identical.

    .venv/bin/python eval_results/bench/amd/kv_half_reads.py
"""

import json
import statistics
from pathlib import Path

import torch

import blendkv.blend.correction as corr
from blendkv import LLM, SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.eval.bench_blend import DEFAULT_DATA, _blended
from blendkv.eval.datasets import load_cacheblend_json
from blendkv.eval.prompts import get_prompt_spec
from blendkv.kernels.torch_attention import TorchAttentionBackend

read_half, write_half, add_mass = corr._read, corr._write, TorchAttentionBackend.add_query_mass


def read_both(kv_cache, half, slots):
    read_half(kv_cache, 1 - half, slots)  # the other half, read for nothing as before
    return read_half(kv_cache, half, slots)


def write_both(kv_cache, half, rows, slots):
    write_half(kv_cache, 1 - half, read_half(kv_cache, 1 - half, slots), slots)
    write_half(kv_cache, half, rows, slots)


def mass_both(self, scores, q, q_positions, kv_cache, slots, visible_prefix=0):
    self.read_kv(kv_cache, slots)  # before: K and V gathered, V unused
    add_mass(self, scores, q, q_positions, kv_cache, slots, visible_prefix)


def set_mode(mode):
    both = mode == "both"
    corr._read = read_both if both else read_half
    corr._write = write_both if both else write_half
    TorchAttentionBackend.add_query_mass = mass_both if both else add_mass


examples = load_cacheblend_json(Path(DEFAULT_DATA), limit=3)
spec = get_prompt_spec("musique")
llm = LLM(dtype="float32", enable_prefix_caching=False, max_model_len=8192)
manager, cfg = llm.blend_manager(), BlendConfig()
one = SamplingParams(temperature=0.0, max_tokens=1)
prompts = [_blended(ex, spec) for ex in examples]
for p in prompts:
    llm.generate([p], one, blend=cfg)
rows = []
for i, p in enumerate(prompts):
    n = len(manager.prepare(p, cfg).prompt.token_ids)
    ttft, logits = {"k_only": [], "both": []}, {}
    for _ in range(3):
        for mode in ("k_only", "both"):
            set_mode(mode)
            out = llm.generate([p], one, blend=cfg, logits_from=n - 1)[0]
            ttft[mode].append(out.metrics.ttft)
            logits[mode] = out.extra["prompt_logits"]
    set_mode("k_only")
    row = {"example": i, "tokens": n, "identical": torch.equal(logits["k_only"], logits["both"])}
    row.update({f"ttft_{m}": statistics.median(v) for m, v in ttft.items()})
    row["ratio"] = row["ttft_k_only"] / row["ttft_both"]
    rows.append(row)
    print(json.dumps(row), flush=True)
print(json.dumps({"median_ratio": statistics.median(r["ratio"] for r in rows)}))
