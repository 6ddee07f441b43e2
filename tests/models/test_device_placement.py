"""Device placement without a GPU: the forward on fake CUDA tensors (tests/fake_cuda.py).

Any op that mixes a CPU tensor into the CUDA computation raises
``FakeTensorDeviceMismatchError``; nothing is computed (fake tensors carry metadata only), so
these tests check placement, not values.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from fake_cuda import fake_cuda
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

from blendkv.kernels.attention import KVCacheSpec
from blendkv.kernels.blend_kernels import BlendKernels
from blendkv.kernels.torch_attention import TorchAttentionBackend
from blendkv.models.llama import LlamaForCausalLM
from blendkv.models.qwen2 import Qwen2ForCausalLM

SHAPES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
MODELS = {
    "llama": (transformers.LlamaConfig, LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, Qwen2ForCausalLM),
}


def fake_cuda_model(arch: str, backend):
    """The model with fake CUDA parameters (built on meta, no init, no copy)."""
    config_cls, model_cls = MODELS[arch]
    with torch.device("meta"):
        model = model_cls(config_cls(**SHAPES), backend)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            fake = torch.empty(p.shape, dtype=torch.float32, device="cuda")
            setattr(module, name, torch.nn.Parameter(fake, requires_grad=False))
    model.tie_weights()
    return model


def mixed_step(backend):
    """A fresh prefill, a chunked prefill continuing at 5, a decode and a 3-token prefill."""
    spec = KVCacheSpec(2, 16, 4, 2, 8, torch.float32)
    caches = backend.allocate_kv_cache(spec)
    md = backend.build_metadata([0, 5, 9, 0], [6, 4, 1, 3], [[0, 1], [2, 3, 4], [5, 6, 7], [8]], 4)
    return caches, md


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "piecewise-graphs"])
def test_paged_step_stays_on_cuda(arch, graphs):
    from blendkv.engine.cuda_graphs import EagerCapture
    from blendkv.engine.piecewise_graphs import PiecewiseGraphs

    backend = TorchAttentionBackend("cuda")
    with fake_cuda(), torch.inference_mode():
        model = fake_cuda_model(arch, backend)
        caches, md = mixed_step(backend)
        assert caches[0].device.type == "cuda" and md.positions.device.type == "cuda"
        ids = torch.zeros(md.num_tokens, dtype=torch.long, device="cuda")
        # (the pieces' static buffers are made on the device of what they hold)
        pieces = PiecewiseGraphs("cuda", max_rows=16, capture=EagerCapture()) if graphs else None
        hidden = model(ids, md.positions, caches, md, pieces=pieces)
        if graphs:
            assert pieces.replays == 1 + 1 + 1 and pieces.failed is None  # 2 layers
            assert all(b.device.type == "cuda" for b in pieces.buffers())
        logits = model.compute_logits(hidden[torch.tensor([5, 9, 10, 13], device="cuda")])
    assert hidden.device.type == "cuda" and logits.device.type == "cuda"
    assert logits.shape == (4, SHAPES["vocab_size"])


def test_dense_precompute_pass_stays_on_cuda():
    """Chunk precompute: two sequences without a KV pool (dense metadata)."""
    backend = TorchAttentionBackend("cuda")
    with fake_cuda(), torch.inference_mode():
        model = fake_cuda_model("llama", backend)
        md = backend.dense_metadata([5, 3])
        ids = torch.zeros(8, dtype=torch.long, device="cuda")
        hidden = model(ids, md.positions, None, md)
    assert hidden.device.type == "cuda"


def test_rope_at_load_stays_on_cuda():
    backend = TorchAttentionBackend("cuda")
    with fake_cuda(), torch.inference_mode():
        model = fake_cuda_model("llama", backend)
        caches, _ = mixed_step(backend)
        cos, sin = model.model.rotary_emb.tables("cuda")
        kv = torch.empty(1, 2, 3, 2, 8, device="cuda")  # layer 1 of a 3-token chunk
        positions = torch.tensor([4, 5, 6], device="cuda")
        BlendKernels(backend).load_rotated_kv(caches, 1, kv, positions, positions + 8, cos, sin)
    assert cos.device.type == "cuda"


def test_a_cpu_tensor_in_the_step_is_caught():
    """The check can fail: positions left on the CPU mix devices inside the layer loop."""
    backend = TorchAttentionBackend("cuda")
    with fake_cuda(), torch.inference_mode():
        model = fake_cuda_model("llama", backend)
        caches, md = mixed_step(backend)
        ids = torch.zeros(md.num_tokens, dtype=torch.long, device="cuda")
        with pytest.raises(FakeTensorDeviceMismatchError):
            model(ids, md.positions.cpu(), caches, md)


def test_kept_row_correction_stays_on_cuda():
    """The per-chunk mean shift of kept rows (blend's K/V correction) on CUDA tensors; a GPU
    run once found its accumulator made on the CPU."""
    from blendkv.blend.correction import chunk_mean_shift

    with fake_cuda():
        delta = torch.empty(5, 2, 8, device="cuda")
        chunk_ids = torch.zeros(5, dtype=torch.long, device="cuda")
        shift = chunk_mean_shift(delta, chunk_ids, 3, 1.0, pooled=True)
    assert shift.device.type == "cuda" and shift.shape == (3, 2, 8)
