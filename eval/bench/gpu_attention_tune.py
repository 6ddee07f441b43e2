"""``blendkv bench gpu-attention --tune``: pick the prefill kernel's tiles for this GPU.

For each head shape (``--heads``) and key count (``--keys``) it times the kernel alone on the
two kinds of rows a blend sends it, bf16, blocks of 16:

    query      30 rows at the end of the sequence (a reuse's or ProphetKV's query pass):
               few tiles over long keys, split as the backend splits them
    scattered  10 % of the positions, drawn at random (the blend's recomputed rows): many tiles,
               each over the keys up to its last row

Every config of the grid (``--configs``; default: block_m 64 or 128 by block_n 32, 64 or 128,
each with 4 warps in 3 stages and 8 in 2) is first checked against the
torch reference on every case (a config that cannot launch here is skipped, one whose output
differs is an error), then timed, median of ``triton.testing.do_bench``. The winner minimises
the sum of its times over the cases (the long cases decide; the short ones are launch-bound
and noisy);
``--tune-out FILE`` merges it into a table of :mod:`blendkv.kernels.triton.prefill_tiles`.
On the CPU (Triton's interpreter, tiny sizes) it checks the same and times nothing meaningful.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

BLOCK_SIZE = 16
QUERY_ROWS = 30
SCATTERED = 0.10
GRID_LAUNCH = ((4, 3), (8, 2))  # (num_warps, num_stages) with each tile shape


def _grid():
    from blendkv.kernels.triton.prefill_tiles import PrefillTiles

    return [
        PrefillTiles(m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w, s in GRID_LAUNCH
    ]


def parse_configs(text: str):
    """``"64:32:4:3,128:64:8:2"`` (block_m:block_n:num_warps:num_stages) -> PrefillTiles."""
    from blendkv.kernels.triton.prefill_tiles import PrefillTiles

    configs = []
    for part in text.split(","):
        values = [int(x) for x in part.strip().split(":")]
        if len(values) != 4:
            raise ValueError(f"--configs wants BLOCK_M:BLOCK_N:WARPS:STAGES, got {part!r}")
        configs.append(PrefillTiles(*values))
    return configs


def _case(heads: tuple[int, int, int], keys: int, kind: str, device: str, seed: int) -> dict:
    """One sequence of ``keys`` keys in a paged cache and the rows of ``kind`` over it."""
    from blendkv.kernels.torch_attention import TorchAttentionBackend

    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-keys // BLOCK_SIZE)
    # blocks in a shuffled order, as a pool that has served other requests holds them
    table = (torch.randperm(num_blocks, generator=g) + 1).tolist()
    md = TorchAttentionBackend(device).build_metadata([0], [keys], [table], BLOCK_SIZE)
    keep = torch.zeros(keys, dtype=torch.bool)
    if kind == "query":
        keep[-QUERY_ROWS:] = True
    else:
        picks = max(1, round(SCATTERED * keys)) - 1  # and the last position (the query's)
        keep[torch.randperm(keys - 1, generator=g)[:picks]] = True
        keep[-1] = True
    md = md.subset(keep)
    cache = torch.randn(2, num_blocks + 1, BLOCK_SIZE, num_kv_heads, head_dim, generator=g)
    q = torch.randn(md.num_tokens, num_heads, head_dim, generator=g)
    return {
        "kind": kind,
        "keys": keys,
        "rows": md.num_tokens,
        "md": md,
        "cache": cache.to(device, torch.bfloat16),
        "q": q.to(device, torch.bfloat16),
    }


def _runner(case: dict, tiles, target_programs: int):
    """A callable launching the kernel on ``case`` with ``tiles``, and its output tensor."""
    from blendkv.kernels.triton.prefill_attention import prefill_attention
    from blendkv.kernels.triton.prefill_tiles import block_q_for, build_tiles, prefill_num_splits

    md, q, cache = case["md"], case["q"], case["cache"]
    group = q.shape[1] // cache.shape[3]
    block_q = block_q_for(group, tiles.block_m)
    tile_seqs, tile_starts = build_tiles(md.query_start_loc_cpu, [0], block_q, q.device)
    splits = prefill_num_splits(tile_seqs.numel(), cache.shape[3], case["keys"], target_programs)
    out = torch.zeros_like(q)
    scale = q.shape[2] ** -0.5

    def run():
        prefill_attention(
            out,
            q,
            cache,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            md.positions,
            tile_seqs,
            tile_starts,
            block_q,
            scale,
            None,
            None,
            splits,
            tiles,
        )

    return run, out, splits


def _expected(case: dict) -> torch.Tensor:
    from blendkv.kernels.triton.prefill_attention import prefill_attention_reference

    md, q, cache = case["md"], case["q"], case["cache"]
    out = torch.zeros_like(q)
    prefill_attention_reference(
        out,
        q,
        cache,
        md.block_table,
        md.seq_lens_cpu,
        md.query_start_loc_cpu,
        md.positions,
        [0],
        q.shape[2] ** -0.5,
    )
    return out.float()


def _time_ms(run, device: str, repeats: int) -> float:
    if device.startswith("cuda"):
        import triton.testing

        rep = max(10, repeats)
        return float(triton.testing.do_bench(run, warmup=5, rep=rep, return_mode="median"))
    times = []
    for _ in range(max(1, repeats // 10)):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def tune_heads(heads, keys: list[int], configs, repeats: int, device: str) -> dict:
    """The grid's times on every case of one head shape, and the winner."""
    from blendkv.kernels.triton.prefill_tiles import DEFAULT_TILES

    programs = 264
    if device.startswith("cuda"):
        programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    cases = [
        _case(heads, n, kind, device, seed=i)
        for i, (n, kind) in enumerate((n, k) for n in keys for k in ("query", "scattered"))
    ]
    expected = [_expected(c) for c in cases]
    if DEFAULT_TILES not in configs:
        configs = [DEFAULT_TILES, *configs]
    times: dict = {}
    skipped: dict = {}
    for tiles in configs:
        row = []
        for case, want in zip(cases, expected, strict=True):
            run, out, _ = _runner(case, tiles, programs)
            try:
                run()
            except Exception as e:  # noqa: BLE001 - a config this GPU cannot launch (resources)
                skipped[tiles] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                break
            torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
            row.append(_time_ms(run, device, repeats))
        else:
            times[tiles] = row
            print(f"    {tiles}: {' '.join(f'{t:.3f}' for t in row)} ms", flush=True)
    base = times[DEFAULT_TILES]
    # total time over the cases, as a blend spends it: the long cases decide, and the short
    # ones (tens of microseconds, launch-bound and noisy) cannot outvote them
    score = {t: sum(row) / sum(base) for t, row in times.items()}
    best = min(score, key=score.get)
    return {
        "heads": list(heads),
        "cases": [
            {
                "kind": c["kind"],
                "keys": c["keys"],
                "rows": c["rows"],
                "splits": _runner(c, best, programs)[2],
                "default_ms": round(base[i], 4),
                "best_ms": round(times[best][i], 4),
            }
            for i, c in enumerate(cases)
        ],
        "best": best.as_dict(),
        "speedup": round(1 / score[best], 3),
        "ranking": [
            {**t.as_dict(), "relative_time": round(score[t], 3)}
            for t in sorted(score, key=score.get)
        ],
        "skipped": [{**t.as_dict(), "reason": why} for t, why in skipped.items()],
    }


def main(args, device: str) -> int:
    from blendkv.kernels.triton.prefill_tiles import PrefillTiles, table_key, write_table

    heads = [tuple(int(x) for x in h.split(":")) for h in args.heads.split(",")]
    keys = [int(n) for n in args.keys.split(",")]
    configs = parse_configs(args.configs) if args.configs else _grid()
    results = []
    for h in heads:
        t0 = time.perf_counter()
        result = tune_heads(h, keys, configs, args.repeats, device)
        results.append(result)
        best = PrefillTiles(**result["best"])
        key = table_key(h[0] // h[1], h[2], torch.bfloat16)
        print(
            f"heads {h[0]}/{h[1]}x{h[2]}: best {best} at {result['speedup']:.2f}x the defaults' "
            f"speed ({len(result['ranking'])} configs, {len(result['skipped'])} skipped, "
            f"{time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        for case in result["cases"]:
            print(
                f"  {case['kind']:9s} {case['rows']:5d} rows over {case['keys']:5d} keys: "
                f"{case['default_ms']:.3f} -> {case['best_ms']:.3f} ms",
                flush=True,
            )
        if args.tune_out:  # after each head shape: a run stopped later keeps what it found
            name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
            write_table(Path(args.tune_out), name, {key: best})
            print(f"wrote {key} to {args.tune_out}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
