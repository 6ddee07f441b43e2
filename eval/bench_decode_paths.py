"""A/B of CPU decode step variants in one process, alternating step by step.

    python -m blendkv.eval.bench_decode_paths [--compare attention|gemm|onednn|compiled]
        [--threads 2] [--rounds 30] [--num-requests 32] [--dtype float32]

The requests of ``blendkv bench decode`` (prompts of 64-512 random tokens) are prefilled, then
decode steps alternate between two variants, on the same requests:

- ``--compare attention`` (default): ``in place`` (decode rows whose blocks lie in at most 4
  runs of consecutive ids attend slices of the pool) against ``gather`` (every decode row's
  blocks are gathered, the path before it; set by capping the runs at 0).
- ``--compare compiled``: ``compiled`` (every decode row of a step in one C++ kernel call per
  layer, ``EngineConfig.compile_decode``) against ``in place``.
- ``--compare onednn``: ``onednn`` (every GEMM on weights packed for oneDNN,
  ``EngineConfig.cpu_gemm="onednn"``) against ``mkl`` (MKL, weights packed for 32 rows).
- ``--compare gemm``: ``packed`` (weights packed for 32-row GEMMs, ``blendkv.layers.linear``)
  against ``F.linear`` (packing switched off on every linear map).

Alternating step by step makes machine noise hit both alike. Prints the median and best step
time of each and their ratio. Correctness is checked elsewhere: the attention paths against a
dense float64 oracle in ``tests/engine/test_torch_attention.py``, packed GEMMs against
``F.linear`` in ``tests/models/test_packed_gemm.py``, and the default path's greedy tokens
against transformers' by ``blendkv bench decode``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    import blendkv.kernels.paged_decode as paged_decode
    from blendkv import LLM, SamplingParams
    from blendkv.eval.bench_engine import make_prompts

    p = argparse.ArgumentParser(prog="python -m blendkv.eval.bench_decode_paths")
    p.add_argument(
        "--compare",
        choices=("attention", "gemm", "onednn", "compiled"),
        default="attention",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args(argv)
    gemm = "mkl" if args.compare == "gemm" else "auto"
    # The attention A/Bs switch the C++ decode kernel themselves; the GEMM ones keep the default.
    compiled = False if args.compare in ("attention", "compiled") else None
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        device="cpu",
        cpu_gemm=gemm,
        compile_decode=compiled,
    )
    engine = llm.engine
    default_runs = paged_decode.MAX_RUNS
    try:
        tok = engine.tokenizer
        prompts = make_prompts(args.num_requests, engine.info.vocab_size, set(tok.all_special_ids))
        # Requests prefilled first decode during the later prefills: a margin keeps every
        # request running to the last timed step.
        params = SamplingParams(temperature=0.0, max_tokens=2 * args.rounds + 64, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(prompt, params)
        sched = engine.scheduler
        while sched.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in sched.running
        ):
            engine.step()  # prefill every request
        runs = [_num_runs(s.block_table) for s in sched.running]
        if args.compare == "compiled":
            from blendkv.kernels.compiled_decode import CompiledDecode

            backend, compiled = engine.attn_backend, CompiledDecode()
            variants = {
                "compiled": lambda: setattr(backend, "compiled_decode", compiled),
                "in place": lambda: setattr(backend, "compiled_decode", None),
            }
        elif args.compare == "attention":
            variants = {
                "in place": lambda: setattr(paged_decode, "MAX_RUNS", default_runs),
                "gather": lambda: setattr(paged_decode, "MAX_RUNS", 0),
            }
        elif args.compare == "gemm":
            from blendkv.layers.linear import small_batch_gemms

            gemms, rows = small_batch_gemms(engine.model), engine.packed_gemm_rows
            # Flip the row count only: the packed copies stay, packed once, not per switch.
            variants = {
                "packed": lambda: [setattr(g, "rows", rows) for g in gemms],
                "F.linear": lambda: [setattr(g, "rows", 0) for g in gemms],
            }
            assert engine.packed_gemm_rows, "packed GEMMs are off here (use --cpu-gemm mkl)"
        else:  # onednn
            variants = _gemm_library_variants(engine)
        for switch in variants.values():  # warm-up (packs the weights), untimed
            switch()
            engine.step()
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, switch in variants.items():
                switch()
                t0 = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - t0)
    finally:
        paged_decode.MAX_RUNS = default_runs
        llm.close()
    print(
        f"{args.num_requests} decoding requests, {args.threads} threads, {args.rounds} rounds; "
        f"runs of consecutive blocks per table: max {max(runs)}, median {statistics.median(runs)}"
    )
    for name, ts in times.items():
        median, best = statistics.median(ts) * 1e3, min(ts) * 1e3
        print(f"{name:9s} step median {median:7.1f} ms  best {best:7.1f} ms")
        if os.environ.get("BENCH_STEPS"):
            print("   ", [round(t * 1e3) for t in ts])
    a, b = times
    ratio = statistics.median(times[a]) / statistics.median(times[b])
    print(f"{a} / {b} (medians): {ratio:.3f}x")
    return 0


def _gemm_library_variants(engine) -> dict:
    """``onednn`` (every GEMM on oneDNN-packed weights) and ``mkl`` (MKL, packed for 32-row
    batches): each linear map keeps both packed copies, made at the warm-up step."""
    from blendkv.layers.linear import small_batch_gemms

    gemms = small_batch_gemms(engine.model)
    states: dict[str, list] = {"onednn": [None] * len(gemms), "mkl": [None] * len(gemms)}
    current = [None]

    def switch(name: str) -> None:
        if current[0] is not None:  # keep what the last variant packed
            states[current[0]] = [g.packed for g in gemms]
        for g, packed in zip(gemms, states[name], strict=True):
            g.rows, g.onednn = (0, True) if name == "onednn" else (32, False)
            g.packed = packed
        current[0] = name

    return {"onednn": lambda: switch("onednn"), "mkl": lambda: switch("mkl")}


def _num_runs(table: list[int]) -> int:
    """Runs of consecutive block ids in a block table."""
    return 1 + sum(b != a + 1 for a, b in zip(table, table[1:], strict=False))


if __name__ == "__main__":
    raise SystemExit(main())
