"""ProphetKV's query pass replayed whole (:mod:`blendkv.engine.query_pass_graphs`): the scores,
the rows picked from them and the answer must be what the eager pass gives, at every padded
size and after other requests went through the same static buffers.

On the CPU the capture is the eager stand-in (a "replay" reruns the pass on the static buffers,
padding rows included), on the Triton backend under the interpreter; ``tests/gpu`` replays a
real CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BLEND_DOCS, BLEND_QUERY, QuietLLM

pytest.importorskip("triton", reason="triton is not installed: the Triton backend cannot run")

from blendkv import SamplingParams  # noqa: E402
from blendkv.blend.config import BlendConfig  # noqa: E402
from blendkv.connector.blend_connector import BlendConnector  # noqa: E402
from blendkv.engine.cuda_graphs import EagerCapture  # noqa: E402
from blendkv.engine.model_runner import ModelRunner  # noqa: E402
from blendkv.engine.query_pass_graphs import QueryPassGraphs, pass_sizes  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # a decode after the pass
# One sentence a document: the interpreter's time grows with the rows and keys (the pass's
# padded sizes come from the template and the query).
DOCS = [doc.split(".")[0] + "." for doc in BLEND_DOCS]
PROMPTS = [
    {"documents": DOCS, "query": BLEND_QUERY},  # a short query: the pass pads to 32
    {
        "documents": DOCS[::-1],
        "query": "Name the river that flows through the capital of France, and the country "
        "whose capital has many museums and parks, please, in one short sentence.",
    },  # a long one: 64
    {"documents": DOCS, "query": BLEND_QUERY},  # the first again, after the second
]


def make_llm(path, store, backend="triton"):
    return QuietLLM(
        str(path),
        dtype="float32",
        block_size=4,
        device="cpu",
        attention_backend=backend,
        kv_store_dir=str(store),
        enable_prefix_caching=False,  # the third prompt is the first again: a pass again
        # A replay's kernels run over every key block of max_model_len (past the request's
        # keys they do nothing): in the interpreter each such program still costs its time.
        max_model_len=256,
    )


def with_query_graphs(llm, capture) -> QueryPassGraphs:
    """Give the engine the query pass's graphs on the CPU, made as the engine makes them on
    CUDA (the runner's ``make_query_graphs``)."""
    runner = llm.engine.runner
    graphs = runner.make_query_graphs(llm.engine.info.max_model_len, 2048)
    assert isinstance(graphs, QueryPassGraphs) and graphs.sizes[-1] == 256
    graphs.capture = capture
    runner.query_graphs = graphs
    return graphs


def run_all(llm, monkeypatch, prompts=PROMPTS):
    """Per prompt: the query pass's scores, the rows the blend recomputed, the tokens."""
    scores = []
    original = ModelRunner._run_query_pass

    def recorded(self, query_pass):
        original(self, query_pass)
        blends = query_pass.row_plan.blends
        scores.extend(sb.query_scores.clone() for sb in blends if sb.query_scores is not None)

    monkeypatch.setattr(ModelRunner, "_run_query_pass", recorded)
    out = []
    for prompt in prompts:
        (result,) = llm.generate([prompt], GREEDY, blend=BlendConfig(recompute_ratio=0.3))
        stats = result.blend_stats
        out.append((scores[-1], stats.tokens_recomputed, result.outputs[0].token_ids))
    return out


def test_replayed_pass_equals_the_eager_pass(tiny_llama_2l_dir, tmp_path, monkeypatch):
    eager = make_llm(tiny_llama_2l_dir, tmp_path / "eager")
    expected = run_all(eager, monkeypatch)
    eager.close()
    llm = make_llm(tiny_llama_2l_dir, tmp_path / "graphs")
    graphs = with_query_graphs(llm, EagerCapture())
    actual = run_all(llm, monkeypatch)
    for (scores, recomputed, tokens), (want, want_recomputed, want_tokens) in zip(
        actual, expected, strict=True
    ):
        assert scores.shape == want.shape and want.sum() > 0
        torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5)
        assert recomputed == want_recomputed
        assert tokens == want_tokens
    assert graphs.failed is None
    assert graphs.replays == 3 and graphs.num_graphs == 2  # two sizes; the third replayed
    llm.close()


def test_the_captured_pass_never_waits_for_the_device(tiny_llama_2l_dir, tmp_path):
    """A replay reads nothing back to the host (a CUDA capture would fail on it; the eager
    stand-in would hide it): every op of the pass counted, as on a GPU."""
    from blendkv.eval.bench.launches import count, device_tensors

    llm = make_llm(tiny_llama_2l_dir, tmp_path / "syncs")
    graphs = with_query_graphs(llm, EagerCapture())
    llm.generate([PROMPTS[0]], GREEDY, blend=BlendConfig(recompute_ratio=0.3))
    (replay,) = graphs._graphs.values()
    rows = count(lambda: replay(lambda segment: None), device_tensors(llm))
    assert rows["host_syncs"] == 0, rows["syncs_at"]
    assert rows["triton"]["_mass_kernel"] == len(llm.engine.runner.model.model.layers)
    llm.close()


def test_each_segment_replays_once_its_layers_are_loaded(tiny_llama_dir, tmp_path, monkeypatch):
    """The replayed pass overlaps the loading: a segment (one loading stage's layers) waits for
    its own layers' K/V only, and every layer runs after its wait. Fails if the replay waits
    for every layer first (what a single graph had to do) or skips a wait."""
    from blendkv.engine import query_pass_graphs as qpg
    from blendkv.engine.kv_connector import load_stages

    log = []
    connector_cls = BlendConnector
    original_wait = connector_cls.wait_for_layer_load

    def wait(self, layer_idx):
        log.append(("wait", layer_idx))
        original_wait(self, layer_idx)

    def scored(self, layer_idx, *args):
        log.append(("layer", layer_idx))

    monkeypatch.setattr(connector_cls, "wait_for_layer_load", wait)
    monkeypatch.setattr(qpg._StaticScores, "after_attention", scored)
    monkeypatch.setattr(qpg._StaticScores, "select", lambda self, i, *a: scored(self, i))
    llm = make_llm(tiny_llama_dir, tmp_path / "segments")
    graphs = with_query_graphs(llm, EagerCapture())
    llm.generate([PROMPTS[0]], GREEDY, blend=BlendConfig(recompute_ratio=0.3))  # captures
    log.clear()
    llm.generate([PROMPTS[0]], GREEDY, blend=BlendConfig(recompute_ratio=0.3))  # replays
    assert graphs.replays == 2
    num_layers = len(llm.engine.runner.model.model.layers)
    stages = load_stages(num_layers)
    assert len(stages) == len(graphs.stages) >= 2
    # the replayed pass: up to the fused forward's first wait (layer 0 again)
    end = next(i for i, e in enumerate(log) if e == ("wait", 0) and i > 0)
    passed = log[:end]
    assert [e for e in passed if e[0] == "layer"] == [("layer", i) for i in range(num_layers)]
    for lo, hi in stages:
        first = passed.index(("layer", lo))
        waited = {i for kind, i in passed[:first] if kind == "wait"}
        assert waited == set(range(hi)), (lo, passed)  # its stage loaded, no later one
    llm.close()


def test_what_the_graph_reads_outlives_the_capture(tiny_llama_2l_dir, tmp_path, monkeypatch):
    """A CUDA graph holds its memory pool, not the Python objects its kernels read: the
    metadata a size was captured over must stay alive after the capture (its freed memory,
    reused, made an H200 replay read garbage and crash)."""
    import gc
    import weakref

    made = []
    original = QueryPassGraphs._metadata

    def recorded(self, size):
        md = original(self, size)
        made.append(weakref.ref(md))
        return md

    class ForgetfulCapture:  # like a real graph: nothing of ``fn`` is kept
        def segments(self, fn):
            fn(lambda: None)
            return lambda before: None

    monkeypatch.setattr(QueryPassGraphs, "_metadata", recorded)
    llm = make_llm(tiny_llama_2l_dir, tmp_path / "alive")
    graphs = with_query_graphs(llm, ForgetfulCapture())
    llm.generate([PROMPTS[0]], GREEDY, blend=BlendConfig(recompute_ratio=0.3))
    for n in (5, 9, 13, 17):  # steps enough to push it out of the backend's memo of layouts
        llm.generate([list(range(3, 3 + n))], GREEDY)
    gc.collect()
    assert graphs.num_graphs == 1 and len(made) == 1
    assert made[0]() is not None
    graphs.retained.clear()
    gc.collect()
    assert made[0]() is None  # the check above can fail: nothing else holds it
    llm.close()


def test_a_failed_capture_runs_the_pass_eagerly(tiny_llama_2l_dir, tmp_path, monkeypatch, caplog):
    class BrokenCapture:
        def segments(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    llm = make_llm(tiny_llama_2l_dir, tmp_path / "broken")
    graphs = with_query_graphs(llm, BrokenCapture())
    with caplog.at_level("WARNING"):  # the second request does not try again
        first, _ = run_all(llm, monkeypatch, PROMPTS[:1] * 2)
    assert first[0].sum() > 0  # scored eagerly
    assert "stream is capturing" in graphs.failed and graphs.num_graphs == 0
    assert caplog.text.count("query pass CUDA graph capture failed") == 1
    llm.close()


def test_backends_not_scoring_from_lse_never_replay(tiny_llama_dir, tmp_path, monkeypatch):
    llm = make_llm(tiny_llama_dir, tmp_path / "torch", backend="torch")
    runner = llm.engine.runner
    assert runner.make_query_graphs(512, 2048) is None
    runner.query_graphs = graphs = QueryPassGraphs(
        runner.model, runner.attn_backend, runner.kv_caches, 4, 512, capture=EagerCapture()
    )
    run_all(llm, monkeypatch)
    assert graphs.replays == 0 and graphs.num_graphs == 0
    llm.close()


def test_pass_sizes():
    assert pass_sizes(256)[0] == 8 and pass_sizes(256)[-1] == 256
    assert pass_sizes(40) == [8, 16, 32, 40]
    with pytest.raises(ValueError):
        pass_sizes(0)
