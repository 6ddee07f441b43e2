"""The torch attention backend against a dense oracle (explicit softmax over allowed keys)."""

from __future__ import annotations

import pytest
import torch

from blendkv.kernels.attention import AttentionMetadata
from blendkv.kernels.torch_attention import TorchAttentionBackend, masked_attention


def dense_reference(q, k, v, q_positions, scale):
    """q [Lq, Hq, D] at q_positions over keys 0..Lk-1 (GQA by repetition), float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(k.shape[0])[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("num_rows", [5, 200, 700])
def test_masked_attention_grouped_rows(num_rows):
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


def test_paged_backend_mixed_step():
    """Scattered rows of one sequence, a chunked-prefill tail and decodes in one call."""
    gen = torch.Generator().manual_seed(0)
    bs, hq, hkv, d = 4, 6, 2, 16
    cache = torch.randn(2, 64, bs, hkv, d, generator=gen)
    lens = [150, 37, 9, 21]
    perm = torch.randperm(64, generator=gen).tolist()  # disjoint, shuffled block tables
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
    out = TorchAttentionBackend().forward(q, k_new, v_new, cache, md, 0.25)
    for i in range(4):
        ref = dense_reference(q[starts[i] : starts[i + 1]], *full[i], queries[i], 0.25)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), ref, atol=1e-5, rtol=0)
