"""The cost of batch-invariant mode: default vs ``deterministic=True``, side by side in one run.

Two engines on the same model and dtype, timed interleaved (best of ``--repeats``):
(a) decode: N concurrent greedy requests (short prompts, ``--output-tokens`` each, EOS ignored)
    through ``LLM.generate``, output tokens per second; (b) prefill: one ``--prefill-tokens``
    prompt, time to its first token. Reports deterministic / default as ratios, and whether the
    batch's answers equal each request's answer alone (they must in deterministic mode).

    blendkv bench deterministic [--model M] [--dtype bfloat16] [--num-requests 8]
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

from blendkv import LLM, SamplingParams


@dataclass
class DeterministicBenchResult:
    dtype: str
    num_requests: int
    output_tokens: int
    default_decode_tok_s: float
    deterministic_decode_tok_s: float
    decode_ratio: float  # deterministic / default tok/s (below 1: slower)
    prefill_tokens: int
    default_prefill_s: float
    deterministic_prefill_s: float
    prefill_ratio: float  # deterministic / default seconds (above 1: slower)
    default_batch_equals_alone: int  # requests whose batched answer equals their answer alone
    deterministic_batch_equals_alone: int


def _prompts(llm: LLM, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(llm.tokenizer)
    return [[rng.randrange(vocab) for _ in range(rng.randint(16, 128))] for _ in range(n)]


def _decode(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, sp)
    seconds = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return sum(len(t) for t in ids) / seconds, ids


def _prefill(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1))
    return time.perf_counter() - start


def run(args) -> DeterministicBenchResult:
    engines = {
        det: LLM(args.model, dtype=args.dtype, deterministic=det, enable_prefix_caching=False)
        for det in (False, True)
    }
    prompts = _prompts(engines[False], args.num_requests)
    long_prompt = _prompts(engines[False], 1, seed=1)[0] * (args.prefill_tokens // 16)
    long_prompt = long_prompt[: args.prefill_tokens]
    sp = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    equal = {}
    for det, llm in engines.items():  # warm-up and the correctness check
        _, batch = _decode(llm, prompts, sp)
        alone = [_decode(llm, [p], sp)[1][0] for p in prompts]
        equal[det] = sum(a == b for a, b in zip(batch, alone, strict=True))
    decode = {False: 0.0, True: 0.0}
    prefill = {False: float("inf"), True: float("inf")}
    for _ in range(args.repeats):  # interleaved: both see the same machine load
        for det, llm in engines.items():
            decode[det] = max(decode[det], _decode(llm, prompts, sp)[0])
            prefill[det] = min(prefill[det], _prefill(llm, long_prompt))
    return DeterministicBenchResult(
        dtype=args.dtype,
        num_requests=args.num_requests,
        output_tokens=args.output_tokens,
        default_decode_tok_s=decode[False],
        deterministic_decode_tok_s=decode[True],
        decode_ratio=decode[True] / decode[False],
        prefill_tokens=len(long_prompt),
        default_prefill_s=prefill[False],
        deterministic_prefill_s=prefill[True],
        prefill_ratio=prefill[True] / prefill[False],
        default_batch_equals_alone=equal[False],
        deterministic_batch_equals_alone=equal[True],
    )


def main(args) -> int:
    r = run(args)
    print(f"{'':24}{'default':>12}{'deterministic':>16}{'ratio':>8}")
    print(
        f"{'decode tok/s':24}{r.default_decode_tok_s:12.1f}{r.deterministic_decode_tok_s:16.1f}"
        f"{r.decode_ratio:8.2f}"
    )
    print(
        f"{'prefill s (' + str(r.prefill_tokens) + ' tok)':24}{r.default_prefill_s:12.3f}"
        f"{r.deterministic_prefill_s:16.3f}{r.prefill_ratio:8.2f}"
    )
    print(
        f"{'batch == alone':24}{r.default_batch_equals_alone:12d}"
        f"{r.deterministic_batch_equals_alone:16d}   of {r.num_requests}"
    )
    payload = {"deterministic_bench": asdict(r)}
    print(json.dumps(payload))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0
