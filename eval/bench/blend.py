"""Blend benchmark: TTFT of full prefill vs CacheBlend vs full reuse on MuSiQue dev prompts.

All methods run on the same examples, interleaved (full, blend, reuse for one example,
``--repeats`` times, the median TTFT kept; then the next), with the chunk store warmed first
and the prefix cache off, so each TTFT is one complete prefill of the whole prompt.
Correctness first: ``blend@1.0`` must reproduce full prefill's greedy tokens before anything
is timed (checked on the first example). Divergence
is the teacher-forced KL of each method's next-token distributions from full prefill's along
full prefill's greedy answer (first 16 tokens).

    blendkv bench blend [--model PATH] [--limit 5] [--repeats 3] [--dtype bfloat16] [--ratio 0.15]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from blendkv import LLM, SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.eval.datasets import load_cacheblend_json
from blendkv.eval.metrics import teacher_forced_fidelity
from blendkv.eval.prompts import get_prompt_spec, render_prompt

ANSWER_TOKENS = 16


def default_data(repo: Path | None = None) -> Path:
    """The MuSiQue dev set: in the checkout's ``shared/`` folder, else in the one beside it."""
    repo = repo or Path(__file__).resolve().parents[2]
    for shared in (repo / "shared", repo.parent / "shared"):
        if (shared / "data").is_dir():
            return shared / "data" / "musique_dev.json"
    return repo / "shared" / "data" / "musique_dev.json"


def _blended(example, spec) -> dict:
    r = render_prompt(example, spec)
    return {"documents": r.documents, "query": r.query, "system": r.system or None}


def _ttft_full(llm, ids, params) -> tuple[float, list[int]]:
    out = llm.generate([ids], params)[0]
    return out.metrics.ttft, out.outputs[0].token_ids


def _teacher_forced(llm, prompt, answer, blend, sp):
    if blend is None:
        out = llm.generate([prompt + answer], sp, logits_from=len(prompt) - 1)[0]
    else:
        tf = {**prompt, "continuation": answer}
        n = len(llm.blend_manager().prepare(tf, blend).prompt.token_ids)
        out = llm.generate([tf], sp, blend=blend, logits_from=n - len(answer) - 1)[0]
    return out.extra["prompt_logits"][: len(answer)]


def _blend_config(args):
    """The blended method: ``BlendConfig``'s defaults unless ``--ratio``/``--selection``."""
    fields = {}
    if getattr(args, "ratio", None) is not None:
        fields["recompute_ratio"] = args.ratio
    if getattr(args, "selection", None):
        fields["selection"] = args.selection
    return BlendConfig(**fields)


def musique_setup(args, **llm_kwargs):
    """(examples, prompt spec, LLM) of a MuSiQue blend benchmark: ``args.data`` (default: the
    dev set), ``args.limit`` examples, ``args.model`` in ``args.dtype``, no prefix caching,
    8K context; ``llm_kwargs`` for the store and loading."""
    data = Path(args.data) if args.data else default_data()
    examples = load_cacheblend_json(data, limit=args.limit)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_model_len=8192,
        **llm_kwargs,
    )
    return examples, get_prompt_spec("musique"), llm


def main(args) -> int:
    # "Warm store" = served from RAM: on the CPU as zero-copy views of LMDB's map (the page
    # cache), on CUDA from a memory tier large enough for every example's chunks (pinned).
    examples, spec, llm = musique_setup(
        args,
        kv_store_memory_bytes=4 << 30,
        pipeline_kv_load=getattr(args, "pipeline_kv_load", None),
        attention_backend=getattr(args, "attention_backend", "auto"),
        prune_last_layer=getattr(args, "prune_last_layer", True),
    )
    methods = {
        "blend": _blend_config(args),
        "reuse": BlendConfig(recompute_ratio=0.0),
    }
    prompts = [_blended(ex, spec) for ex in examples]
    agree = _warm_and_check(llm, prompts, methods["blend"])
    rows = []
    for p in prompts:
        row = _example_row(llm, p, methods, args, index=len(rows))
        rows.append(row)
        print(json.dumps(row))
    summary = _summary(llm, args, rows, methods["blend"], agree)
    _print_summary(summary)
    print(json.dumps({"blend_bench": summary}))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    llm.close()
    return 0


def _one() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=1)


def _answer_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)


def _warm_and_check(llm, prompts: list[dict], blend: BlendConfig) -> bool:
    """Warm the store (precompute every chunk) and check correctness before timing: whether
    blend@1.0's greedy answer is full prefill's on the first prompt."""
    manager, one, answer_params = llm.blend_manager(), _one(), _answer_params()
    for p in prompts:
        state = manager.prepare(p, blend)
        llm.precompute_chunks(state.prompt.chunks)
        llm.generate([p], one, blend=blend)  # first read: checksums, page cache
    first = prompts[0]
    ids0 = manager.prepare(first, blend).prompt.token_ids
    exact = llm.generate([first], answer_params, blend=BlendConfig(recompute_ratio=1.0))[0]
    full0 = llm.generate([ids0], answer_params)[0]
    agree = exact.outputs[0].token_ids == full0.outputs[0].token_ids
    print(f"check: blend@1.0 greedy == full prefill greedy on example 0: {agree}")
    return agree


def _example_row(llm, p: dict, methods: dict[str, BlendConfig], args, index: int) -> dict:
    """One example: each method's median TTFT and stats, its answer KL, and (``--profile``)
    where the blend's time goes."""
    one = _one()
    ids = llm.blend_manager().prepare(p, methods["blend"]).prompt.token_ids
    row = {"prompt_tokens": len(ids)}
    _time_methods(llm, p, ids, methods, max(1, getattr(args, "repeats", 1)), row)
    answer = llm.generate([ids], _answer_params())[0].outputs[0].token_ids
    ref = _teacher_forced(llm, ids, answer, None, one)
    for name, cfg in methods.items():
        test = _teacher_forced(llm, p, answer, cfg, one)
        row[f"kl_{name}"] = teacher_forced_fidelity(ref, test, ANSWER_TOKENS).mean_kl
    if getattr(args, "profile", False):
        _profile_row(llm, p, ids, methods["blend"], index, row)
    return row


def _time_methods(llm, p: dict, ids, methods: dict[str, BlendConfig], repeats: int, row: dict):
    """Full prefill and each method ``repeats`` times, interleaved: the median TTFTs, and the
    last run's load seconds, recompute fraction, hits and bytes into ``row``."""
    one = _one()
    ttfts: dict[str, list[float]] = {"full": [], **{name: [] for name in methods}}
    for _ in range(repeats):  # interleaved, medians kept
        ttfts["full"].append(_ttft_full(llm, ids, one)[0])
        for name, cfg in methods.items():
            out = llm.generate([p], one, blend=cfg)[0]
            s = out.blend_stats
            ttfts[name].append(out.metrics.ttft)
            row[f"load_s_{name}"] = s.load_seconds
            row[f"recompute_{name}"] = s.recompute_fraction
            row[f"hit_{name}"] = s.chunks_hit == s.num_chunks
            row[f"kv_bytes_{name}"] = s.kv_bytes_loaded
    for name, values in ttfts.items():
        row[f"ttft_{name}"] = statistics.median(values)


def _profile_row(llm, p: dict, ids, blend: BlendConfig, index: int, row: dict) -> None:
    from blendkv.eval.bench.profile_blend import (
        attention_share,
        print_profile,
        profile_request,
    )

    one = _one()
    share = attention_share(llm, ids, one)
    prof = profile_request(llm, p, blend, one, row["ttft_full"], share)
    print(f"profile, example {index} ({row['prompt_tokens']} tokens):")
    print_profile(prof)
    row["profile"] = prof
    row["floor_fraction"] = prof["floor_fraction"]
    row["key_floor_fraction"] = prof["key_floor_fraction"]


def _summary(llm, args, rows: list[dict], blend: BlendConfig, agree: bool) -> dict:
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    summary = {
        "model": llm.engine.info.model_name,
        "dtype": args.dtype,
        "examples": len(rows),
        "prompt_tokens_median": med("prompt_tokens"),
        "ttft_full_s": med("ttft_full"),
        "ttft_blend_s": med("ttft_blend"),
        "ttft_reuse_s": med("ttft_reuse"),
        "speedup_blend": med("ttft_full") / med("ttft_blend"),
        "speedup_reuse": med("ttft_full") / med("ttft_reuse"),
        "load_s_blend": med("load_s_blend"),
        "recompute_fraction_blend": mean("recompute_blend"),
        "answer_kl_blend": mean("kl_blend"),
        "answer_kl_reuse": mean("kl_reuse"),
        "ratio": blend.recompute_ratio,  # "target": the engine's pick for fidelity_target
        "fidelity_target": blend.fidelity_target,
        "selection": blend.selection,
        "blend1_matches_full": agree,
        "all_chunks_hit": all(r["hit_blend"] and r["hit_reuse"] for r in rows),
    }
    if rows and "floor_fraction" in rows[0]:
        summary["floor_fraction_blend"] = med("floor_fraction")
        summary["key_floor_fraction_blend"] = med("key_floor_fraction")
    return summary


def _print_summary(summary: dict) -> None:
    target = summary.get("fidelity_target")
    name = f"target@{target:g}" if target is not None else f"blend@{summary['ratio']}"
    print(
        f"\n{'method':10} {'TTFT median s':>14} {'speedup':>8} {'answer KL':>10}\n"
        f"{'full':10} {summary['ttft_full_s']:>14.3f} {1.0:>7.2f}x {0.0:>10.4f}\n"
        f"{name:10} {summary['ttft_blend_s']:>14.3f} "
        f"{summary['speedup_blend']:>7.2f}x {summary['answer_kl_blend']:>10.4f}\n"
        f"{'reuse':10} {summary['ttft_reuse_s']:>14.3f} {summary['speedup_reuse']:>7.2f}x "
        f"{summary['answer_kl_reuse']:>10.4f}\n"
        f"load seconds (blend, median): {summary['load_s_blend']:.3f}; "
        f"recompute fraction: {summary['recompute_fraction_blend']:.3f}"
    )
    if "floor_fraction_blend" in summary:
        print(
            f"blend TTFT reaches {100 * summary['floor_fraction_blend']:.0f}% of its compute floor"
        )
