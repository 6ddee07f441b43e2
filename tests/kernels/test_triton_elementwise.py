"""The one-launch norm / RoPE / SiLU-and-mul kernels against the layers' torch code (CPU:
Triton's interpreter; on a GPU, compiled), and a model switched to them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from blendkv.kernels.triton import elementwise as ops  # noqa: E402
from blendkv.layers.norm import RMSNorm  # noqa: E402
from blendkv.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _close(actual, expected):
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=2e-6, rtol=2e-6)
    else:  # one bf16 ulp where float32 reduction order moves a value across a rounding edge
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=8e-3)


@DTYPES
@pytest.mark.parametrize("hidden", [64, 40], ids=["pow2", "masked"])
def test_rms_norm_with_and_without_residual(device, dtype, hidden):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(hidden, eps=1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
    x = (torch.randn(5, hidden, generator=g) * 3).to(device=device, dtype=dtype)
    r = torch.randn(5, hidden, generator=g).to(device=device, dtype=dtype)
    _close(ops.rms_norm(x.clone(), norm.weight, 1e-5), norm(x))
    ref_out, ref_res = norm(x, r)
    xs, rs = x.clone(), r.clone()
    out, res = ops.rms_norm(xs, norm.weight, 1e-5, rs)
    assert out is xs and res is rs  # in place, like vLLM's fused_add_rms_norm
    assert torch.equal(res, ref_res)  # the add rounds exactly like torch's
    _close(out, ref_out)


def _rope_and_fused_qkv(rows: int, seed: int, device, dtype):
    """A RoPE table (head_dim 16) and q, k, v [rows, heads, 16]: strided views of one fused
    projection output (4 query heads, 2 KV heads)."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
    rope = RotaryEmbedding(config)
    heads, kv_heads, dim = 4, 2, rope.head_dim
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    q, k, v = qkv.to(device=device, dtype=dtype).split(
        [heads * dim, kv_heads * dim, kv_heads * dim], dim=1
    )
    return rope, q.view(rows, heads, dim), k.view(rows, kv_heads, dim), v.view(rows, kv_heads, dim)


@DTYPES
def test_rotary_qk_on_views_of_a_fused_projection(device, dtype):
    rope, q, k, _ = _rope_and_fused_qkv(6, 1, device, dtype)
    positions = torch.tensor([0, 7, 3, 100, 5, 2], device=device)
    ref_q, ref_k = rope.apply_rotary(positions, q, k)
    cos, sin = rope.tables(device)
    out_q, out_k = ops.rotary_qk(positions, q, k, cos, sin)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    _close(out_q, ref_q)
    _close(out_k, ref_k)


@DTYPES
def test_rotary_qk_writes_the_rotated_kv_like_write_kv(device, dtype):
    """With a pool, the same launch writes the rotated K and V where write_kv would, in the
    pool's dtype, and skips padding rows (slot -1)."""
    from blendkv.kernels.triton.kv_write import write_kv_reference

    rope, q, k, v = _rope_and_fused_qkv(5, 5, device, dtype)
    positions = torch.tensor([9, 0, 4, 200, 3], device=device)
    slots = torch.tensor([6, 1, -1, 11, 2], device=device)
    cos, sin = rope.tables(device)
    want_q, want_k = ops.rotary_qk(positions, q, k, cos, sin)
    expected = torch.full((2, 3, 4, *k.shape[1:]), 7.0, device=device)  # fp32 pool, bf16 rows
    write_kv_reference(expected, want_k, v, slots)
    pool = torch.full_like(expected, 7.0)
    out_q, out_k = ops.rotary_qk(positions, q, k, cos, sin, pool, v, slots)
    assert torch.equal(out_q, want_q) and torch.equal(out_k, want_k)
    assert torch.equal(pool, expected)


@DTYPES
def test_silu_and_mul(device, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 2 * 48, generator=g) * 4).to(device=device, dtype=dtype)
    gate, up = x.split(48, dim=-1)
    _close(ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("rows_per_program", [1, 16])
def test_rows_spread_over_programs(device, monkeypatch, rows_per_program):
    """37 rows: a GPU's one row a program and the interpreter's 16 (the last program part
    empty) give the references' values, padding rows of the pool write skipped."""
    from blendkv.kernels.triton.kv_write import write_kv_reference

    monkeypatch.setattr(ops, "ROWS_PER_PROGRAM", rows_per_program)
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(40, eps=1e-5).to(device)
    x = torch.randn(37, 40, generator=g).to(device)
    _close(ops.rms_norm(x.clone(), norm.weight, 1e-5), norm(x))
    gate_up = torch.randn(37, 2 * 48, generator=g).to(device)
    gate, up = gate_up.split(48, dim=-1)
    _close(ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)
    rope, q, k, v = _rope_and_fused_qkv(37, 4, device, torch.float32)
    positions = torch.randint(0, 256, (37,), generator=g).to(device)
    slots = torch.randperm(48, generator=g)[:37].to(device)
    slots[::5] = -1
    cos, sin = rope.tables(device)
    ref_q, ref_k = rope.apply_rotary(positions, q, k)
    expected = torch.zeros((2, 12, 4, *k.shape[1:]), device=device)
    write_kv_reference(expected, ref_k, v, slots)
    pool = torch.zeros_like(expected)
    out_q, out_k = ops.rotary_qk(positions, q, k, cos, sin, pool, v, slots)
    _close(out_q, ref_q)
    _close(out_k, ref_k)
    _close(pool, expected)


def test_model_switched_to_the_kernels_gives_the_same_logits(tiny_llama_dir, device):
    """A tiny Llama through the loader with the Triton backend uses the kernels everywhere and
    gives the torch backend's prompt logits (fp32)."""
    from blendkv.kernels.torch_attention import TorchAttentionBackend
    from blendkv.kernels.triton_attention import TritonAttentionBackend
    from blendkv.models.model_files import load_model, resolve_model

    resolved = resolve_model(str(tiny_llama_dir))
    ref = load_model(resolved, torch.float32, TorchAttentionBackend(device), device)
    ours = load_model(resolved, torch.float32, TritonAttentionBackend(device), device)
    assert ours.model.norm.kernel is ops.rms_norm and ours.model.rotary_emb.kernel is not None
    assert ours.model.layers[0].mlp.act_and_mul is ops.silu_and_mul
    assert ref.model.norm.kernel is None
    ids = torch.tensor([1, 5, 9, 13, 17, 21, 25, 29], device=device)
    positions = torch.arange(len(ids), device=device)
    with torch.no_grad():
        expected = ref.compute_logits(ref(ids, positions))
        actual = ours.compute_logits(ours(ids, positions))
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


# ---- ProphetKV's query attention mass -----------------------------------------------------
@DTYPES
@pytest.mark.parametrize("group,head_dim", [(3, 16), (1, 24)], ids=["gqa3", "mha-d24"])
def test_query_mass_matches_the_gathered_torch_scores(device, dtype, group, head_dim):
    from blendkv.kernels.triton.query_mass import add_query_mass, query_mass_reference

    g = torch.Generator().manual_seed(3)
    kv_heads, block_size, num_keys, num_q = 2, 4, 70, 5
    num_blocks = num_keys // block_size + 3
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    pool = pool.to(device=device, dtype=dtype)
    blocks = torch.randperm(num_blocks, generator=g)[: -(-num_keys // block_size)]
    keys = torch.arange(num_keys)
    slots = (blocks[keys // block_size] * block_size + keys % block_size).to(device)
    q = torch.randn(num_q, kv_heads * group, head_dim, generator=g).to(device=device, dtype=dtype)
    q_positions = torch.tensor([40, 41, 55, 66, 69], device=device)  # rows see 41..70 keys
    start = torch.rand(num_keys, generator=g).to(device)  # added to, as over the layers
    expected, actual = start.clone(), start.clone()
    query_mass_reference(expected, q, q_positions, pool, slots)
    add_query_mass(actual, q, q_positions, pool, slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 products in the kernel's dot
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)
    # each row's softmax sums to one: the mass added is the number of (row, head) pairs
    assert abs(float((actual - start).sum()) - num_q * kv_heads * group) < 1e-3 * num_q * 8


def test_query_mass_splits_long_keys(device):
    """Few query rows over 1,100 keys: the log-sum-exp pass cuts the keys in 4 parts (rows at
    100 and 300 see none of the later ones), the mass pass combines them: the reference's
    scores, and the unsplit kernel's."""
    from blendkv.kernels.triton.prefill_tiles import prefill_num_splits
    from blendkv.kernels.triton.query_mass import add_query_mass, query_mass_reference

    g = torch.Generator().manual_seed(5)
    kv_heads, group, head_dim, block_size, num_keys = 2, 2, 16, 16, 1100
    assert prefill_num_splits(1, kv_heads, num_keys, 264) == 4
    num_blocks = num_keys // block_size + 2
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(device)
    blocks = torch.randperm(num_blocks, generator=g)[: -(-num_keys // block_size)]
    keys = torch.arange(num_keys)
    slots = (blocks[keys // block_size] * block_size + keys % block_size).to(device)
    q = torch.randn(3, kv_heads * group, head_dim, generator=g).to(device)
    q_positions = torch.tensor([100, 300, 1099], device=device)
    expected = torch.zeros(num_keys, device=device)
    query_mass_reference(expected, q, q_positions, pool, slots)
    split, whole = torch.zeros_like(expected), torch.zeros_like(expected)
    add_query_mass(split, q, q_positions, pool, slots, target_programs=264)
    add_query_mass(whole, q, q_positions, pool, slots, target_programs=1)
    torch.testing.assert_close(split, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-5)


# ---- the K/V correction ---------------------------------------------------------------------
@DTYPES
@pytest.mark.parametrize("which", ["k", "v", "kv"])
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("pooled", [False, True])
def test_chunk_shift_kernel_matches_the_torch_correction(device, dtype, which, parts, pooled):
    """The kernels give the pool the torch correction gives it, however many programs share a
    chunk's kept rows (chunk 1 has no recomputed row: its kept rows stay as they are unless the
    prior is the pooled mean)."""
    from transformers import LlamaConfig

    from blendkv.blend.correction import Rows, correct_kept_rows
    from blendkv.kernels.blend_kernels import BlendKernels
    from blendkv.kernels.torch_attention import TorchAttentionBackend
    from blendkv.kernels.triton_attention import TritonAttentionBackend
    from blendkv.kernels.triton_blend import TritonBlendKernels

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, max_position_embeddings=128)
    rope = RotaryEmbedding(config)
    g = torch.Generator().manual_seed(4)
    kv_heads, dim, block_size, num_blocks = 2, rope.head_dim, 4, 12
    pool = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g)
    pool = pool.to(device=device, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:20].to(device)
    positions = torch.arange(20, device=device) * 3 + 5
    chunk_of = torch.tensor([0] * 7 + [1] * 6 + [2] * 7, device=device)
    rec = torch.tensor([1, 4, 5, 15, 18], device=device)  # chunks 0, 0, 0, 2, 2
    kept = torch.tensor([0, 2, 3, 6, 8, 9, 13, 14, 16, 19], device=device)
    k = torch.randn(9, kv_heads, dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(9, kv_heads, dim, generator=g).to(device=device, dtype=dtype)
    rows = torch.tensor([0, 2, 3, 6, 8], device=device)  # the recomputed rows among the layer's 9

    def rows_of(idx, current=None, segments=None, parts=1):
        return Rows(positions[idx], slots[idx], chunk_of[idx], current, segments, parts)

    expected, actual = pool.clone(), pool.clone()
    args = (which, 8.0, pooled)
    correct_kept_rows(
        BlendKernels(TorchAttentionBackend(device)),
        rope,
        expected,
        *args,
        rows_of(rec, rows),
        k,
        v,
        rows_of(kept),
        3,
    )
    segments = torch.tensor([0, 3, 3, 5], dtype=torch.int32, device=device)
    kept_segments = torch.tensor([0, 4, 6, 10], dtype=torch.int32, device=device)
    correct_kept_rows(
        TritonBlendKernels(TritonAttentionBackend(device)),
        rope,
        actual,
        *args,
        rows_of(rec, rows, segments),
        k,
        v,
        rows_of(kept, None, kept_segments, parts),
        3,
    )
    assert not torch.equal(expected, pool)
    _close(actual, expected)


# ---- a kernel that fails its check or its first launch is left off ---------------------------
def test_a_kernel_failing_its_check_is_left_off(tiny_llama_dir, device, monkeypatch, caplog):
    from blendkv.kernels.triton_attention import TritonAttentionBackend
    from blendkv.models.model_files import load_model, resolve_model

    def wrong_norm(x, weight, eps, residual=None):  # off by a lot
        out = torch.zeros_like(x)
        return out if residual is None else (out, x + residual)

    monkeypatch.setattr(ops, "rms_norm", wrong_norm)
    with caplog.at_level("WARNING", logger="blendkv.layers.fused_kernels"):
        backend = TritonAttentionBackend(device)
        model = load_model(resolve_model(str(tiny_llama_dir)), torch.float32, backend, device)
    assert "rms_norm kernel failed its check" in caplog.text
    assert all(m.kernel is None for m in model.modules() if isinstance(m, RMSNorm))
    assert model.model.rotary_emb.kernel is ops.rotary_qk  # the others still switched
    assert model.model.layers[0].mlp.act_and_mul is ops.silu_and_mul


def test_blend_kernels_that_fail_to_launch_fall_back_to_torch(device, monkeypatch, caplog):
    import blendkv.kernels.triton.query_mass as qm
    from blendkv.kernels.torch_attention import TorchAttentionBackend
    from blendkv.kernels.triton_attention import TritonAttentionBackend

    calls = []

    def broken(*args, **kwargs):  # the layer passes scale, window, soft_cap
        calls.append(1)
        raise RuntimeError("no such target")

    monkeypatch.setattr(qm, "add_query_mass", broken)
    g = torch.Generator().manual_seed(5)
    pool = torch.randn(2, 6, 4, 2, 16, generator=g).to(device)
    slots = torch.randperm(24, generator=g)[:20].to(device)
    q = torch.randn(3, 4, 16, generator=g).to(device)
    q_positions = torch.tensor([17, 18, 19], device=device)
    backend = TritonAttentionBackend(device)
    got, want = torch.zeros(20, device=device), torch.zeros(20, device=device)
    with caplog.at_level("WARNING", logger="blendkv.kernels.triton_attention"):
        for _ in range(2):
            backend.add_query_mass(got, q, q_positions, pool, slots)
            TorchAttentionBackend(device).add_query_mass(want, q, q_positions, pool, slots)
    assert calls == [1]  # tried once, then torch for good
    assert caplog.text.count("query_mass kernel failed") == 1
    torch.testing.assert_close(got, want)
