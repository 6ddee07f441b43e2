"""Sliding windows and logit soft-capping in every attention backend, against a dense float64
oracle written here (not the torch backend's own code).

Windows of 4-6 tokens over blocks of 4 make every kind of row cross them: fresh prefill,
chunked prefill, decode, CacheBlend's scattered rows, ProphetKV's query rows (with their
mass) and the pool-less pass. A window off by one must fail (checked explicitly).
"""

from __future__ import annotations

import pytest
import torch

from blendkv.kernels.attention import QueryMassRequest, QueryScoring
from blendkv.kernels.torch_attention import TorchAttentionBackend, gather_kv

SCALE = 0.35
CASES = [(4, None), (6, 2.0), (None, 2.0), (1, None)]
CASE_IDS = ["w4", "w6-cap", "cap", "w1"]


def oracle_rows(q, keys, values, positions, scale, window, soft_cap):
    """q [n, Hq, D] at ``positions`` over keys/values [S, Hkv, D] at 0..S-1 -> (out [n, Hq, D]
    float64, probs [n, Hq, S] float64)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,shd->nhs", q.double(), k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    j = torch.arange(keys.shape[0], device=q.device)[None, :]
    p = positions[:, None]
    visible = j <= p
    if window is not None:
        visible &= j > p - window
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("nhs,shd->nhd", probs, v), probs


def oracle_step(step, pool, scale, window, soft_cap):
    """Every row of ``step`` over its sequence's keys (``pool`` already holds the step's K/V)."""
    md = step.md
    out = torch.empty(step.q.shape, dtype=torch.float64, device=step.q.device)
    starts = md.query_start_loc_cpu
    for i in range(md.num_seqs):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        keys, values = gather_kv(pool, md.block_table[i], md.seq_lens_cpu[i])
        pos = md.positions[lo:hi]
        out[lo:hi], _ = oracle_rows(step.q[lo:hi], keys, values, pos, scale, window, soft_cap)
    return out


def make_backend(name, device):
    if name == "torch":
        return TorchAttentionBackend(device)
    if name == "cpu":
        if device != "cpu":
            pytest.skip("the cpu backend runs on the CPU")
        from blendkv.kernels import cpu_extension
        from blendkv.kernels.cpu_attention import CpuAttentionBackend

        try:
            cpu_extension.load_ops()
        except cpu_extension.CPUKernelBuildError as exc:
            pytest.skip(f"no C++ kernels here: {exc}")
        return CpuAttentionBackend(device, prefill_kernel=True)
    pytest.importorskip("triton", reason="triton is not installed")
    from blendkv.kernels.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend(device)


def mixed_step(make_step, dtype=torch.float32, group=2):
    """fresh prefill (11) | chunked prefill from 6 | decode at 13 | a prefix hit whose rows
    4..16 are scattered (every other one kept, and the last)."""
    step = make_step(
        [0, 6, 13, 4], [11, 5, 1, 13], block_size=4, num_kv_heads=2, group=group, dtype=dtype
    )
    keep = torch.ones(step.md.num_tokens, dtype=torch.bool)
    keep[torch.arange(18, 29)[::2]] = False
    return step.subset(keep.to(step.q.device))


def assert_close(actual, expected, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)


BACKENDS = ["torch", "cpu", "triton"]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(("window", "soft_cap"), CASES, ids=CASE_IDS)
def test_mixed_step_matches_the_oracle(make_step, device, backend_name, window, soft_cap):
    step = mixed_step(make_step)
    assert step.md.is_contiguous_prefill == [True, True, True, False]
    backend = make_backend(backend_name, device)
    pool = step.pool.clone()
    out = backend.forward(
        step.q, step.k, step.v, pool, step.md, SCALE, window=window, soft_cap=soft_cap
    )
    expected = oracle_step(step, pool, SCALE, window, soft_cap)
    assert_close(out, expected, torch.float32)
    # a second layer reuses the step's layout: the same answer
    again = backend.forward(
        step.q, step.k, step.v, pool, step.md, SCALE, window=window, soft_cap=soft_cap
    )
    torch.testing.assert_close(again, out)
    if window is not None and window > 1:
        # the test can fail: a window one key wider or narrower is a different answer
        for off in (window - 1, window + 1):
            wrong = oracle_step(step, pool, SCALE, off, soft_cap)
            assert (out.double() - wrong).abs().max() > 1e-3


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_bf16_and_gqa(make_step, device, backend_name):
    step = mixed_step(make_step, dtype=torch.bfloat16, group=3)
    backend = make_backend(backend_name, device)
    pool = step.pool.clone()
    out = backend.forward(step.q, step.k, step.v, pool, step.md, SCALE, window=5, soft_cap=3.0)
    assert_close(out, oracle_step(step, pool, SCALE, 5, 3.0), torch.bfloat16)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(("window", "soft_cap"), CASES[:2], ids=CASE_IDS[:2])
def test_decode_steps_past_many_windows(make_step, device, backend_name, window, soft_cap):
    """Decode rows alone (the decode kernels): blocks wholly before a row's window are never
    read (poisoned with NaN, the answer stays the same)."""
    step = make_step([3, 20, 37, 9], [1, 1, 1, 1], block_size=4, num_kv_heads=1, group=4)
    backend = make_backend(backend_name, device)
    pool = step.pool.clone()
    out = backend.forward(
        step.q, step.k, step.v, pool, step.md, SCALE, window=window, soft_cap=soft_cap
    )
    assert_close(out, oracle_step(step, pool, SCALE, window, soft_cap), torch.float32)
    poisoned = pool.clone()
    for i, seq_len in enumerate(step.md.seq_lens_cpu):
        outside = step.md.block_table[i, : max(0, seq_len - window) // 4].long()
        poisoned[:, outside] = float("nan")
    assert torch.isnan(poisoned).any()
    again = backend.forward(
        step.q, step.k, step.v, poisoned, step.md, SCALE, window=window, soft_cap=soft_cap
    )
    torch.testing.assert_close(again, out)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(("window", "soft_cap"), CASES[:3], ids=CASE_IDS[:3])
def test_without_a_pool(device, backend_name, window, soft_cap):
    """The pool-less pass (chunk precompute): each sequence fresh at 0..n-1."""
    gen = torch.Generator().manual_seed(3)
    backend = make_backend(backend_name, device)
    md = backend.dense_metadata([9, 1, 6])
    q = torch.randn(16, 4, 8, generator=gen).to(device)
    k, v = (torch.randn(16, 2, 8, generator=gen).to(device) for _ in range(2))
    out = backend.forward(q, k, v, None, md, SCALE, window=window, soft_cap=soft_cap)
    starts = md.query_start_loc_cpu
    for lo, hi in zip(starts, starts[1:], strict=False):
        pos = torch.arange(hi - lo, device=device)
        expected, _ = oracle_rows(q[lo:hi], k[lo:hi], v[lo:hi], pos, SCALE, window, soft_cap)
        assert_close(out[lo:hi], expected, torch.float32)
    single = backend.forward(
        q[:9], k[:9], v[:9], None, None, SCALE, window=window, soft_cap=soft_cap
    )
    assert_close(
        single,
        oracle_rows(q[:9], k[:9], v[:9], torch.arange(9, device=device), SCALE, window, soft_cap)[
            0
        ],
        torch.float32,
    )


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize(("window", "soft_cap"), CASES[:2], ids=CASE_IDS[:2])
def test_query_rows_scored_in_attention(make_step, device, backend_name, window, soft_cap):
    """ProphetKV's query rows (the last rows of a sequence, scored in attention): their output
    and the mass they pay each key honour the window and the cap."""
    step = make_step([10], [6], block_size=4, num_kv_heads=2, group=2)
    backend = make_backend(backend_name, device)
    md = step.md
    scores = torch.zeros(16, dtype=torch.float32, device=device)
    scoring = QueryScoring({0: QueryMassRequest(first_row=3, scores=scores, visible_prefix=14)})
    pool = step.pool.clone()
    out = backend.forward(
        step.q, step.k, step.v, pool, md, SCALE, window=window, soft_cap=soft_cap, scoring=scoring
    )
    assert_close(out, oracle_step(step, pool, SCALE, window, soft_cap), torch.float32)
    keys, values = gather_kv(pool, md.block_table[0], 16)
    _, probs = oracle_rows(step.q[3:], keys, values, md.positions[3:], SCALE, window, soft_cap)
    torch.testing.assert_close(scores.double(), probs.sum((0, 1)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name", ["torch", "triton", "triton-lse"])
@pytest.mark.parametrize(("window", "soft_cap"), CASES[:3], ids=CASE_IDS[:3])
def test_add_query_mass(make_step, device, backend_name, window, soft_cap):
    """The query pass's separate scoring (backends without scores in attention); with
    ``-lse``, from the log-sum-exp the layer's attention left (``QueryScoring.lse_out``)."""
    step = make_step([0], [19], block_size=4, num_kv_heads=1, group=2)
    backend = make_backend(backend_name.removesuffix("-lse"), device)
    pool = step.pool.clone()
    backend.write_kv(pool, step.k, step.v, step.md.slot_mapping)
    scores = torch.zeros(19, dtype=torch.float32, device=device)
    q_pos = step.md.positions[12:]
    lse = None
    if backend_name.endswith("-lse"):
        assert backend.query_scoring == "from_lse"
        scoring = QueryScoring(lse_out=torch.full(step.q.shape[:2], float("nan"), device=device))
        out = backend.forward(
            step.q,
            step.k,
            step.v,
            pool,
            step.md,
            SCALE,
            window=window,
            soft_cap=soft_cap,
            kv_written=True,
            scoring=scoring,
        )
        assert_close(out, oracle_step(step, pool, SCALE, window, soft_cap), torch.float32)
        lse = scoring.lse_out[12:]
        assert not lse.isnan().any()
    backend.add_query_mass(
        scores,
        step.q[12:],
        q_pos,
        pool,
        step.md.slot_mapping,
        13,
        scale=SCALE,
        window=window,
        soft_cap=soft_cap,
        lse=lse,
    )
    keys, values = gather_kv(pool, step.md.block_table[0], 19)
    _, probs = oracle_rows(step.q[12:], keys, values, q_pos, SCALE, window, soft_cap)
    torch.testing.assert_close(scores.double(), probs.sum((0, 1)), atol=1e-5, rtol=1e-5)
    if backend_name != "torch":  # the kernels ran (a failing one falls back to torch)
        assert backend._kernel_ok["query_mass"]


def test_attention_layer_passes_its_constants(device):
    """A layer with neither window nor cap passes no keywords (the goldens' path); with them,
    every backend call carries them, and a custom scale reaches the query mass."""
    from types import SimpleNamespace

    from blendkv.layers.attention import Attention

    config = SimpleNamespace(
        num_attention_heads=4, num_key_value_heads=2, hidden_size=32, head_dim=8
    )
    backend = TorchAttentionBackend(device)
    plain = Attention(config, None, backend)
    assert plain.attention_kwargs() == {} and plain.mass_kwargs() == {}
    layer = Attention(config, None, backend, sliding_window=4, logits_soft_cap=2.0, scaling=0.3)
    assert layer.attention_kwargs() == {"window": 4, "soft_cap": 2.0}
    assert layer.mass_kwargs() == {"window": 4, "soft_cap": 2.0, "scale": 0.3}
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(9, 4, 8, generator=gen)
    k, v = (torch.randn(9, 2, 8, generator=gen) for _ in range(2))
    out = layer.o_proj(layer.attend_heads(q, k, v, None, None))
    attn, _ = oracle_rows(q, k, v, torch.arange(9), 0.3, 4, 2.0)
    expected = layer.o_proj(attn.float().reshape(9, 32))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for bad in ({"sliding_window": 0}, {"logits_soft_cap": 0.0}):
        with pytest.raises(ValueError):
            Attention(config, None, backend, **bad)
