"""The torch attention backend against a dense oracle (explicit softmax over allowed keys)."""

from __future__ import annotations

import pytest
import torch
from helpers import dense_attention_reference as dense_reference
from helpers import needs_cpp_compiler

from blendkv.kernels.attention import AttentionMetadata, QueryMassRequest, QueryScoring
from blendkv.kernels.attention_mass import attention_with_mass, query_attention_mass
from blendkv.kernels.cpu_attention import CpuAttentionBackend
from blendkv.kernels.cpu_decode import DenseDecode
from blendkv.kernels.split_attention import build_row_groups, split_masked_attention
from blendkv.kernels.torch_attention import TorchAttentionBackend, masked_attention


@pytest.mark.parametrize("num_rows", [5, 200, 700])
def test_masked_attention_rows(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    n_keys = 900
    q = torch.randn(num_rows, 6, 16, generator=gen)
    k = torch.randn(n_keys, 2, 16, generator=gen)
    v = torch.randn(n_keys, 2, 16, generator=gen)
    positions = torch.randperm(n_keys, generator=gen)[:num_rows].sort().values
    out = masked_attention(q, k, v, positions, 0.25)
    torch.testing.assert_close(
        out.double(), dense_reference(q, k, v, positions, 0.25), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    ("num_rows", "n_keys", "heads"),
    [
        (5, 900, (6, 2)),
        (200, 900, (6, 2)),
        (700, 900, (6, 2)),
        (90, 3000, (9, 3)),
        (64, 64, (2, 2)),
        (1, 500, (14, 2)),
        (300, 2000, (4, 1)),
    ],
)
def test_split_masked_attention(num_rows, n_keys, heads):
    """Prefix without a mask + masked band, merged by log-sum-exp, query heads folded per KV
    head: the same as the dense oracle, for groups with short and long prefixes."""
    gen = torch.Generator().manual_seed(num_rows + n_keys)
    hq, hkv = heads
    q = torch.randn(num_rows, hq, 16, generator=gen)
    k = torch.randn(n_keys, hkv, 16, generator=gen)
    v = torch.randn(n_keys, hkv, 16, generator=gen)
    positions = torch.randperm(n_keys, generator=gen)[:num_rows].sort().values
    out = split_masked_attention(q, k, v, positions, 0.25)
    torch.testing.assert_close(
        out.double(), dense_reference(q, k, v, positions, 0.25), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_probs", [None, 700])
def test_attention_with_mass(dtype, max_probs, monkeypatch):
    """Query rows' attention and their mass from one product: the output is the dense
    oracle's, the mass is query_attention_mass's (the same bits in one block of rows; several
    blocks when the probabilities are capped small)."""
    import blendkv.kernels.attention_mass as am

    if max_probs is not None:
        monkeypatch.setattr(am, "_MAX_PROBS", max_probs)
    gen = torch.Generator().manual_seed(3)
    n_keys, rows = 60, 9
    q = torch.randn(rows, 6, 16, generator=gen).to(dtype)
    k = torch.randn(n_keys, 2, 16, generator=gen).to(dtype)
    v = torch.randn(n_keys, 2, 16, generator=gen).to(dtype)
    positions = torch.tensor([40, 41, 45, 50, 51, 52, 55, 58, 59])
    out, mass = attention_with_mass(q, k, v, positions, visible_prefix=41)
    assert out.dtype == dtype and mass.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = dense_reference(q.float(), k.float(), v.float(), positions, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)
    want = query_attention_mass(q, k, positions, torch.arange(n_keys), 41)
    if max_probs is None:
        assert torch.equal(mass, want)
    else:
        torch.testing.assert_close(mass, want, atol=1e-5, rtol=1e-5)
    assert float(mass.sum()) == pytest.approx(6 * rows, rel=1e-5)


def _run_layout(layout, gen):
    """Ascending positions over 700 keys with runs of consecutive positions."""

    def scattered(lo, hi, count):
        return (torch.randperm(hi - lo, generator=gen)[:count] + lo).sort().values

    parts = {
        "query_tail": [scattered(0, 590, 150), torch.arange(600, 700)],
        "prefix_hit": [torch.arange(37, 700)],
        "from_zero": [torch.arange(0, 100), scattered(110, 700, 200)],
        "runs_and_gaps": [
            scattered(0, 190, 30),
            torch.arange(200, 300),
            scattered(310, 490, 20),
            torch.arange(500, 570),
            torch.arange(600, 610),
            scattered(650, 700, 5),
        ],
    }[layout]
    return torch.cat(parts)


@pytest.mark.parametrize("layout", ["query_tail", "prefix_hit", "from_zero", "runs_and_gaps"])
def test_split_attention_causal_runs(layout):
    """Runs of >= 64 consecutive positions become unmasked causal bands (after an unmasked
    prefix); short runs and scattered rows stay in masked groups. Same as the dense oracle."""
    gen = torch.Generator().manual_seed(len(layout))
    positions = _run_layout(layout, gen)
    q = torch.randn(len(positions), 6, 16, generator=gen)
    k = torch.randn(700, 2, 16, generator=gen)
    v = torch.randn(700, 2, 16, generator=gen)
    groups = build_row_groups(positions, 3, q.dtype)
    runs = [(positions[g.lo].item(), g.end) for g in groups if g.mask is None]
    want_runs = {
        "query_tail": [(600, 700)],
        "prefix_hit": [(37, 700)],
        "from_zero": [(0, 100)],
        "runs_and_gaps": [(200, 300), (500, 570)],
    }[layout]
    assert runs == want_runs
    assert all(positions[g.lo].item() == g.prefix for g in groups if g.mask is None)
    assert [(g.lo, g.hi) for g in groups] == sorted((g.lo, g.hi) for g in groups)
    assert groups[0].lo == 0 and groups[-1].hi == len(positions)
    assert all(a.hi == b.lo for a, b in zip(groups, groups[1:], strict=False))
    out = split_masked_attention(q, k, v, positions, 0.25, groups)
    torch.testing.assert_close(
        out.double(), dense_reference(q, k, v, positions, 0.25), atol=1e-5, rtol=0
    )


def test_split_masked_attention_bf16():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(300, 6, 32, generator=gen).bfloat16()
    k = torch.randn(1200, 2, 32, generator=gen).bfloat16()
    v = torch.randn(1200, 2, 32, generator=gen).bfloat16()
    positions = torch.randperm(1200, generator=gen)[:300].sort().values
    out = split_masked_attention(q, k, v, positions, 0.2)
    assert out.dtype == torch.bfloat16
    want = dense_reference(q.float(), k.float(), v.float(), positions, 0.2)
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=0)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_cpp_compiler)])
@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.parametrize("layout", ["shuffled", "runs"])
def test_paged_backend_mixed_step(layout, scored, compiled):
    """Scattered rows of one sequence, a chunked-prefill tail and decodes in one call; block
    tables shuffled (keys gathered) or in runs of consecutive blocks (slices of the pool).

    ``scored``: the last rows of the first two sequences are ProphetKV query rows; attention
    also adds the mass they pay each key (the same as :func:`query_attention_mass`) and their
    output is unchanged. ``compiled``: prefill rows through the C++ kernel."""
    gen = torch.Generator().manual_seed(0)
    bs, hq, hkv, d = 4, 6, 2, 16
    cache = torch.randn(2, 64, bs, hkv, d, generator=gen)
    lens = [150, 37, 9, 21]
    perm = torch.randperm(64, generator=gen).tolist()  # disjoint, shuffled block tables
    if layout == "runs":
        perm = list(range(64))
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used : used + -(-n // bs)])
        used += len(tables[-1])
    full = [
        (torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)) for n in lens
    ]
    for (kk, vv), table, n in zip(full, tables, lens, strict=True):  # context already cached
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        cache[0].view(-1, hkv, d)[slots] = kk
        cache[1].view(-1, hkv, d)[slots] = vv
    queries = [
        torch.randperm(150, generator=gen)[:90].sort().values,  # scattered rows
        torch.arange(30, 37),  # chunked-prefill tail
        torch.tensor([8]),  # decode
        torch.tensor([20]),  # decode
    ]
    q = torch.randn(sum(len(x) for x in queries), hq, d, generator=gen)
    k_new = torch.cat([full[i][0][queries[i]] for i in range(4)])
    v_new = torch.cat([full[i][1][queries[i]] for i in range(4)])
    starts = [0]
    for x in queries:
        starts.append(starts[-1] + len(x))
    width = max(len(t) for t in tables)
    md = AttentionMetadata(
        positions=torch.cat(queries),
        slot_mapping=torch.cat(
            [
                torch.tensor([tables[i][p // bs] * bs + p % bs for p in queries[i].tolist()])
                for i in range(4)
            ]
        ),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(lens),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        block_size=bs,
        max_query_len=90,
        max_seq_len=150,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
        is_contiguous_prefill=[False, True, True, True],
    )
    scored_rows = {0: 70, 1: 2}  # seq -> its first query row (an offset in its rows)
    scoring = None
    if scored:
        scoring = QueryScoring(
            {
                i: QueryMassRequest(starts[i] + r, torch.zeros(lens[i]), int(queries[i][r]) + 1)
                for i, r in scored_rows.items()
            }
        )
    backend = CpuAttentionBackend(prefill_kernel=True) if compiled else TorchAttentionBackend()
    d_scale = d**-0.5
    out = backend.forward(q, k_new, v_new, cache, md, d_scale, scoring=scoring)
    step = backend._step_layouts.get(md, cache.shape[1], None)
    sliced = [first is not None for first in step.other_slots]
    assert sliced == ([True, True] if layout == "runs" else [False, False])
    if layout == "runs" and not compiled:  # (compiled: decode rows through the C++ kernel)
        assert len(step.decode.in_place) == 2 and not step.decode.groups
    for i in range(4):
        ref = dense_reference(q[starts[i] : starts[i + 1]], *full[i], queries[i], d_scale)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), ref, atol=1e-5, rtol=0)
    for i, r in scored_rows.items() if scored else ():
        rows = slice(starts[i] + r, starts[i + 1])
        want = query_attention_mass(q[rows], full[i][0], queries[i][r:], torch.arange(lens[i]))
        torch.testing.assert_close(scoring.requests[i].scores, want, atol=1e-5, rtol=1e-5)
        assert float(want.sum()) == pytest.approx(hq * len(queries[i][r:]), rel=1e-5)


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=needs_cpp_compiler)], ids=["eager", "compiled"]
)
def test_paged_backend_many_decodes_with_a_prefill(compiled):
    """19 decode rows of mixed context lengths (three SDPA groups, rows out of length order)
    around a fresh prefill; the step layout is built by the first layer and reused by the next.
    ``compiled``: the decode rows go through the C++ kernel (one call per layer)."""
    gen = torch.Generator().manual_seed(3)
    bs, hq, hkv, d = 4, 6, 2, 16
    lens = [int(x) for x in torch.randint(1, 80, (19,), generator=gen)]
    lens.insert(7, 12)  # sequence 7: a fresh 12-token prefill
    perm = torch.randperm(600, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used : used + -(-n // bs)])
        used += len(tables[-1])
    cache = torch.randn(2, 600, bs, hkv, d, generator=gen)
    full = [
        (torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)) for n in lens
    ]
    for (kk, vv), table, n in zip(full, tables, lens, strict=True):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        cache[0].view(-1, hkv, d)[slots] = kk
        cache[1].view(-1, hkv, d)[slots] = vv
    queries = [torch.arange(n - 1, n) if i != 7 else torch.arange(n) for i, n in enumerate(lens)]
    starts = [0]
    for x in queries:
        starts.append(starts[-1] + len(x))
    q = torch.randn(starts[-1], hq, d, generator=gen)
    width = max(len(t) for t in tables)
    md = AttentionMetadata(
        positions=torch.cat(queries),
        slot_mapping=torch.cat(
            [
                torch.tensor([t[p // bs] * bs + p % bs for p in x.tolist()])
                for t, x in zip(tables, queries, strict=True)
            ]
        ),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(lens),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        block_size=bs,
        max_query_len=12,
        max_seq_len=max(lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
        is_contiguous_prefill=[True] * len(lens),
    )
    k_new = torch.cat([full[i][0][queries[i]] for i in range(len(lens))])
    v_new = torch.cat([full[i][1][queries[i]] for i in range(len(lens))])
    backend = CpuAttentionBackend() if compiled else TorchAttentionBackend()
    for _layer in range(2):
        out = backend.forward(q, k_new, v_new, cache, md, 0.25)
        layout = backend._step_layouts.get(md, cache.shape[1], None)
        assert isinstance(layout.decode, DenseDecode) == compiled
        for i in range(len(lens)):
            ref = dense_reference(q[starts[i] : starts[i + 1]], *full[i], queries[i], 0.25)
            got = out[starts[i] : starts[i + 1]].double()
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_in_runs_of_consecutive_blocks_attend_in_place(dtype):
    """Decode rows whose blocks form 1-4 runs of consecutive ids are attended as slices of the
    pool (runs merged by log-sum-exp); a row in 5 runs is gathered. Both equal the oracle,
    including a last run that ends mid-block and a block two rows share."""
    from blendkv.kernels.paged_decode import MAX_RUNS

    gen = torch.Generator().manual_seed(5)
    bs, hq, hkv, d = 4, 6, 2, 16
    tables = [
        [10, 11, 12, 13, 14],  # one run
        [20, 21, 22, 40, 41],  # two runs
        [50, 52, 54, 56],  # four runs of one block
        [60, 62, 64, 66, 68, 70],  # six runs: gathered
        [10, 11, 30],  # shares blocks 10 and 11 with the first row
    ]
    lens = [19, 20, 13, 23, 11]
    cache = torch.randn(2, 80, bs, hkv, d, generator=gen).to(dtype)
    full = []
    for table, n in zip(tables, lens, strict=True):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        full.append((cache[0].view(-1, hkv, d)[slots], cache[1].view(-1, hkv, d)[slots]))
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    width = max(len(t) for t in tables)
    md = AttentionMetadata(
        positions=torch.tensor([n - 1 for n in lens]),
        slot_mapping=torch.tensor(
            [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)]
        ),
        query_start_loc=torch.arange(len(lens) + 1),
        seq_lens=torch.tensor(lens),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        block_size=bs,
        max_query_len=1,
        max_seq_len=max(lens),
        query_start_loc_cpu=list(range(len(lens) + 1)),
        seq_lens_cpu=lens,
        is_contiguous_prefill=[True] * len(lens),
    )
    k_new = torch.stack([kk[-1] for kk, _ in full])
    v_new = torch.stack([vv[-1] for _, vv in full])
    backend = TorchAttentionBackend()
    out = backend.forward(q, k_new, v_new, cache, md, 0.25)
    layout = backend._step_layouts.get(md, cache.shape[1], None).decode
    assert MAX_RUNS == 4
    assert [row for row, _ in layout.in_place] == [0, 1, 2, 4]
    assert layout.in_place[0][1] == [(40, 19)]  # slots 40.. (block 10), 19 tokens
    assert layout.in_place[1][1] == [(80, 12), (160, 8)]
    assert layout.rows.tolist() == [3]
    assert out.dtype == dtype
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        ref = dense_reference(q[i : i + 1], *full[i], torch.tensor([n - 1]), 0.25)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_load_in_place_writes_the_reference_bits(dtype):
    """The CPU load_rotated_kv (rotation straight into the pool, run by run of consecutive
    slots) writes exactly the reference's bits (rotate, then write_kv), with slots in several
    runs: a whole block run, a run crossing into a non-adjacent block, a lone slot."""
    from blendkv.kernels.blend_kernels import BlendKernels, load_rotated_reference
    from blendkv.kernels.torch_attention import slot_runs

    gen = torch.Generator().manual_seed(7)
    layers, heads, head_dim = 3, 2, 8
    pool = torch.zeros(layers, 2, 6, 4, heads, head_dim, dtype=dtype)  # 6 blocks of 4 slots
    slots = torch.tensor([4, 5, 6, 7, 8, 9, 16, 17, 18, 2])
    assert slot_runs(slots) == [(0, 6, 4), (6, 9, 16), (9, 10, 2)]
    assert slot_runs(slots[:0]) == []
    kv = torch.randn(layers - 1, 2, len(slots), heads, head_dim, generator=gen).to(dtype)
    positions = torch.arange(20, 20 + len(slots))
    angles = torch.arange(64.0)[:, None] * torch.linspace(1.0, 0.01, head_dim // 2)[None, :]
    cos, sin = (f(torch.cat((angles, angles), dim=-1)) for f in (torch.cos, torch.sin))
    backend = TorchAttentionBackend("cpu")
    expected, actual = list(pool.clone()), list(pool.clone())
    load_rotated_reference(backend, expected, 1, kv, positions, slots, cos, sin)
    BlendKernels(backend).load_rotated_kv(actual, 1, kv, positions, slots, cos, sin)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)
    assert actual[0].abs().sum() == 0 and actual[2].abs().sum() > 0  # layers 1.. only


def test_dense_decode_attention_equals_the_oracle():
    """The C++ kernel's reference: rows padded to the longest context, keys read through slots
    (two rows share blocks), GQA 3:1; padding slots point at other rows' keys and must not
    count."""
    from blendkv.kernels.cpu_decode import dense_decode_attention

    gen = torch.Generator().manual_seed(7)
    hkv, g, d = 2, 3, 16
    pool_k, pool_v = torch.randn(2, 200, hkv, d, generator=gen)
    lens = [1, 37, 90, 12]
    slot_lists = [[5], list(range(100, 137)), list(range(10, 100)), list(range(100, 112))]
    slots = torch.zeros(4, 90, dtype=torch.long)
    for i, sl in enumerate(slot_lists):
        slots[i, : len(sl)] = torch.tensor(sl)
        slots[i, len(sl) :] = torch.randint(0, 200, (90 - len(sl),), generator=gen)
    q = torch.randn(4, hkv, g, d, generator=gen)
    out = dense_decode_attention(q, pool_k, pool_v, slots, torch.tensor(lens), 0.25)
    for i, sl in enumerate(slot_lists):
        idx = torch.tensor(sl)
        ref = dense_reference(
            q[i].reshape(1, hkv * g, d), pool_k[idx], pool_v[idx], torch.tensor([len(sl) - 1]), 0.25
        )
        torch.testing.assert_close(out[i].reshape(1, hkv * g, d).double(), ref, atol=1e-5, rtol=0)
