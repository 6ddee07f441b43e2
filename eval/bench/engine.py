"""Engine benchmark: blendkv vs transformers, side by side in one run (ratios, not absolutes).

(a) throughput: N concurrent greedy requests (prompt lengths uniform in [64, 512], 64 output
    tokens each, EOS ignored) through ``LLM.generate`` vs transformers ``generate`` one request
    at a time; (b) prefill: one 2048-token prompt, time to first token, both sides (best of
    ``--repeats``, interleaved).

Correctness first: the greedy tokens of both sides are compared before anything is timed and the
match rate is reported (fp32 must match; bf16 may drift on near-ties, which is reported).

    blendkv bench engine [--dtype float32 bfloat16] [--num-requests 32] [--json out.json]
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from blendkv import LLM, SamplingParams


@dataclass
class EngineBenchResult:
    dtype: str
    num_requests: int
    output_tokens: int
    match_requests: int
    blendkv_tok_s: float
    hf_tok_s: float
    throughput_ratio: float
    prefill_tokens: int
    blendkv_prefill_tok_s: float
    hf_prefill_tok_s: float
    prefill_ratio: float
    prefill_first_token_match: bool


def make_prompts(n: int, vocab: int, special: set[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    pool = [t for t in range(vocab) if t not in special]
    return [[rng.choice(pool) for _ in range(rng.randint(64, 512))] for _ in range(n)]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (EOS ignored): the reference."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def run_one(
    dtype: str,
    num_requests: int,
    output_tokens: int,
    prefill_tokens: int,
    model=None,
    repeats: int = 3,
):
    from transformers import AutoModelForCausalLM

    llm = LLM(model, dtype=dtype, max_num_seqs=max(64, num_requests), enable_prefix_caching=False)
    tok = llm.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(
        llm.engine.resolved.model_dir, dtype=llm.engine.torch_dtype
    )
    hf.generation_config.eos_token_id = None
    hf.eval()
    special = set(tok.all_special_ids)
    prompts = make_prompts(num_requests, llm.engine.info.vocab_size, special)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)

    # Correctness, then time: the engine's batched outputs against HF, request by request.
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    blendkv_s = time.perf_counter() - t0
    hf_s, matches = 0.0, 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs, strict=True):
            t0 = time.perf_counter()
            ref = hf_greedy(hf, prompt, output_tokens)
            hf_s += time.perf_counter() - t0
            matches += ref == out.outputs[0].token_ids
    total = num_requests * output_tokens

    rng = random.Random(1)
    pool = [t for t in range(llm.engine.info.vocab_size) if t not in special]
    long_prompt = [rng.choice(pool) for _ in range(prefill_tokens)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([long_prompt[:64]], one)  # warm-up
    hf_greedy(hf, long_prompt[:64], 1)
    ours_s = hf_prefill_s = float("inf")
    for _ in range(repeats):  # interleaved; best of N on each side
        t0 = time.perf_counter()
        ours = llm.generate([long_prompt], one)[0]
        ours_s = min(ours_s, time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = hf_greedy(hf, long_prompt, 1)
        hf_prefill_s = min(hf_prefill_s, time.perf_counter() - t0)
    return EngineBenchResult(
        dtype=dtype,
        num_requests=num_requests,
        output_tokens=output_tokens,
        match_requests=matches,
        blendkv_tok_s=total / blendkv_s,
        hf_tok_s=total / hf_s,
        throughput_ratio=hf_s / blendkv_s,
        prefill_tokens=prefill_tokens,
        blendkv_prefill_tok_s=prefill_tokens / ours_s,
        hf_prefill_tok_s=prefill_tokens / hf_prefill_s,
        prefill_ratio=hf_prefill_s / ours_s,
        prefill_first_token_match=ref == ours.outputs[0].token_ids,
    )


def print_table(results: list[EngineBenchResult]) -> None:
    print(
        f"{'dtype':9} {'reqs':>4} {'match':>6} {'blendkv tok/s':>14} {'hf tok/s':>9} "
        f"{'ratio':>6} | {'prefill':>7} {'blendkv tok/s':>14} {'hf tok/s':>9} {'ratio':>6}"
    )
    for r in results:
        print(
            f"{r.dtype:9} {r.num_requests:>4} {r.match_requests:>3}/{r.num_requests:<2} "
            f"{r.blendkv_tok_s:>14.1f} {r.hf_tok_s:>9.1f} {r.throughput_ratio:>5.2f}x | "
            f"{r.prefill_tokens:>7} {r.blendkv_prefill_tok_s:>14.1f} {r.hf_prefill_tok_s:>9.1f} "
            f"{r.prefill_ratio:>5.2f}x"
        )


def main(args) -> int:
    results = [
        run_one(
            d, args.num_requests, args.output_tokens, args.prefill_tokens, args.model, args.repeats
        )
        for d in args.dtype
    ]
    print_table(results)
    payload = {"engine_bench": [asdict(r) for r in results]}
    print(json.dumps(payload))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0
