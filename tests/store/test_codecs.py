"""Stored K/V codecs: round-trip error bounds derived from the stored scales, the value format,
and a store's refusal of another codec's values."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from blendkv.store import format as fmt
from blendkv.store.codecs import (
    EncodedKV,
    QuantizedPart,
    decode_reference,
    dequantize_part,
    encode,
)
from blendkv.store.errors import CodecMismatchError, CorruptValueError


def outlier_kv(seed: int, L=3, T=70, H=2, D=16, dtype=torch.float32) -> torch.Tensor:
    """Random K/V with a few outlier channels and an offset head (what real keys look like)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((L, 2, T, H, D), generator=g)
    kv[:, 0, :, :, 3] *= 30  # an outlier key channel in every head
    kv[1, 0, :, 1] += 50  # a key head far from zero: asymmetric groups
    kv[2, 1, 5] *= 100  # one large value token
    return kv.to(dtype)


def _bound(x: torch.Tensor, part: QuantizedPart) -> torch.Tensor:
    """|x - x_hat| allowed per element: half a stored scale, plus float32 rounding of the
    encode (x / s + z) and decode ((q - z) * s) arithmetic."""
    L, T, H, D = x.shape
    gt, gd = part.group

    def expand(g):
        return g.float().repeat_interleave(gt, 1)[:, :T].repeat_interleave(gd, 3)[..., :D]

    s = expand(part.scale)
    z = expand(part.zero).abs() if part.zero is not None else torch.zeros_like(s)
    eps = 2.0**-22
    return s / 2 + eps * (x.abs() + s * (z + 2**part.bits))


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_within_half_a_scale(codec, seed):
    kv = outlier_kv(seed)
    enc = encode(kv, codec, outlier_threshold=math.inf)
    assert enc.outlier_heads is None
    for i, part in ((0, enc.k), (1, enc.v)):
        assert part.scale.dtype == torch.float16
        assert bool((part.scale.float() >= 2.0**-14).all())
        x = kv[:, i]
        err = (dequantize_part(part, x.shape[1], x.shape[3]) - x).abs()
        assert bool((err <= _bound(x, part)).all()), (codec, i, float(err.max()))
    # decode_reference in float32 is exactly the parts' decode
    out = decode_reference(enc, torch.float32)
    assert torch.equal(out[:, 0], dequantize_part(enc.k, 70, 16))
    assert torch.equal(out[:, 1], dequantize_part(enc.v, 70, 16))


def test_the_bound_is_tight_enough_to_fail():
    """A code off by one breaks the bound (the check is not vacuous)."""
    kv = outlier_kv(0)
    enc = encode(kv, "int8")
    q = enc.k.q.clone()
    q[0, 0, 0, 0] += 1 if q[0, 0, 0, 0] < 127 else -1
    bad = QuantizedPart(q, enc.k.scale, enc.k.zero, enc.k.group, 8)
    x = kv[:, 0]
    err = (dequantize_part(bad, 70, 16) - x).abs()
    assert not bool((err <= _bound(x, bad)).all())


def test_group_shapes_and_sizes():
    kv = outlier_kv(0, T=256, D=64, dtype=torch.bfloat16)
    raw = kv.numel() * 2
    e8 = encode(kv, "int8")
    assert e8.k.group == (256, 1) and e8.v.group == (1, 64)
    assert e8.k.q.dtype == torch.int8 and e8.k.scale.shape == (3, 1, 2, 64)
    assert e8.v.scale.shape == (3, 256, 2, 1)
    e4 = encode(kv, "int4", outlier_threshold=math.inf)
    assert e4.k.q.shape == (3, 256, 2, 32) and e4.k.q.dtype == torch.uint8
    assert e4.k.group == (128, 1) and e4.k.scale.shape == (3, 2, 2, 64)
    assert e4.v.group == (1, 64) and e4.v.scale.shape == (3, 256, 2, 1)
    assert len(fmt.encode_value(e8)) * 1.9 <= raw
    assert len(fmt.encode_value(e4)) * 3.5 <= raw


def test_int4_nibbles_low_is_even_channel():
    kv = torch.zeros(1, 2, 1, 1, 4)
    kv[0, 0, 0, 0] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    enc = encode(kv, "int4", outlier_threshold=math.inf)
    # keys: one group per channel (gt covers the token): each channel's code is +-7 (sym)
    # or its asymmetric code; decode the bytes by hand
    b = enc.k.q[0, 0, 0]
    lo = [int(v) & 0xF for v in b]
    hi = [int(v) >> 4 for v in b]
    codes = [c - 16 if c >= 8 else c for pair in zip(lo, hi, strict=True) for c in pair]
    s = enc.k.scale[0, 0, 0].float()
    z = enc.k.zero[0, 0, 0].float() if enc.k.zero is not None else torch.zeros(4)
    manual = (torch.tensor(codes, dtype=torch.float32) - z) * s
    assert torch.equal(manual, decode_reference(enc, torch.float32)[0, 0, 0, 0])


def test_outlier_heads_keep_their_keys_exactly():
    kv = outlier_kv(0, dtype=torch.bfloat16)
    kv[1, 0, ::32, 0] *= 20  # a spike in every key group of head 0: int4 loses the rest
    enc = encode(kv, "int4", outlier_threshold=0.12)
    assert enc.outlier_heads is not None and enc.outlier_heads.tolist() == [
        [False, False],
        [True, False],
        [False, False],
    ]
    out = decode_reference(enc)
    for layer, head in enc.outlier_heads.nonzero().tolist():
        assert torch.equal(out[layer, 0, :, head], kv[layer, 0, :, head])
    one = enc.layer(1)
    assert torch.equal(decode_reference(one), out[1:2])


def test_none_is_the_tensor_bit_for_bit():
    kv = outlier_kv(0, dtype=torch.bfloat16)
    assert encode(kv, "none") is kv
    buf = fmt.encode_value(kv)
    header = fmt.check_value(buf)
    assert header.codec == "none" and header.version == 2
    assert bytes(buf[fmt.HEADER_SIZE :]) == kv.contiguous().view(torch.uint8).numpy().tobytes()
    assert torch.equal(fmt.decode_value(buf, header), kv)


def _v1_value(kv: torch.Tensor) -> bytearray:
    """A value as blendkv wrote it before codecs (format version 1)."""
    payload = fmt.tensor_bytes(kv)
    dims = tuple(kv.shape) + (0,) * (5 - kv.ndim)
    head = struct.pack(
        "<4sHBBQQ5Q",
        b"BKVC",
        1,
        fmt.DTYPE_TO_CODE[kv.dtype],
        kv.ndim,
        fmt.checksum(payload),
        len(payload),
        *dims,
    )
    return bytearray(head) + bytearray(payload)


def test_version_1_values_read_as_none():
    kv = outlier_kv(0, dtype=torch.bfloat16)
    value = _v1_value(kv)
    header = fmt.check_value(value, codec="none")
    assert header.version == 1 and header.codec == "none"
    assert torch.equal(fmt.decode_value(value, header), kv)
    value[fmt.HEADER_SIZE + 3] ^= 1
    with pytest.raises(CorruptValueError):
        fmt.check_value(value)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_encoded_value_round_trips_through_bytes(codec):
    kv = outlier_kv(0, dtype=torch.bfloat16)
    enc = encode(kv, codec, outlier_threshold=0.05)
    buf = fmt.encode_value(enc)
    header = fmt.check_value(buf, codec=codec)
    got = fmt.decode_value(bytes(buf), header)
    assert isinstance(got, EncodedKV)
    assert torch.equal(decode_reference(got), decode_reference(enc))
    with pytest.raises(CodecMismatchError, match=f"'none'.*'{codec}'"):
        fmt.check_value(buf, codec="none")


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_every_byte_is_covered_by_the_checksum(codec):
    """Flip one bit anywhere (header codec fields, scales, padding, outliers): refused."""
    enc = encode(outlier_kv(0, dtype=torch.bfloat16), codec, outlier_threshold=0.05)
    buf = fmt.encode_value(enc)
    g = torch.Generator().manual_seed(0)
    offsets = [44, 45, 50, 60] + torch.randint(64, len(buf), (24,), generator=g).tolist()
    for offset in offsets + [len(buf) - 1]:
        bad = bytearray(buf)
        bad[offset] ^= 0x10
        with pytest.raises(CorruptValueError):
            fmt.check_value(bad)
