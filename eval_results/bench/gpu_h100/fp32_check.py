"""fp32 greedy agreement with transformers at Llama-3.1-8B's widths and heads (4 layers, random
weights), on CUDA, both attention backends. GPU only; how the numbers in fp32_check.log were
made (``python3 fp32_check.py`` with blendkv installed)."""

import tempfile
from pathlib import Path

import torch

from blendkv import LLM, SamplingParams
from blendkv.eval import random_model as rm

arch, fields = rm.SHAPES["llama8b"]
rm.SHAPES["llama8b-4l"] = (arch, {**fields, "num_hidden_layers": 4})
tmp = tempfile.mkdtemp()
hf = rm.save_random_model(Path(tmp), "llama8b-4l", torch.float32, "cuda")
g = torch.Generator().manual_seed(1)
prompts = torch.randint(2, 128256, (4, 64), generator=g).tolist()
x = torch.tensor(prompts, device="cuda")
with torch.inference_mode():
    ref = hf.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[:, 64:].tolist()
    hf_logits = hf(x[:1]).logits[0, -1].float()
greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
one = SamplingParams(temperature=0.0, max_tokens=1)
for backend in ("triton", "torch"):
    llm = LLM(
        tmp,
        dtype="float32",
        device="cuda",
        attention_backend=backend,
        max_model_len=1024,
        kv_cache_memory_bytes=2 << 30,
    )
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    out = llm.generate([prompts[0]], one, logits_from=63)[0]
    logits = out.extra["prompt_logits"][0].float().cuda()
    match = sum(a == b for a, b in zip(ours, ref, strict=True)) / len(ref)
    diff = (logits - hf_logits).abs().max().item()
    print(
        f"fp32 llama8b-shape 4 layers, {backend}: greedy match {match:.2f}, "
        f"max |logit diff| {diff:.2e}, logit std {hf_logits.std().item():.2e}"
    )
    llm.close()
    del llm
    torch.cuda.empty_cache()
