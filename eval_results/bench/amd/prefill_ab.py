"""One-off A/B (2026-11-25): full-prefill TTFT of a 4,096-token prompt, run once per code copy
(PYTHONPATH), alternating. Usage: python prefill_ab.py float32|bfloat16"""

import json
import statistics
import sys

import torch

from blendkv import LLM, SamplingParams

dtype = sys.argv[1]
llm = LLM(dtype=dtype, enable_prefix_caching=False, max_model_len=8192, kv_connector=None)
g = torch.Generator().manual_seed(0)
ids = torch.randint(100, 40000, (4096,), generator=g).tolist()
one = SamplingParams(temperature=0.0, max_tokens=1)
llm.generate([ids[:256]], one)
t = []
for _ in range(3):
    t.append(llm.generate([ids], one)[0].metrics.ttft)
print(json.dumps({"dtype": dtype, "ttft": statistics.median(t), "all": t}))
