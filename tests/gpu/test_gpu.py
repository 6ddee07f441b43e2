"""Tests that need a real CUDA GPU (``make test-gpu``); skipped, with the reason, elsewhere.

The CPU suite already runs every Triton kernel under the interpreter and the forward on fake
CUDA tensors; these check what only a GPU shows: compiled kernels at real shapes, the engine's
greedy tokens on CUDA against the CPU in fp32, and blended requests on CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]


def _step(backend, num_heads, num_kv_heads, head_dim, seqs, block_size, dtype):
    """A mixed step at real shapes: (num_computed, num_new) per sequence, random pool."""
    from blendkv.kernels.attention import KVCacheSpec

    g = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    spec = KVCacheSpec(1, sum(blocks_per_seq) + 1, block_size, num_kv_heads, head_dim, dtype)
    cache = backend.allocate_kv_cache(spec)[0]
    cache.normal_(generator=g)
    tables, nxt = [], 1
    for nb in blocks_per_seq:
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    md = backend.build_metadata([c for c, _ in seqs], [n for _, n in seqs], tables, block_size)
    t = md.num_tokens
    q = torch.randn(t, num_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(t, num_kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(t, num_kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    return q, k, v, cache, md


@pytest.mark.parametrize(
    "shape", [(32, 8, 128), (14, 2, 64)], ids=["llama8b-heads", "qwen05-heads"]
)
def test_triton_backend_matches_torch_at_real_shapes(shape):
    from blendkv.kernels.torch_attention import TorchAttentionBackend
    from blendkv.kernels.triton_attention import TritonAttentionBackend

    seqs = [(0, 2048), (1500, 600), (4095, 1), (300, 1), (0, 1)]
    ref_backend, tri_backend = TorchAttentionBackend("cuda"), TritonAttentionBackend("cuda")
    q, k, v, cache, md = _step(ref_backend, *shape, seqs, 16, torch.bfloat16)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    scale = shape[2] ** -0.5
    ref = ref_backend.forward(q, k, v, ref_cache, md, scale)
    out = tri_backend.forward(q, k, v, tri_cache, md, scale)
    torch.testing.assert_close(tri_cache, ref_cache)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_engine_greedy_cuda_equals_cpu_fp32(tiny_llama_dir):
    from blendkv import LLM, SamplingParams

    prompts = [[5, 9, 13, 17, 21, 25, 29, 33] * k for k in (1, 3, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(tiny_llama_dir), dtype="float32", device=device, kv_connector=None)
        outs[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["cuda"] == outs["cpu"]


def test_blended_requests_on_cuda(tiny_llama_dir, tmp_path):
    from helpers import BLEND_DOCS, BLEND_QUERY

    from blendkv import LLM, SamplingParams
    from blendkv.blend.config import BlendConfig

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cuda", kv_store_dir=str(tmp_path))
    prompt = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    manager = llm.blend_manager()
    ids = manager.prepare(prompt, BlendConfig()).prompt.token_ids
    full = llm.generate([ids], params)[0].outputs[0].token_ids
    exact = llm.generate([prompt], params, blend=BlendConfig(recompute_ratio=1.0))[0]
    assert exact.outputs[0].token_ids == full
    out = llm.generate([prompt], params, blend=BlendConfig(recompute_ratio=0.15))[0]
    assert out.blend_stats.chunks_hit == len(BLEND_DOCS)
    assert len(out.outputs[0].token_ids) == 12
    llm.close()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pipelined_loading_on_cuda_equals_serial(tiny_llama_dir, tmp_path, backend):
    """The side-stream layer loads (pinned host -> device, RoPE, writes) leave the same blocks
    and logits as loading every layer before the forward."""
    from helpers import BLEND_DOCS, BLEND_QUERY

    from blendkv import LLM, SamplingParams
    from blendkv.blend.config import BlendConfig

    prompt = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
    blend, one = BlendConfig(recompute_ratio=0.3), SamplingParams(temperature=0.0, max_tokens=1)
    runs = []
    for pipelined in (False, False, True):  # the later engines read the first one's store
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            device="cuda",
            attention_backend=backend,
            enable_prefix_caching=False,
            kv_store_dir=str(tmp_path),
            pipeline_kv_load=pipelined,
        )
        llm.generate([prompt], one, blend=blend)  # warm: chunks in the memory tier
        n = len(llm.blend_manager().prepare(prompt, blend).prompt.token_ids)
        out = llm.generate([prompt], one, blend=blend, logits_from=n - 3)[0]
        assert out.blend_stats.chunks_hit == len(BLEND_DOCS)
        pool = torch.stack(llm.engine.runner.kv_caches).cpu()
        runs.append((pool, out.extra["prompt_logits"]))
        stats = out.blend_stats  # device time from CUDA events
        assert stats.write_seconds > 0
        assert 0.0 <= stats.load_hidden_seconds <= stats.write_seconds
        assert pipelined or stats.load_hidden_seconds == 0.0
        llm.close()
    (pool0, logits0), (pool1, logits1), (pool2, logits2) = runs
    assert torch.equal(pool1, pool0) and torch.equal(logits1, logits0), "not deterministic"
    assert torch.equal(pool2, pool0), "pipelined blocks differ from serial"
    assert torch.equal(logits2, logits0), "pipelined logits differ from serial"
