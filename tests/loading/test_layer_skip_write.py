"""The layer-wise writer with per-layer skips (a sliding-window layer's unread prefix): each
layer writes exactly its own token range, in one load-kernel call per run of layers sharing (RoPE
table, skip), in every CPU mode, for a plain and an int8-encoded chunk."""

from __future__ import annotations

import pytest
import torch

from blendkv.kernels.blend_kernels import BlendKernels
from blendkv.kernels.kv_dequant import as_chunk
from blendkv.kernels.torch_attention import TorchAttentionBackend
from blendkv.loading.layer_load import ChunkWrite, LayerwiseLoad
from blendkv.store.codecs import encode

LAYERS, TOKENS, HEADS, DIM = 4, 6, 1, 8


class CountingKernels(BlendKernels):
    """The real torch blend kernels, recording each load call's (first layer, layers, tokens)."""

    def __init__(self) -> None:
        super().__init__(TorchAttentionBackend("cpu"))
        self.calls: list[tuple[int, int, int]] = []

    def load_rotated_kv(self, kv_caches, first_layer, kv, positions, slots, cos, sin) -> None:
        self.calls.append((first_layer, kv.shape[0], len(positions)))
        super().load_rotated_kv(kv_caches, first_layer, kv, positions, slots, cos, sin)

    def load_encoded_kv(self, kv_caches, first_layer, chunk, positions, slots, cos, sin) -> None:
        self.calls.append((first_layer, chunk.shape[0], len(positions)))
        super().load_encoded_kv(kv_caches, first_layer, chunk, positions, slots, cos, sin)


def _write(kv, skips, pipelined):
    gen = torch.Generator().manual_seed(1)
    global_table = (torch.rand(32, DIM, generator=gen), torch.rand(32, DIM, generator=gen))
    local_table = (torch.rand(32, DIM, generator=gen), torch.rand(32, DIM, generator=gen))
    tables = [global_table, local_table, local_table, local_table]
    pool = [torch.zeros(2, 3, 4, HEADS, DIM) for _ in range(LAYERS)]  # 3 blocks of 4
    positions = torch.arange(5, 5 + TOKENS)
    slots = torch.tensor([1, 2, 3, 8, 9, 10])
    kernels = CountingKernels()
    write = ChunkWrite(kv, 0, positions, slots, layer_skips=skips)
    load = LayerwiseLoad(kernels, pool, tables, [write], pipelined)
    load.start()
    for layer in range(LAYERS):
        load.wait(layer)
    load.finish()
    return pool, kernels.calls, slots


@pytest.mark.parametrize("codec", ["none", "int8"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_each_layer_writes_its_own_range_in_runs(codec, pipelined):
    kv = as_chunk(encode(torch.randn(LAYERS, 2, TOKENS, HEADS, DIM), codec))
    skips = [0, 3, 3, 6]  # a global layer, two windowed ones sharing a skip, one reading none
    full, _, slots = _write(kv, None, pipelined)
    pool, calls, _ = _write(kv, skips, pipelined)
    flat = [p.view(2, -1, HEADS, DIM) for p in pool]
    ref = [p.view(2, -1, HEADS, DIM) for p in full]
    for layer, skip in enumerate(skips):
        written, unwritten = slots[skip:], slots[:skip]
        assert torch.equal(flat[layer][:, written], ref[layer][:, written])
        assert not flat[layer][:, unwritten].any()
        assert ref[layer][:, slots].any()
    if pipelined:  # one layer at a time
        assert calls == [(0, 1, 6), (1, 1, 3), (2, 1, 3)]
    else:  # runs of (table, skip): layers 1-2 share both; layer 3 writes nothing
        assert calls == [(0, 1, 6), (1, 2, 3)]
    assert ChunkWrite(kv, 0, slots, slots, layer_skips=skips).nbytes * 2 == (
        ChunkWrite(kv, 0, slots, slots).nbytes
    )
