"""GPU benchmark: blendkv vs transformers on random-weight models of real shapes, one run.

For each shape (``--shapes llama8b,qwen05``; ``tiny`` for a CPU smoke run):

1. check: blendkv's greedy tokens against transformers' on the same weights (fp32 must match;
   bf16 may drift on near-ties and the match rate is reported);
2. prefill: time to first token of one ``--prefill-tokens`` prompt, blendkv vs transformers
   (SDPA), best of ``--repeats``, interleaved;
3. blend: a prompt of ``--docs`` documents with a warm chunk store, blend@``--ratio`` and full
   reuse vs full prefill of the same tokens (TTFT, median of ``--repeats``);
4. decode: tokens/s of 1 and ``--concurrency`` requests (128-token prompts,
   ``--decode-tokens`` new tokens each, EOS ignored), blendkv vs transformers ``generate`` with
   the same batch;
5. variants: the blend at each size in engines of their own, each with one setting changed
   (``--variants``: layers loaded first, the device tier, the prefill kernel's key splits and
   tiles, eager steps; :mod:`blendkv.eval.bench.gpu_variants`).

    blendkv bench gpu [--shapes llama8b,qwen05] [--dtype bfloat16] [--device auto] [--json F]

Weights are random (no download): quality numbers mean nothing here, only time and agreement.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blendkv import LLM, SamplingParams
from blendkv.config import resolve_device
from blendkv.errors import ConfigError
from blendkv.eval.bench.gpu_blend import add_variant, bench_blend_size, parse_prompts, print_size
from blendkv.eval.bench.gpu_variants import applies, make_variant, parse_variants, time_variant
from blendkv.eval.random_model import SHAPES, save_random_model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def _hf_ttft(model, ids: list[int], device: str) -> float:
    x = torch.tensor([ids], device=device)
    _sync(device)
    t0 = time.perf_counter()
    model(x, use_cache=True, logits_to_keep=1).logits.argmax(-1).item()
    return time.perf_counter() - t0


@torch.inference_mode()
def _hf_generate(model, prompts: list[list[int]], new_tokens: int, device: str):
    """(tokens/s of one batched generate over equal-length prompts, its greedy tokens)."""
    x = torch.tensor(prompts, device=device)
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    _sync(device)
    seconds = time.perf_counter() - t0
    return len(prompts) * new_tokens / seconds, out[:, x.shape[1] :].tolist()


def _copy_times(nbytes: int, device: str) -> dict:
    """Host-to-device copy of ``nbytes`` from pinned vs pageable memory (ms, median of 5)."""
    if not device.startswith("cuda") or not nbytes:
        return {}
    out = {}
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for name, pin in (("pinned", True), ("pageable", False)):
        src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)
        times = []
        for _ in range(5):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            _sync(device)
            times.append(time.perf_counter() - t0)
        out[f"h2d_{name}_ms"] = statistics.median(times) * 1e3
    return out


def _random_ids(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def _graphs_vs_eager(llm, eager, prompts, greedy) -> dict:
    """The same prompts on the eager engine (every dense piece run eagerly instead of replayed
    from piecewise graphs): greedy match, and the largest difference of their prompt logits."""

    def run(engine):
        outs = engine.generate(prompts, greedy, logits_from=0)
        return [o.outputs[0].token_ids for o in outs], [o.extra["prompt_logits"] for o in outs]

    (tokens, logits), (eager_tokens, eager_logits) = run(llm), run(eager)
    same = sum(a == b for a, b in zip(tokens, eager_tokens, strict=True)) / len(tokens)
    diff = max(float((a - b).abs().max()) for a, b in zip(logits, eager_logits, strict=True))
    top1 = [
        float((a.argmax(-1) == b.argmax(-1)).float().mean())
        for a, b in zip(logits, eager_logits, strict=True)
    ]
    return {
        "graphs_vs_eager_greedy_match": same,
        "graphs_vs_eager_max_logit_diff": diff,
        "graphs_vs_eager_prompt_top1": min(top1),
    }


def bench_shape(shape: str, args, device: str) -> dict:
    row: dict = {"shape": shape, "dtype": args.dtype, "device": device}
    with tempfile.TemporaryDirectory(prefix=f"blendkv-{shape}-") as tmp:
        t0 = time.perf_counter()
        hf = save_random_model(Path(tmp), shape, getattr(torch, args.dtype), device)
        sizes = parse_prompts(args.blend_prompts) if args.blend_prompts else []
        llm = _load(tmp, args, device, sizes)
        row["setup_s"] = round(time.perf_counter() - t0, 1)
        row["attention_backend"] = llm.engine.attn_backend.name
        vocab = hf.config.vocab_size
        _check_agreement(llm, hf, vocab, device, row)
        print(f"so far: {json.dumps(row)}", flush=True)  # kept if a later part fails
        _bench_prefill(llm, hf, vocab, args, device, row)
        print(f"so far: {json.dumps(row)}", flush=True)  # kept if a later part fails
        prompts = _bench_blend(llm, sizes, shape, args, device, row)
        _bench_decode(llm, hf, vocab, args, device, row)
        del hf
        _bench_variants(llm, tmp, prompts, vocab, args, device, row)
        llm.close()
        del llm
        _empty_cache(device)
    return row


def _empty_cache(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _bench_variants(llm, model_dir: str, prompts: list[dict], vocab: int, args, device: str, row):
    """5. each ``--variants`` setting in an engine of its own beside ``llm``, at every blended
    prompt size (:mod:`blendkv.eval.bench.gpu_variants`)."""
    names = parse_variants(args.variants)
    sizes = parse_prompts(args.blend_prompts) if args.blend_prompts else []
    for name in names:
        if not applies(name, llm, args.device_tier_gb):
            print(f"variant {name}: changes nothing on this engine, skipped")
            continue
        variant = make_variant(name, args.device_tier_gb)
        # (the default engine ran the start gate on the same weights)
        other = _load(model_dir, args, device, sizes, blend_start_gate=False, **variant.options)
        if name == "eager":
            greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            check = _random_ids(4, 61, vocab, seed=1)
            row.update(_graphs_vs_eager(llm, other, check, greedy))
        for size, prompt in zip(row["blend"], prompts, strict=True):
            add_variant(size, time_variant(variant, other, prompt, args.repeats))
        print(f"so far: {json.dumps(row)}", flush=True)  # kept if a later part fails
        other.close()
        del other
        _empty_cache(device)


def _load(model_dir: str, args, device: str, sizes: list[tuple[int, int]], **options) -> LLM:
    """blendkv on the saved random model, sized for the longest prompt of the run, with
    ``options`` (a variant's) over the bench's own."""
    # a blended prompt overshoots its size by up to 1/8, plus the chat template and query
    # (a fixed ~200 tokens with the tiny shape's tokenizer: it decides at small sizes)
    longest = max([args.prefill_tokens] + [t + t // 8 + 256 for t, _ in sizes])
    max_len = longest + 2 * args.decode_tokens + 128
    return LLM(
        model_dir,
        dtype=args.dtype,
        device=device,
        attention_backend=args.attention_backend,
        enable_prefix_caching=False,
        max_model_len=max_len,
        max_num_batched_tokens=max(longest + 256, 2048),
        max_num_seqs=max(args.concurrency, 1),
        kv_cache_memory_bytes=args.kv_cache_gb << 30,
        kv_store_memory_bytes=args.kv_store_gb << 30,
        blend_cost_check=True,  # its choice is measured beside blend and full prefill
        **options,
    )


def _check_agreement(llm, hf, vocab: int, device: str, row: dict) -> None:
    """1. blendkv's greedy tokens against transformers' (61 tokens: the piecewise graphs'
    prefill pieces run padded to 64)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    check = _random_ids(4, 61, vocab, seed=1)
    ours = [o.outputs[0].token_ids for o in llm.generate(check, greedy)]
    _, theirs = _hf_generate(hf, check, 8, device)
    row["greedy_match"] = sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


def _bench_prefill(llm, hf, vocab: int, args, device: str, row: dict) -> None:
    """2. TTFT of one ``--prefill-tokens`` prompt, best of ``--repeats``, interleaved."""
    one = SamplingParams(temperature=0.0, max_tokens=1)
    ids = _random_ids(1, args.prefill_tokens, vocab, seed=2)[0]
    llm.generate([ids], one)  # warm-up (allocator, kernels)
    _hf_ttft(hf, ids, device)
    ttft_ours, ttft_hf = [], []
    for _ in range(args.repeats):
        ttft_ours.append(llm.generate([ids], one)[0].metrics.ttft)
        ttft_hf.append(_hf_ttft(hf, ids, device))
    row["prefill_tokens"] = args.prefill_tokens
    row["prefill_s"] = min(ttft_ours)
    row["prefill_hf_s"] = min(ttft_hf)
    row["prefill_vs_hf"] = row["prefill_s"] / row["prefill_hf_s"]


def _bench_blend(llm, sizes, shape: str, args, device: str, row: dict) -> None:
    """3. blend with a warm store, at each prompt size (``--profile``: the first)."""
    row["blend"], prompts = [], []
    for i, (tokens, docs) in enumerate(sizes):
        size, runs, prompt = bench_blend_size(llm, tokens, docs, args, seed=100 + 1000 * i)
        row["blend"].append(size)
        prompts.append(prompt)
        print(f"so far: {json.dumps(row)}", flush=True)  # kept if a later part fails
        if args.profile and i == 0:
            from blendkv.eval.bench.profile_gpu import profile_requests

            path = Path(args.profile) / f"profile_{shape}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            title = f"{shape} {args.dtype} {device} {size['tokens']} tokens"
            row["profile"] = profile_requests(runs, str(path), title)
    if sizes:
        row.update(_copy_times(row["blend"][-1]["kv_bytes"], device))
    return prompts


def _bench_decode(llm, hf, vocab: int, args, device: str, row: dict) -> None:
    """4. decode tokens/s of 1 and ``--concurrency`` requests (``--decode-tokens 0``: none)."""
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for n in sorted({1, args.concurrency}) if args.decode_tokens > 0 else ():
        decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        prompts = _random_ids(n, 128, vocab, seed=3 + n)
        llm.generate(prompts[:1], one)
        t0 = time.perf_counter()
        llm.generate(prompts, decode)
        row[f"decode_tok_s_{n}"] = n * args.decode_tokens / (time.perf_counter() - t0)
        row[f"decode_hf_tok_s_{n}"], _ = _hf_generate(hf, prompts, args.decode_tokens, device)
        row[f"decode_vs_hf_{n}"] = row[f"decode_tok_s_{n}"] / row[f"decode_hf_tok_s_{n}"]


def _print(row: dict) -> None:
    print(
        f"\n{row['shape']} ({row['dtype']}, {row['device']}, {row['attention_backend']}): "
        f"greedy match {row['greedy_match']:.2f}"
        + (
            f"; piecewise graphs vs eager: greedy match "
            f"{row['graphs_vs_eager_greedy_match']:.2f}, prompt top-1 "
            f"{row['graphs_vs_eager_prompt_top1']:.3f}, max logit diff "
            f"{row['graphs_vs_eager_max_logit_diff']:.3g}"
            if "graphs_vs_eager_greedy_match" in row
            else ""
        )
        + "\n"
        f"  prefill {row['prefill_tokens']} tok: blendkv {row['prefill_s'] * 1e3:.1f} ms, "
        f"transformers {row['prefill_hf_s'] * 1e3:.1f} ms ({row['prefill_vs_hf']:.2f}x its time)"
    )
    for size in row["blend"]:
        print_size(size, row["ratio"])
    if row["blend"]:
        last = row["blend"][-1]
        print(
            f"  K/V loaded {last['kv_bytes'] / 1e6:.0f} MB, written in "
            f"{last['write_s'] * 1e3:.1f} ms ({last['write_hidden_s'] * 1e3:.1f} hidden); "
            "host-to-device copy pinned "
            f"{row.get('h2d_pinned_ms', float('nan')):.1f} ms, pageable "
            f"{row.get('h2d_pageable_ms', float('nan')):.1f} ms"
        )
    decode = sorted(int(k.rsplit("_", 1)[1]) for k in row if k.startswith("decode_tok_s_"))
    for n in decode:
        print(
            f"  decode tok/s, {n} concurrent: {row[f'decode_tok_s_{n}']:.1f} vs "
            f"{row[f'decode_hf_tok_s_{n}']:.1f} ({row[f'decode_vs_hf_{n}']:.2f}x)"
        )


def main(args) -> int:
    device = resolve_device(args.device)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ConfigError(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    parse_variants(args.variants)  # refused before any model is built
    if device == "cpu" and any(s != "tiny" for s in shapes):
        print("note: no GPU; real shapes on the CPU take very long (use --shapes tiny)")
    rows = []
    for shape in shapes:
        row = bench_shape(shape, args, device)
        row["ratio"] = args.ratio
        if device.startswith("cuda"):
            row["gpu"] = torch.cuda.get_device_name()
        rows.append(row)
        _print(row)
        print(json.dumps({"gpu_bench": row}))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0
