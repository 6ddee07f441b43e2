"""Tests that need a real CUDA GPU (``make test-gpu``); skipped, with the reason, elsewhere.

The CPU suite already runs every Triton kernel under the interpreter and the forward on fake
CUDA tensors; these check what only a GPU shows: compiled kernels at real shapes, the engine's
greedy tokens on CUDA against the CPU in fp32, and blended requests on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from helpers import QuietLLM

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

    seqs = [(0, 2048), (1500, 600), (4095, 1), (300, 1), (0, 1)]
    _both_backends(shape, seqs)


def _both_backends(shape, seqs):
    """The torch and Triton backends on one bf16 step: the same pool and output (close);
    returns (Triton backend, metadata)."""
    from blendkv.kernels.torch_attention import TorchAttentionBackend
    from blendkv.kernels.triton_attention import TritonAttentionBackend

    ref_backend, tri_backend = TorchAttentionBackend("cuda"), TritonAttentionBackend("cuda")
    q, k, v, cache, md = _step(ref_backend, *shape, seqs, 16, torch.bfloat16)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    scale = shape[2] ** -0.5
    ref = ref_backend.forward(q, k, v, ref_cache, md, scale)
    out = tri_backend.forward(q, k, v, tri_cache, md, scale)
    torch.testing.assert_close(tri_cache, ref_cache)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    return tri_backend, md


@pytest.mark.parametrize(
    "shape", [(32, 8, 128), (14, 2, 64)], ids=["llama8b-heads", "qwen05-heads"]
)
def test_few_rows_over_16k_keys_split_at_real_shapes(shape):
    """A reuse's query rows after 16K stored keys: the prefill tiles split their keys
    (prefill_num_splits) and match the torch backend."""
    tri_backend, md = _both_backends(shape, [(16350, 30)])
    group = shape[0] // shape[1]
    assert tri_backend._layout(md, group, False, shape[1]).prefill_splits > 1


@pytest.mark.parametrize(
    "shape", [(32, 8, 128), (14, 2, 64)], ids=["llama8b-heads", "qwen05-heads"]
)
def test_tuned_prefill_tiles_match_torch_on_blend_rows(shape):
    """This GPU generation's tuned tiles (kernels/triton/tuned; the defaults where it has none)
    on a blend's scattered rows and a query pass's split rows over 6K keys, bf16."""
    from blendkv.eval.bench.gpu_attention_tune import _case, _expected, _runner
    from blendkv.kernels.triton.prefill_tiles import tuned_tiles

    device = torch.device("cuda")
    tiles = tuned_tiles(device, shape[0] // shape[1], shape[2], torch.bfloat16)
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    for kind in ("scattered", "query"):
        case = _case(shape, 6144, kind, "cuda", seed=3)
        run, out, splits = _runner(case, tiles, programs)
        run()
        torch.testing.assert_close(out.float(), _expected(case), atol=2e-2, rtol=2e-2)
        assert kind == "scattered" or splits > 1


def test_engine_greedy_cuda_equals_cpu_fp32(tiny_llama_dir):
    from blendkv import SamplingParams

    prompts = [[5, 9, 13, 17, 21, 25, 29, 33] * k for k in (1, 3, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = QuietLLM(str(tiny_llama_dir), dtype="float32", device=device, kv_connector=None)
        outs[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["cuda"] == outs["cpu"]


def test_blended_requests_on_cuda(tiny_llama_dir, tmp_path):
    from helpers import BLEND_DOCS, BLEND_QUERY

    from blendkv import SamplingParams
    from blendkv.blend.config import BlendConfig

    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", device="cuda", kv_store_dir=str(tmp_path))
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


def test_cost_check_measures_cuda_steps_with_events(tiny_llama_dir, tmp_path):
    """On CUDA the cost check's rates come from event spans (device_timer), read at a later
    request without a sync: after a full prefill and a blend, a request that left its config to
    the engine is predicted, and says what it chose."""
    from helpers import BLEND_DOCS, BLEND_QUERY

    from blendkv import SamplingParams
    from blendkv.blend.config import BlendConfig

    llm = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        device="cuda",
        kv_store_dir=str(tmp_path),
        enable_prefix_caching=False,
        blend_cost_check=True,
    )
    prompt = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
    one = SamplingParams(temperature=0.0, max_tokens=1)
    ids = llm.blend_manager().prepare(prompt, BlendConfig()).prompt.token_ids
    for _ in range(2):
        llm.generate([ids], one)
        llm.generate([prompt], one, blend=BlendConfig())
    torch.cuda.synchronize()
    out = llm.generate([prompt], one)[0]  # the engine's default config: the check decides
    controller = llm.engine.kv_connector.controller
    assert controller.full_compute.value is not None and controller.full_compute.value > 0
    assert controller.compute.value is not None and controller.compute.value > 0
    assert out.blend_stats.cost_choice in ("blend", "cheaper_selection", "full_prefill")
    assert out.blend_stats.cost_reason.startswith("cost check:"), out.blend_stats.cost_reason
    llm.close()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pipelined_loading_on_cuda_equals_serial(tiny_llama_dir, tmp_path, backend):
    """The side-stream layer loads (pinned host -> device, RoPE, writes) leave the same blocks
    and logits as loading every layer before the forward."""
    from helpers import BLEND_DOCS, BLEND_QUERY

    from blendkv import SamplingParams
    from blendkv.blend.config import BlendConfig

    prompt = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
    blend, one = BlendConfig(recompute_ratio=0.3), SamplingParams(temperature=0.0, max_tokens=1)
    runs = []
    for pipelined in (False, False, True):  # the later engines read the first one's store
        llm = QuietLLM(
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


@pytest.mark.parametrize("pipelined", [False, True])
def test_device_tier_on_cuda_keeps_what_it_copied(tiny_llama_dir, tmp_path, pipelined):
    """kv_device_cache_bytes on CUDA: a fresh engine over a warm store copies each chunk into
    device memory as its stage loads it (side stream, pipelined) or before the forward; the
    next request reads them all from there; blocks and logits are those of an engine without
    the tier."""
    from helpers import BLEND_DOCS, BLEND_QUERY

    from blendkv import SamplingParams
    from blendkv.blend.config import BlendConfig

    prompt = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
    blend, one = BlendConfig(recompute_ratio=0.3), SamplingParams(temperature=0.0, max_tokens=1)
    runs = []
    for tier in (0, 64 << 20):
        llm = QuietLLM(
            str(tiny_llama_dir),
            dtype="float32",
            device="cuda",
            enable_prefix_caching=False,
            kv_store_dir=str(tmp_path),
            pipeline_kv_load=pipelined,
            kv_device_cache_bytes=tier,
        )
        n = len(llm.blend_manager().prepare(prompt, blend).prompt.token_ids)
        for _ in range(2):  # the first engine: computes, then reads; the second: copies, reads
            out = llm.generate([prompt], one, blend=blend, logits_from=n - 3)[0]
        runs.append((torch.stack(llm.engine.runner.kv_caches).cpu(), out.extra["prompt_logits"]))
        if tier:
            assert out.blend_stats.chunks_on_device == len(BLEND_DOCS)
            loader = llm.engine.kv_connector._loader
            assert all(v.is_cuda for v in loader.device_tier._entries.values())
        llm.close()
    (pool0, logits0), (pool1, logits1) = runs
    assert torch.equal(logits1, logits0) and torch.equal(pool1, pool0)


def test_elementwise_and_blend_kernels_at_llama8b_shapes():
    """The one-launch norm / RoPE / SiLU-and-mul, ProphetKV's query mass and the chunk shift
    at Llama-3.1-8B's widths (bf16) against their torch references."""
    from transformers import LlamaConfig

    from blendkv.blend.correction import Rows, correct_kept_rows
    from blendkv.kernels.blend_kernels import BlendKernels
    from blendkv.kernels.torch_attention import TorchAttentionBackend
    from blendkv.kernels.triton import elementwise as ops
    from blendkv.kernels.triton.query_mass import add_query_mass, query_mass_reference
    from blendkv.kernels.triton_attention import TritonAttentionBackend
    from blendkv.kernels.triton_blend import TritonBlendKernels
    from blendkv.layers.norm import RMSNorm
    from blendkv.layers.rotary import RotaryEmbedding

    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def close(a, b, tol=2e-2):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)

    x = torch.randn(3000, 4096, device=dev, dtype=bf16, generator=g)
    r = torch.randn(3000, 4096, device=dev, dtype=bf16, generator=g)
    norm = RMSNorm(4096, 1e-5).to(device=dev, dtype=bf16)
    ref_out, ref_res = norm(x, r)
    out, res = ops.rms_norm(x.clone(), norm.weight, 1e-5, r.clone())
    close(out, ref_out)
    assert torch.equal(res, ref_res)
    gu = torch.randn(3000, 2 * 14336, device=dev, dtype=bf16, generator=g)
    close(ops.silu_and_mul(gu), torch.nn.functional.silu(gu[:, :14336]) * gu[:, 14336:])

    config = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    )
    rope = RotaryEmbedding(config)
    qkv = torch.randn(3000, 48 * 128, device=dev, dtype=bf16, generator=g)
    q, k = qkv[:, : 32 * 128].view(-1, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(-1, 8, 128)
    positions = torch.randperm(8000, device=dev, generator=g)[:3000]
    ref_q, ref_k = rope.apply_rotary(positions, q, k)
    out_q, out_k = ops.rotary_qk(positions, q, k, *rope.tables(dev))
    close(out_q, ref_q)
    close(out_k, ref_k)

    pool = torch.randn(2, 400, 16, 8, 128, device=dev, dtype=bf16, generator=g)
    slots = torch.randperm(400 * 16, device=dev, generator=g)[:3000]
    qq = torch.randn(60, 32, 128, device=dev, dtype=bf16, generator=g)
    q_positions = torch.arange(2940, 3000, device=dev)
    expected = torch.zeros(3000, device=dev)
    actual = torch.zeros(3000, device=dev)
    query_mass_reference(expected, qq, q_positions, pool, slots)
    add_query_mass(actual, qq, q_positions, pool, slots)
    torch.testing.assert_close(actual, expected, atol=2e-3, rtol=5e-2)

    chunk_of = torch.arange(3000, device=dev) // 300
    rec = torch.arange(0, 3000, 9, device=dev)
    kept = torch.arange(3000, device=dev)[torch.arange(3000, device=dev) % 9 != 0]
    kk = torch.randn(len(rec) + 7, 8, 128, device=dev, dtype=bf16, generator=g)
    vv = torch.randn_like(kk)
    rows = torch.arange(len(rec), device=dev) + 7
    counts = torch.bincount(chunk_of[rec], minlength=10)
    segments = torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(torch.int32)
    pos = torch.arange(3000, device=dev)

    kept_counts = torch.bincount(chunk_of[kept], minlength=10)
    kept_segments = torch.cat((counts.new_zeros(1), kept_counts.cumsum(0))).to(torch.int32)

    def rows_of(idx, current=None, seg=None, parts=1):
        return Rows(pos[idx], slots[idx], chunk_of[idx], current, seg, parts)

    for pooled in (False, True):
        want, got = pool.clone(), pool.clone()
        correct_kept_rows(
            BlendKernels(TorchAttentionBackend(dev)),
            rope,
            want,
            "kv",
            32.0,
            pooled,
            rows_of(rec, rows),
            kk,
            vv,
            rows_of(kept),
            10,
        )
        correct_kept_rows(
            TritonBlendKernels(TritonAttentionBackend(dev)),
            rope,
            got,
            "kv",
            32.0,
            pooled,
            rows_of(rec, rows, segments),
            kk,
            vv,
            rows_of(kept, None, kept_segments, 4),
            10,
        )
        close(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replayed_pieces_equal_eager_on_cuda(tiny_llama_dir, tmp_path, backend):
    """Piecewise CUDA graphs (the engine's default on CUDA; on Triton ProphetKV's query pass
    whole too) against the same engine with them off: a plain prefill, a chunked one and
    blends (ProphetKV's two passes, V-deviation) give the same tokens and prompt logits (equal
    to fp32 rounding: a GEMM of padded rows may tile differently). The graphs really replayed
    and no capture failed."""
    from helpers import BLEND_DOCS, BLEND_QUERY

    from blendkv import SamplingParams
    from blendkv.blend.config import BlendConfig

    prompt = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    short = [5 + (i * 7) % 300 for i in range(37)]
    long = [11 + i % 150 for i in range(300)]
    runs = []
    for rows in (0, 2048):
        llm = QuietLLM(
            str(tiny_llama_dir),
            dtype="float32",
            device="cuda",
            attention_backend=backend,
            kv_store_dir=str(tmp_path / str(rows)),
            max_num_batched_tokens=128,
            max_graph_rows=rows,
        )
        n = len(llm.blend_manager().prepare(prompt, BlendConfig()).prompt.token_ids)
        outs = llm.generate([short, long], params, logits_from=30)
        for blend in (BlendConfig(), BlendConfig(selection="v_deviation")):
            outs += llm.generate([prompt], params, blend=blend, logits_from=n - 3)
        runs.append([(o.outputs[0].token_ids, o.extra["prompt_logits"]) for o in outs])
        graphs = llm.engine.runner.piece_graphs
        query = llm.engine.runner.query_graphs  # ProphetKV's query pass whole (Triton)
        if rows:
            assert graphs.failed is None, graphs.failed
            assert graphs.replays > 0 and graphs.num_graphs > 0
            if backend == "triton":
                assert query.failed is None, query.failed
                assert query.replays > 0
            else:
                assert query is None
        else:
            assert graphs is None and query is None
        llm.close()
    for (tokens, logits), (want_tokens, want_logits) in zip(runs[1], runs[0], strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_segmented_capture_replays_each_segment_after_its_wait():
    """ProphetKV's query pass is captured as one graph per loading stage: segment 1 must see
    what a copy finished before it (its wait orders the stream), segment 0 what was there
    before the copy. One graph, or a wait after the replay, reads 0 or 6 in both."""
    from blendkv.engine.cuda_graphs import CudaGraphCapture

    x = torch.zeros(3, device="cuda")
    src = torch.arange(1.0, 4.0, device="cuda")
    out = torch.zeros(2, device="cuda")

    def fn(cut):
        out[0] = x.sum()
        cut()
        out[1] = x.sum() * 2

    replay = CudaGraphCapture().segments(fn)
    side = torch.cuda.Stream()
    loaded = torch.cuda.Event()
    torch.cuda.synchronize()

    def before(segment):
        if segment == 0:  # the load starts on the side stream, slowly
            with torch.cuda.stream(side):
                torch.cuda._sleep(50_000_000)
                x.copy_(src)
                loaded.record(side)
        else:
            torch.cuda.current_stream().wait_event(loaded)

    replay(before)
    torch.cuda.synchronize()
    assert out.tolist() == [0.0, 12.0]


def test_a_failed_capture_leaves_the_capture_stream():
    """A host read inside the capture breaks it: the error is the op's, and the stream current
    before the capture is current after it (torch.cuda.graph alone leaves its capture stream
    current when ending the broken capture raises)."""
    from blendkv.engine.cuda_graphs import CudaGraphCapture

    x = torch.ones(4, device="cuda")
    captured = []

    def fn(cut):
        captured.append(torch.cuda.is_current_stream_capturing())
        return float(x.sum().item()) if captured[-1] else 0.0

    before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError):
        CudaGraphCapture().segments(fn)
    assert captured == [False, True]
    assert torch.cuda.current_stream() == before
    assert float(x.sum()) == 4.0  # the device still works


def test_uploads_do_not_wait_and_refuse_a_capture():
    """A pinned, non_blocking copy: the values arrive; inside a CUDA graph capture the copy
    raises (a captured one would read a reused pinned block at every replay)."""
    from blendkv.kernels.uploads import upload, upload_list

    x = torch.arange(1000, dtype=torch.int64)
    torch.cuda._sleep(50_000_000)  # the device busy: the copy queues behind it
    y = upload(x, "cuda")
    assert torch.equal(y.cpu(), x)
    assert upload_list([3, 1, 2], torch.int32, torch.device("cuda")).tolist() == [3, 1, 2]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="capture"):
        with torch.cuda.graph(graph):
            upload(x, "cuda")
