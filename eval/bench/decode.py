"""Decode benchmark: blendkv's batched decode against transformers and llama.cpp, in one run.

N concurrent greedy requests (prompts of 64-512 random tokens, ``--output-tokens`` each, EOS
ignored) go through blendkv's engine at once. The same prompts go through transformers'
``generate`` one request at a time, and through llama.cpp (``llama-cpp-python``, one stream, on
the model's own GGUF: the quantised weights blendkv dequantises) when it is installed. Reported,
side by side:

- **end to end**: output tokens / wall time, prefills included (blendkv: all N together);
- **decode**: tokens per second once prefill is over. blendkv: the steps after the last prompt
  finished prefilling, all N requests decoding; one stream: its tokens after the first one.

Correctness first: every blendkv request's greedy tokens are compared with transformers' (fp32
must match). llama.cpp computes with quantised dot products, so only its agreement on the first
token is shown, as information.

    blendkv bench decode [--num-requests 32] [--output-tokens 64] [--llama-requests 4]
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from blendkv import LLM, SamplingParams
from blendkv.eval.bench.engine import hf_greedy, make_prompts


@dataclass
class DecodeBenchResult:
    dtype: str
    num_requests: int
    output_tokens: int
    threads: int
    match_requests: int
    blendkv_tok_s: float  # end to end, N at once
    blendkv_decode_tok_s: float  # aggregate, all N decoding
    hf_tok_s: float  # end to end, one at a time
    hf_decode_tok_s: float
    llama_cpp_tok_s: float | None  # end to end, one stream
    llama_cpp_decode_tok_s: float | None
    llama_cpp_first_token_agreement: float | None
    llama_cpp_note: str
    cpu_gemm: str = "mkl"  # the engine's GEMM library (blendkv.layers.cpu_platform)
    attention_backend: str = "cpu"  # the engine's attention backend ("cpu": the C++ kernels)


def blendkv_run(llm, prompts, output_tokens):
    """All prompts at once through the engine: (tokens per request, end-to-end seconds,
    decode seconds, tokens produced in the decode phase)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    decode_start = decode_tokens_before = None
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        if decode_start is None and not _any_prefilling(engine):
            decode_start = time.perf_counter()
            decode_tokens_before = sum(len(s.output_token_ids) for s in _running(engine))
            decode_tokens_before += sum(len(t) for t in tokens.values())
    end = time.perf_counter()
    produced = sum(len(t) for t in tokens.values())
    decode_s = end - decode_start if decode_start is not None else float("nan")
    return [tokens[i] for i in ids], end - t0, decode_s, produced - (decode_tokens_before or 0)


def _running(engine):
    return list(engine.scheduler.running)


def _any_prefilling(engine) -> bool:
    sched = engine.scheduler
    if sched.waiting:
        return True
    return any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running)


def hf_run(model, prompts, output_tokens):
    """One request at a time: (tokens, end-to-end seconds, decode seconds).

    Decode seconds per request = its full generate minus a one-token generate (its prefill)."""
    outs, total, decode = [], 0.0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        outs.append(hf_greedy(model, p, output_tokens))
        t1 = time.perf_counter()
        hf_greedy(model, p, 1)
        t2 = time.perf_counter()
        total += t1 - t0
        decode += max(1e-9, (t1 - t0) - (t2 - t1))
    return outs, total, decode


def llama_cpp_run(gguf_path: str, prompts, output_tokens: int, threads: int):
    """One stream per prompt through llama.cpp: (first tokens, end-to-end s, decode s, note)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, None, None, "llama-cpp-python is not installed (pip install llama-cpp-python)"
    llm = Llama(
        model_path=gguf_path,
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
    )
    firsts, total, decode = [], 0.0, 0.0
    for p in prompts:
        llm.reset()
        t0 = time.perf_counter()
        first_at = None
        got = []
        for tok in llm.generate(p, temp=0.0, top_k=1, reset=True):
            if first_at is None:
                first_at = time.perf_counter()
            got.append(tok)
            if len(got) == output_tokens:
                break
        end = time.perf_counter()
        firsts.append(got[0])
        total += end - t0
        decode += end - first_at
    return firsts, total, decode, ""


def run(args) -> DecodeBenchResult:
    from transformers import AutoModelForCausalLM

    n, out_tokens = args.num_requests, args.output_tokens
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=max(64, n),
        enable_prefix_caching=False,
        attention_backend=getattr(args, "attention_backend", "auto"),
        cpu_gemm=getattr(args, "cpu_gemm", "auto"),
    )
    threads = torch.get_num_threads()
    tok = llm.tokenizer
    prompts = make_prompts(n, llm.engine.info.vocab_size, set(tok.all_special_ids))
    hf = AutoModelForCausalLM.from_pretrained(
        llm.engine.resolved.model_dir, dtype=llm.engine.torch_dtype
    )
    hf.generation_config.eos_token_id = None
    hf.eval()
    blendkv_run(llm, prompts[:2], 4)  # warm-up (packs the weights, compiles decode)
    ours, ours_s, ours_decode_s, ours_decode_tokens = blendkv_run(llm, prompts, out_tokens)
    with torch.inference_mode():
        ref, hf_s, hf_decode_s = hf_run(hf, prompts, out_tokens)
    matches = sum(a == b for a, b in zip(ours, ref, strict=True))

    k = min(args.llama_requests, n)
    source = llm.engine.resolved.source
    if args.llama_requests <= 0:
        firsts, lc_s, lc_decode_s, note = None, None, None, "skipped (--llama-requests 0)"
    elif source.suffix != ".gguf":
        firsts, lc_s, lc_decode_s, note = None, None, None, f"{source} is not a GGUF file"
    else:
        firsts, lc_s, lc_decode_s, note = llama_cpp_run(
            str(source), prompts[:k], out_tokens, threads
        )
    return DecodeBenchResult(
        dtype=llm.engine.dtype,
        num_requests=n,
        output_tokens=out_tokens,
        threads=threads,
        match_requests=matches,
        blendkv_tok_s=n * out_tokens / ours_s,
        blendkv_decode_tok_s=ours_decode_tokens / ours_decode_s,
        hf_tok_s=n * out_tokens / hf_s,
        hf_decode_tok_s=n * (out_tokens - 1) / hf_decode_s,
        llama_cpp_tok_s=None if lc_s is None else k * out_tokens / lc_s,
        llama_cpp_decode_tok_s=None if lc_decode_s is None else k * (out_tokens - 1) / lc_decode_s,
        llama_cpp_first_token_agreement=None
        if firsts is None
        else statistics.fmean(a == b[0] for a, b in zip(firsts, ours, strict=False)),
        llama_cpp_note=note,
        cpu_gemm=llm.engine.cpu_tuning.gemm,
        attention_backend=llm.engine.attn_backend.name,
    )


def print_result(r: DecodeBenchResult) -> None:
    print(
        f"{r.num_requests} greedy requests x {r.output_tokens} tokens, {r.dtype}, "
        f"{r.threads} threads, GEMMs {r.cpu_gemm}"
        f", {'C++' if r.attention_backend == 'cpu' else 'flash'} decode attention; "
        f"blendkv matches transformers on {r.match_requests}/"
        f"{r.num_requests} requests"
    )
    print(f"{'':34} {'end to end tok/s':>17} {'decode tok/s':>13}")
    rows = [
        (f"blendkv ({r.num_requests} at once)", r.blendkv_tok_s, r.blendkv_decode_tok_s),
        ("transformers (one at a time)", r.hf_tok_s, r.hf_decode_tok_s),
    ]
    if r.llama_cpp_tok_s is not None:
        rows.append(("llama.cpp (one stream, GGUF)", r.llama_cpp_tok_s, r.llama_cpp_decode_tok_s))
    for name, e2e, dec in rows:
        print(f"{name:34} {e2e:>17.1f} {dec:>13.1f}")
    print(
        f"blendkv / transformers: {r.blendkv_tok_s / r.hf_tok_s:.2f}x end to end, "
        f"{r.blendkv_decode_tok_s / r.hf_decode_tok_s:.2f}x decode"
    )
    if r.llama_cpp_tok_s is not None:
        print(
            f"blendkv / llama.cpp: {r.blendkv_tok_s / r.llama_cpp_tok_s:.2f}x end to end, "
            f"{r.blendkv_decode_tok_s / r.llama_cpp_decode_tok_s:.2f}x decode "
            f"(llama.cpp's first token agrees on {r.llama_cpp_first_token_agreement:.0%})"
        )
    else:
        print(f"llama.cpp: {r.llama_cpp_note}")


def main(args) -> int:
    result = run(args)
    print_result(result)
    payload = {"decode_bench": asdict(result)}
    print(json.dumps(payload))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0
