"""The blend algorithm as a library, on plain tensors (no engine, no model, no store): row
scores and picks, the per-chunk mean shift of the kept rows and its write into a KV pool, and
ProphetKV's query pass plan. Each against a dense oracle written out here."""

from __future__ import annotations

import pytest
import torch
import transformers

from blendkv.blend.config import BlendConfig
from blendkv.blend.correction import Rows, chunk_mean_shift, correct_kept_rows
from blendkv.blend.prophet import needs_query_pass, plan_query_pass
from blendkv.blend.row_plan import SeqBlend
from blendkv.blend.selection import SelectionInputs, score_rows, top_rows
from blendkv.blend.stats import BlendStats
from blendkv.kernels.blend_kernels import BlendKernels
from blendkv.kernels.torch_attention import TorchAttentionBackend
from blendkv.layers.rotary import RotaryEmbedding

H, D = 2, 8


def _inputs(fresh_v, cached_v, fresh_k=None, cached_k=None) -> SelectionInputs:
    n = len(fresh_v)
    zeros = torch.zeros(n, H, D)
    return SelectionInputs(
        cand=torch.arange(n),
        fresh_k=zeros if fresh_k is None else fresh_k,
        fresh_v=fresh_v,
        cached_k=zeros if cached_k is None else cached_k,
        cached_v=cached_v,
    )


def test_deviation_scores_are_squared_distances_and_pick_the_largest():
    gen = torch.Generator().manual_seed(0)
    cached = torch.randn(6, H, D, generator=gen)
    moved = torch.tensor([0.0, 3.0, 0.5, 0.0, 2.0, 0.1])  # how far each row's V moved
    fresh = cached + moved[:, None, None]
    scores = score_rows("v_deviation", _inputs(fresh, cached), gen)
    torch.testing.assert_close(scores, moved**2 * H * D)
    assert top_rows(scores, 2).tolist() == [1, 4]  # ascending order
    k = score_rows("k_deviation", _inputs(cached, cached, fresh, cached), gen)
    torch.testing.assert_close(k, scores)


def test_forced_rows_count_against_the_budget():
    scores = torch.tensor([5.0, 1.0, 4.0, 0.0])
    forced = torch.tensor([False, True, False, False])
    assert top_rows(scores, 2, forced).tolist() == [0, 1]
    assert top_rows(scores, 0, forced).tolist() == [1]  # forced alone exceed the budget
    assert top_rows(scores, 9).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="unknown selection strategy"):
        score_rows("best", _inputs(torch.zeros(1, H, D), torch.zeros(1, H, D)), None)


@pytest.mark.parametrize("pooled", [False, True])
def test_chunk_mean_shift_is_the_shrunk_mean(pooled):
    gen = torch.Generator().manual_seed(1)
    delta = torch.randn(7, H, D, generator=gen)
    chunk_ids = torch.tensor([0, 0, 0, 2, 2, 1, 0])
    shrink = 4.0
    got = chunk_mean_shift(delta, chunk_ids, 4, shrink, pooled)
    prior = delta.sum(0) / (len(delta) + shrink) if pooled else torch.zeros(H, D)
    for c in range(4):
        mine = delta[chunk_ids == c]
        want = (mine.sum(0) + shrink * prior) / (len(mine) + shrink)
        torch.testing.assert_close(got[c], want)  # chunk 3: no rows, the prior's share only


def test_kept_rows_move_by_their_chunks_shift_in_the_pool():
    """V of the kept rows moves by the mean (shrink 0) of their chunk's recomputed rows' change;
    K the same before RoPE, rotated to each kept row's position; other slots are untouched."""
    gen = torch.Generator().manual_seed(2)
    backend = TorchAttentionBackend("cpu")
    config = transformers.LlamaConfig(
        hidden_size=H * D, num_attention_heads=H, max_position_embeddings=64, rope_theta=1e4
    )
    rope = RotaryEmbedding(config)
    pool = torch.randn(2, 4, 4, H, D, generator=gen)  # [K/V, blocks, block size, H, D]
    before = pool.clone()
    rec_slots, kept_slots = torch.tensor([1, 2, 9]), torch.tensor([3, 10, 11])
    rec_pos, kept_pos = torch.tensor([1, 2, 9]), torch.tensor([3, 10, 11])
    rec_chunks, kept_chunks = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 1])
    k, v = torch.randn(3, H, D, generator=gen), torch.randn(3, H, D, generator=gen)
    recomputed = Rows(rec_pos, rec_slots, rec_chunks, rows=torch.arange(3))
    kept = Rows(kept_pos, kept_slots, kept_chunks)
    kernels = BlendKernels(backend)
    correct_kept_rows(kernels, rope, pool, "kv", 0.0, False, recomputed, k, v, kept, 2)

    flat = before.view(2, 16, H, D)
    old_k = rope.unrotate_k(rec_pos, flat[0, rec_slots])
    dv = v - flat[1, rec_slots]
    dk = k - old_k
    shift_v = torch.stack([dv[rec_chunks == c].mean(0) for c in range(2)])
    shift_k = torch.stack([dk[rec_chunks == c].mean(0) for c in range(2)])
    after = pool.view(2, 16, H, D)
    torch.testing.assert_close(after[1, kept_slots], flat[1, kept_slots] + shift_v[kept_chunks])
    rotated = rope.rotate_k(kept_pos, shift_k[kept_chunks])
    want = flat[0, kept_slots] + rotated
    torch.testing.assert_close(after[0, kept_slots], want, atol=1e-5, rtol=1e-5)
    others = torch.ones(16, dtype=torch.bool)
    others[kept_slots] = False
    assert torch.equal(after[:, others], flat[:, others])


def _seq(reused: list[bool], query_start: int, config: BlendConfig) -> SeqBlend:
    mask = torch.tensor(reused)
    return SeqBlend(0, mask, config, query_start, int(mask.sum()), torch.Generator(), BlendStats())


def test_query_pass_runs_the_rows_without_reused_kv():
    """ProphetKV's first stage: template and query rows only, over the pool; its work is
    counted on the sequence (rows x layers, and each row's keys x layers)."""
    backend = TorchAttentionBackend("cpu")
    reused = [False, True, True, True, True, False, False]  # template, chunk, query
    md = backend.build_metadata([0], [len(reused)], [[0, 1]], 4)
    ids = torch.arange(100, 100 + len(reused))
    prophet = BlendConfig(recompute_ratio=0.5)  # the default selection: prophet
    sb = _seq(reused, 5, prophet)
    assert needs_query_pass(sb)
    query_pass = plan_query_pass(ids, md, [sb], backend, num_layers=3)
    assert query_pass.input_ids.tolist() == [100, 105, 106]
    assert query_pass.attn_metadata.host_positions().tolist() == [0, 5, 6]
    assert query_pass.replay is not None and query_pass.replay.first_query_row == 1
    assert sb.extra_row_layers == 3 * 3 and sb.extra_key_row_layers == (1 + 6 + 7) * 3
    for config in (BlendConfig(recompute_ratio=0.0), BlendConfig(selection="v_deviation")):
        assert not needs_query_pass(_seq(reused, 5, config))
        assert plan_query_pass(ids, md, [_seq(reused, 5, config)], backend, 3) is None
