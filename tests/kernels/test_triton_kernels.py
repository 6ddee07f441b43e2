"""Each Triton kernel against its torch reference, on tiny shapes (CPU: Triton's interpreter)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from blendkv.kernels.triton import decode_attention, prefill_attention, rope_load, write_kv  # noqa: E402
from blendkv.kernels.triton.decode_attention import decode_attention_reference  # noqa: E402
from blendkv.kernels.triton.kv_write import write_kv_reference  # noqa: E402
from blendkv.kernels.triton.prefill_attention import prefill_attention_reference  # noqa: E402
from blendkv.kernels.triton.prefill_tiles import block_q_for, build_tiles  # noqa: E402
from blendkv.kernels.triton.rope_load import rope_load_reference, stacked_layers  # noqa: E402

SCALE = 0.35


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:  # bf16: kernels accumulate in float32, the reference in bf16 steps
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=1.6e-2)


# ---- kv_write -----------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_matches_reference_and_skips_negative_slots(make_step, cache_dtype):
    step = make_step([0, 6], [5, 3], block_size=4, num_kv_heads=3, group=1, head_dim=6)
    pool = step.pool.to(cache_dtype)
    # K and V as strided views of one fused projection, as a model's qkv split gives them.
    fused = torch.cat((step.k, step.v), dim=-1)
    k, v = fused[..., :6], fused[..., 6:]
    slots = step.md.slot_mapping.clone()
    slots[2] = -1
    expected, actual = pool.clone(), pool.clone()
    write_kv_reference(expected, k, v, slots)
    write_kv(actual, k, v, slots)
    assert torch.equal(actual, expected)
    assert not torch.equal(actual, pool)


# ---- decode -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("group", "block_size", "dtype", "num_splits"),
    [
        (1, 16, torch.float32, 1),
        (3, 4, torch.float32, 4),  # 70 keys over splits of 32: the last split is empty
        (7, 16, torch.float32, 2),
        (3, 4, torch.bfloat16, 2),
        (2, 6, torch.float32, 2),  # block size not a power of two
    ],
    ids=[
        "gqa1-bs16-fp32",
        "gqa3-bs4-fp32-4splits",
        "gqa7-bs16-fp32",
        "gqa3-bs4-bf16",
        "gqa2-bs6-fp32",
    ],
)
def test_decode_attention(make_step, group, block_size, dtype, num_splits):
    # Context lengths 1 (a row at position 0), 6 and 70 (ending mid-block), 33 (two key tiles).
    step = make_step(
        [0, 5, 69, 32],
        [1, 1, 1, 1],
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        dtype=dtype,
    )
    md = step.md
    seq_ids = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=step.q.device)
    args = (step.q, step.pool, md.block_table, md.seq_lens, md.query_start_loc, seq_ids, SCALE)
    expected = torch.zeros_like(step.q)
    decode_attention_reference(expected, *args)
    actual = torch.zeros_like(step.q)
    decode_attention(actual, *args, num_splits)
    assert_close(actual, expected)


def test_decode_attention_leaves_other_rows_alone(make_step):
    step = make_step([3, 0], [1, 4], block_size=4, num_kv_heads=1, group=2)
    md = step.md
    out = torch.full_like(step.q, 7.0)
    seq_ids = torch.tensor([0], dtype=torch.int32, device=step.q.device)
    args = (step.q, step.pool, md.block_table, md.seq_lens, md.query_start_loc, seq_ids, SCALE)
    decode_attention(out, *args, 2)
    assert (out[1:] == 7.0).all() and not (out[0] == 7.0).any()


def test_decode_attention_padding_row_is_zero(make_step):
    step = make_step([3, 0], [1, 1], block_size=4, num_kv_heads=1, group=2)
    md = step.md
    seq_lens = md.seq_lens.clone()
    seq_lens[1] = 0  # a padding row of a padded decode batch
    out = torch.full_like(step.q, 7.0)
    seq_ids = torch.tensor([0, 1], dtype=torch.int32, device=step.q.device)
    decode_attention(
        out, step.q, step.pool, md.block_table, seq_lens, md.query_start_loc, seq_ids, SCALE, 2
    )
    assert torch.isfinite(out[0]).all() and (out[1] == 0).all()


# ---- prefill at arbitrary positions -------------------------------------------------------
# fresh prefill from position 0 | chunk continuing at 5 ending mid-block | decode row |
# prefix hit: 3 rows after 37 cached keys (two key tiles)
COMPUTED, QUERY_LENS = [0, 5, 20, 37], [9, 6, 1, 3]


def run_prefill(
    step, block_m: int, num_splits: int = 1, window=None, soft_cap=None, config=None, lse=None
):
    from blendkv.kernels.triton.prefill_tiles import PrefillTiles

    config = config or PrefillTiles(block_m=block_m)
    md = step.md
    seq_ids = list(range(md.num_seqs))
    group = step.q.shape[1] // step.pool.shape[3]
    block_q = block_q_for(group, block_m)
    tiles = build_tiles(md.query_start_loc_cpu, seq_ids, block_q, step.q.device)
    expected = torch.zeros_like(step.q)
    prefill_attention_reference(
        expected,
        step.q,
        step.pool,
        md.block_table,
        md.seq_lens_cpu,
        md.query_start_loc_cpu,
        md.positions,
        seq_ids,
        SCALE,
        window,
        soft_cap,
    )
    actual = torch.zeros_like(step.q)
    prefill_attention(
        actual,
        step.q,
        step.pool,
        md.block_table,
        md.seq_lens,
        md.query_start_loc,
        md.positions,
        *tiles,
        block_q,
        SCALE,
        window,
        soft_cap,
        num_splits,
        config,
        lse,
    )
    return actual, expected


@pytest.mark.parametrize(
    ("group", "block_size", "dtype"),
    [
        (1, 4, torch.float32),
        (3, 16, torch.float32),
        (7, 4, torch.float32),
        (3, 4, torch.bfloat16),
    ],
    ids=["gqa1-bs4-fp32", "gqa3-bs16-fp32", "gqa7-bs4-fp32", "gqa3-bs4-bf16"],
)
@pytest.mark.parametrize("scattered", [False, True], ids=["contiguous", "scattered"])
def test_prefill_attention(make_step, group, block_size, dtype, scattered):
    step = make_step(
        COMPUTED, QUERY_LENS, block_size=block_size, num_kv_heads=2, group=group, dtype=dtype
    )
    if scattered:
        # CacheBlend keeps a few rows per sequence: position 0, gaps, a sequence's last row.
        keep = torch.zeros(step.md.num_tokens, dtype=torch.bool)
        keep[[0, 3, 4, 8, 10, 14, 15, 17]] = True
        step = step.subset(keep.to(step.q.device))
    # Tiles of 16 (row, head) pairs: sequences span several tiles, tiles end mid-sequence.
    actual, expected = run_prefill(step, block_m=16)
    assert_close(actual, expected)


# Split keys (few tiles over long keys): 37 + 40 keys in parts of whole 32-key tiles, so the
# later parts are empty for the early rows (they see no key there) and, with 8 parts, for every
# row; the combine must weigh them out.
@pytest.mark.parametrize("num_splits", [2, 8])
@pytest.mark.parametrize(
    ("window", "soft_cap"), [(None, None), (6, 5.0)], ids=["plain", "window-cap"]
)
def test_prefill_attention_split_keys(make_step, num_splits, window, soft_cap):
    step = make_step([37, 0], [3, 40], block_size=4, num_kv_heads=2, group=3)
    actual, expected = run_prefill(step, 16, num_splits, window, soft_cap)
    assert_close(actual, expected)
    whole, _ = run_prefill(step, 16, 1, window, soft_cap)
    assert_close(actual, whole)


def oracle_lse(step, window, soft_cap) -> torch.Tensor:
    """[rows, heads] float64: each row's log2 of the sum of 2 ** (its scaled logits x log2 e)
    over the keys it sees."""
    from blendkv.kernels.torch_attention import gather_kv

    md = step.md
    group = step.q.shape[1] // step.pool.shape[3]
    out = torch.empty(step.q.shape[:2], dtype=torch.float64)
    starts = md.query_start_loc_cpu
    for i in range(md.num_seqs):
        lo, hi = starts[i], starts[i + 1]
        keys, _ = gather_kv(step.pool, md.block_table[i], md.seq_lens_cpu[i])
        k = keys.double().cpu().repeat_interleave(group, dim=1)
        s = torch.einsum("nhd,shd->nhs", step.q[lo:hi].double().cpu(), k) * SCALE
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        j, p = torch.arange(len(keys))[None, :], md.positions[lo:hi].cpu()[:, None]
        seen = (j <= p) & ((j > p - window) if window is not None else True)
        s = s.masked_fill(~seen[:, None, :], float("-inf"))
        out[lo:hi] = torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    return out


# The log-sum-exp ProphetKV's query mass reads back (prefill_attention(lse=...)): every row and
# head's, whole or combined from key parts (some of them empty for early rows).
@pytest.mark.parametrize("num_splits", [1, 2, 8])
@pytest.mark.parametrize(
    ("window", "soft_cap"), [(None, None), (6, 5.0)], ids=["plain", "window-cap"]
)
def test_prefill_attention_writes_each_rows_log_sum_exp(make_step, num_splits, window, soft_cap):
    step = make_step([37, 0, 20], [3, 40, 1], block_size=4, num_kv_heads=2, group=3)
    lse = torch.full(step.q.shape[:2], float("nan"), device=step.q.device)
    actual, expected = run_prefill(step, 16, num_splits, window, soft_cap, lse=lse)
    assert_close(actual, expected)
    torch.testing.assert_close(
        lse.cpu().double(), oracle_lse(step, window, soft_cap), atol=1e-5, rtol=1e-5
    )


# Tuned tiles (prefill_tiles): key tiles of 16 and 64 (past the 40 keys of a sequence: masked),
# more warps and fewer stages, rows per tile from block_m; the same output as the reference.
@pytest.mark.parametrize(
    "tiles",
    [(32, 16, 2, 1), (64, 64, 8, 2), (128, 128, 4, 3)],
    ids=["m32n16", "m64n64", "m128n128"],
)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_prefill_attention_tiles(make_step, tiles, num_splits):
    from blendkv.kernels.triton.prefill_tiles import PrefillTiles

    tiles = PrefillTiles(*tiles)
    step = make_step([37, 0], [3, 40], block_size=4, num_kv_heads=2, group=3)
    actual, expected = run_prefill(step, tiles.block_m, num_splits, config=tiles)
    assert_close(actual, expected)


def test_prefill_num_splits():
    from blendkv.kernels.triton.prefill_tiles import prefill_num_splits

    # a reuse at 16K on an 8B shape (2 tiles, 8 kv heads, 264 programs): 16 parts of 1K keys
    assert prefill_num_splits(2, 8, 16384, 264) == 16
    assert prefill_num_splits(2, 8, 1024, 264) == 4  # each part keeps >= 256 keys
    assert prefill_num_splits(40, 8, 16384, 264) == 1  # the tiles fill the device
    assert prefill_num_splits(1, 1, 10**6, 10**6) == 32  # at most 32 parts
    assert prefill_num_splits(0, 8, 16384, 264) == 1
    assert prefill_num_splits(3, 8, 300, 264) == 1  # too few keys to split


# ---- RoPE at load -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rotary():
    from blendkv.layers.rotary import RotaryEmbedding

    config = SimpleNamespace(
        hidden_size=32,
        num_attention_heads=4,
        head_dim=8,
        max_position_embeddings=64,
        rope_theta=10000.0,
    )
    return RotaryEmbedding(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["one_pool", "separate"])
@pytest.mark.parametrize("rows_per_program", [1, 16], ids=["gpu_rows", "interpreter_rows"])
def test_rope_load(rotary, device, dtype, layout, rows_per_program, monkeypatch):
    import sys

    from blendkv.kernels.torch_attention import write_kv_cache

    monkeypatch.setattr(
        sys.modules["blendkv.kernels.triton.rope_load"], "ROWS_PER_PROGRAM", rows_per_program
    )

    num_layers, first, num_tokens, heads, dim = 3, 1, 5, 2, 8
    gen = torch.Generator().manual_seed(1)
    shape = (2, 4, 4, heads, dim)  # 4 blocks of 4
    if layout == "one_pool":
        pool = torch.randn(num_layers, *shape, generator=gen).to(dtype=dtype, device=device)
        caches = list(pool)
        assert stacked_layers(caches[first:]) is not None
    else:
        caches = [
            torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        assert stacked_layers(caches[first:]) is None
    kv = torch.randn(num_layers - first, 2, num_tokens, heads, dim, generator=gen)
    kv = kv.to(dtype=dtype, device=device)
    positions = torch.tensor([0, 7, 8, 30, 63], device=device)
    slots = torch.tensor([5, 0, -1, 15, 9], device=device)
    cos, sin = rotary._cos.to(device), rotary._sin.to(device)

    expected = [c.clone() for c in caches]
    rope_load_reference(expected, first, kv, positions, slots, cos, sin)
    # The reference is exactly rotate_k + write_kv_cache, layer by layer.
    by_rotary = [c.clone() for c in caches]
    keep = slots >= 0
    for i in range(num_layers - first):
        k = rotary.rotate_k(positions[keep], kv[i, 0, keep])
        write_kv_cache(by_rotary[first + i], k, kv[i, 1, keep], slots[keep])
    for a, b in zip(expected, by_rotary, strict=True):
        assert torch.equal(a, b)

    before = [c.clone() for c in caches]
    rope_load(caches, first, kv, positions, slots, cos, sin)
    assert torch.equal(caches[0], before[0])  # layers before first_layer untouched
    for actual, ref in zip(caches, expected, strict=True):
        assert_close(actual, ref)


def test_prefill_attention_sees_a_wrong_mask(make_step):
    """The comparison above is sensitive to the mask: rows shifted one position later (one more
    key visible) no longer match the reference."""
    step = make_step(COMPUTED, QUERY_LENS, block_size=4, num_kv_heads=1, group=2)
    _, expected = run_prefill(step, block_m=16)
    step.md.positions = step.md.positions + 1
    shifted, _ = run_prefill(step, block_m=16)
    assert not torch.allclose(shifted, expected, atol=1e-3)
