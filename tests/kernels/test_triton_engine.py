"""The whole engine on the Triton backend (CPU: Triton's interpreter) against the torch backend.

A tiny random-weight Llama; one schedule mixes a decode, a chunked prefill, a prefix-cache hit
and a blended prefill at ratio 0.3, and every request's greedy tokens must be the torch
backend's (the same schedule checks the C++ CPU kernels on a tiny Qwen2). Decode steps
replayed through :class:`DecodeGraphs` (with the eager stand-in for the CUDA capture) must give
the same tokens as eager steps.
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers import BLEND_DOCS, BLEND_QUERY, QuietLLM

pytest.importorskip("triton", reason="triton is not installed: the Triton backend cannot run")

from blendkv import SamplingParams  # noqa: E402
from blendkv.blend.config import BlendConfig  # noqa: E402
from blendkv.engine.cuda_graphs import DecodeGraphs, EagerCapture  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PREFIX = [7 + (i * 5) % 200 for i in range(24)]
BLEND = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
# On a GPU the kernels run compiled; here under the interpreter (tests/kernels/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_llm(path, backend, store):
    return QuietLLM(
        str(path),
        dtype="float32",
        block_size=4,
        device=DEVICE,
        attention_backend=backend,
        max_num_batched_tokens=160,
        kv_store_dir=str(store),
    )


def with_decode_graphs(llm, max_num_seqs: int, capture) -> DecodeGraphs:
    """Give the engine decode graphs on the CPU (the engine makes them only on CUDA)."""
    engine = llm.engine
    graphs = DecodeGraphs(
        engine.model,
        engine.attn_backend,
        engine.runner.kv_caches,
        engine.config.cache.block_size,
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        capture=capture,
    )
    engine.runner.decode_graphs = graphs
    return graphs


def wait_for_prefetch(engine, request_id: str, timeout: float = 60.0) -> None:
    """Wait until the connector's reader thread holds the request's stored chunks, so the
    schedule does not depend on how fast that thread ran (a loaded CI machine is slow)."""
    seq = engine.requests[request_id].seq
    deadline = time.monotonic() + timeout
    while not engine.kv_connector.kv_ready(seq):
        assert time.monotonic() < deadline, "the prefetch of stored chunks never finished"
        time.sleep(0.01)


def run_mixed(llm) -> tuple[dict, list]:
    """Returns each request's greedy tokens and the step layouts."""
    engine = llm.engine
    results, steps = {}, []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append({s.request_id: n for s, n in out.scheduled})
        return out

    def drain():
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    results[o.request_id] = o.outputs[0].token_ids

    engine.add_request(PREFIX, GREEDY, request_id="first")
    # Stores the documents' chunks, so the recorded blend needs no precompute step of its own
    # (another ratio: its blended blocks are not a prefix-cache hit for the recorded one).
    engine.add_request(BLEND, GREEDY, request_id="warm", blend=BlendConfig(recompute_ratio=0.5))
    drain()  # "first"'s blocks are now in the prefix cache
    engine.scheduler.schedule = recording_schedule
    engine.add_request([3, 4, 5, 6, 7, 8], GREEDY, request_id="decode")
    engine.step()
    engine.add_request(PREFIX + [90, 91, 92], GREEDY, request_id="hit")
    engine.add_request(BLEND, GREEDY, request_id="blend", blend=BlendConfig(recompute_ratio=0.3))
    wait_for_prefetch(engine, "blend")
    engine.add_request([11 + i % 150 for i in range(300)], GREEDY, request_id="long")
    drain()
    engine.scheduler.schedule = schedule
    return results, steps


# Triton under the interpreter on one model (the kernels see the same shapes on both tiny
# models: Qwen2's difference, the projections' bias, is torch's); the C++ CPU kernels on the
# other.
@pytest.mark.parametrize("arch, backend", [("llama", "triton"), ("qwen2", "cpu")])
def test_mixed_schedule_matches_torch_backend(arch, backend, request, tmp_path):
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    torch_llm = make_llm(path, "torch", tmp_path / "torch")
    triton_llm = make_llm(path, backend, tmp_path / backend)
    assert triton_llm.engine.attn_backend.name == backend
    expected, steps = run_mixed(torch_llm)
    actual, triton_steps = run_mixed(triton_llm)
    assert triton_steps == steps  # the same schedule on both
    assert actual == expected
    # The schedule really mixed what it claims: one step held a decode, the prefix hit's 3
    # uncached tokens, the whole blended prefill and the long prompt's first chunk.
    mixed = steps[1]
    assert mixed["decode"] == 1 and mixed["hit"] == 3 and mixed["blend"] > 100
    assert 0 < mixed["long"] < 300
    assert sum(1 for s in steps if 1 < s.get("long", 0)) >= 2  # chunked prefill
    torch_llm.close()
    triton_llm.close()


def test_blend_at_ratio_one_is_full_prefill_on_triton(tiny_llama_dir, tmp_path):
    llm = make_llm(tiny_llama_dir, "triton", tmp_path)
    ids = llm.blend_manager().prepare(BLEND, BlendConfig()).prompt.token_ids
    full = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    blended = llm.generate([BLEND], GREEDY, blend=BlendConfig(recompute_ratio=1.0))[0]
    assert blended.outputs[0].token_ids == full
    llm.close()


def test_padded_graph_decode_equals_eager(tiny_llama_dir, tmp_path):
    prompts = [[5 + i, 9, 13 + 2 * i, 17] * (1 + i) for i in range(3)]  # 3 rows -> size 4
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eager = make_llm(tiny_llama_dir, "triton", tmp_path / "a")
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    llm = make_llm(tiny_llama_dir, "triton", tmp_path / "b")
    graphs = with_decode_graphs(llm, 4, EagerCapture())
    runs = []
    run = graphs.run
    graphs.run = lambda ids, md: runs.append(md.num_seqs) or run(ids, md)
    actual = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert actual == expected
    assert graphs.sizes == [1, 2, 4] and 3 in runs  # decode steps of 3 ran padded to 4
    eager.close()
    llm.close()


def test_captured_graphs_keep_the_backend_layouts_they_read(tiny_llama_dir, tmp_path):
    """Replay runs no Python, so the layout built for each captured size (its index tensors) must
    live as long as the graph, not as long as the backend's memo (which later eager steps
    overwrite: on a GPU, replay then read freed memory)."""
    llm = make_llm(tiny_llama_dir, "triton", tmp_path)
    graphs = with_decode_graphs(llm, 4, EagerCapture())
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert set(graphs.retained) == {1, 2, 4}
    for size, layouts in graphs.retained.items():
        decode_rows = [len(p.decode_seq_ids) for p in layouts if hasattr(p, "decode_seq_ids")]
        assert decode_rows == [size]  # the Triton layout of that padded decode batch
    llm.close()


def test_a_failed_capture_falls_back_to_eager(tiny_llama_dir, tmp_path):
    def broken_capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    llm = make_llm(tiny_llama_dir, "triton", tmp_path)
    graphs = with_decode_graphs(llm, 2, broken_capture)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], params)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert "stream is capturing" in graphs.failed
    llm.close()
