"""Piecewise graphs (:mod:`blendkv.engine.piecewise_graphs`): the dense pieces of prefills,
chunked prefills and blended forwards replayed at padded row counts must give, bit for bit,
what the eager forward gives.

On the CPU the capture is the eager stand-in (a "replay" reruns the piece on the static
buffers, padding rows included), on the Triton backend under the interpreter; ``tests/gpu``
replays real CUDA graphs. The pieces also trace whole under ``torch.compile(fullgraph=True)``:
a host read (``.item()``, ``.tolist()``) or anything else that breaks the graph fails it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BLEND_DOCS, BLEND_QUERY, QuietLLM

pytest.importorskip("triton", reason="triton is not installed: the Triton backend cannot run")

from blendkv import SamplingParams  # noqa: E402
from blendkv.blend.config import BlendConfig  # noqa: E402
from blendkv.engine.cuda_graphs import EagerCapture  # noqa: E402
from blendkv.engine.piecewise_graphs import PiecewiseGraphs, piece_sizes  # noqa: E402
from blendkv.layers.cpu_platform import small_batch_gemms  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
BLEND = {"documents": BLEND_DOCS, "query": BLEND_QUERY}


def make_llm(path, store, backend="triton"):
    return QuietLLM(
        str(path),
        dtype="float32",
        block_size=4,
        device="cpu",
        attention_backend=backend,
        max_num_batched_tokens=96,
        kv_store_dir=str(store),
    )


def with_pieces(llm, max_rows: int, capture) -> PiecewiseGraphs:
    """Give the engine piecewise graphs on the CPU (the engine makes them only on CUDA)."""
    graphs = PiecewiseGraphs("cpu", max_rows=max_rows, capture=capture)
    llm.engine.runner.piece_graphs = graphs
    return graphs


def run_all(llm) -> list:
    """Tokens and prompt logits of a short prompt, a chunked one (three steps of at most 96
    rows, the first shared with the short one) and a blend with the default config (ProphetKV:
    two passes) and another selection."""
    short = [5 + (i * 7) % 300 for i in range(37)]
    long = [11 + i % 150 for i in range(170)]
    outs = llm.generate([short, long], GREEDY, logits_from=30)
    n = len(llm.blend_manager().prepare(BLEND, BlendConfig()).prompt.token_ids)
    outs += llm.generate([BLEND], GREEDY, blend=BlendConfig(), logits_from=n - 3)
    outs += llm.generate([BLEND], GREEDY, blend=BlendConfig(selection="v_deviation"))
    return [(o.outputs[0].token_ids, o.extra.get("prompt_logits")) for o in outs]


def test_replayed_pieces_equal_eager_bit_for_bit(tiny_llama_2l_dir, tmp_path):
    eager = make_llm(tiny_llama_2l_dir, tmp_path / "eager")
    expected = run_all(eager)
    eager.close()
    llm = make_llm(tiny_llama_2l_dir, tmp_path / "pieces")
    graphs = with_pieces(llm, 256, EagerCapture())
    sizes, in_place = [], []
    run = graphs.run

    def recorded(key, fn, inputs):
        sizes.append(inputs[0].shape[0])
        heads = graphs._buffers.get("heads")
        if key[0] != "first" and heads is not None:  # attention wrote into the piece's buffer
            in_place.append(inputs[0].data_ptr() == heads.data_ptr())
        return run(key, fn, inputs)

    graphs.run = recorded
    actual = run_all(llm)
    for (tokens, logits), (want_tokens, want_logits) in zip(actual, expected, strict=True):
        assert tokens == want_tokens
        assert (logits is None) == (want_logits is None)
        if logits is not None:
            assert torch.equal(logits, want_logits)
    # Every kind of step replayed, most at padded sizes; nothing ran past the largest size.
    assert graphs.failed is None and graphs.eager_runs == 0
    assert graphs.replays == len(sizes) > 0
    assert any(n not in graphs.sizes for n in sizes)
    assert 96 in sizes  # a full chunk of the long prompt
    assert min(sizes) < 40  # decode rows and ProphetKV's query pass
    assert len(in_place) > 20 and all(in_place)  # no copy of attention's output
    llm.close()


def test_rows_above_the_largest_size_and_failed_captures_run_eagerly(tiny_llama_dir, tmp_path):
    prompt = [5 + (i * 7) % 300 for i in range(37)]
    eager = make_llm(tiny_llama_dir, tmp_path / "eager", backend="torch")
    expected = eager.generate([prompt], GREEDY)[0].outputs[0].token_ids
    eager.close()

    llm = make_llm(tiny_llama_dir, tmp_path / "small", backend="torch")
    graphs = with_pieces(llm, 8, EagerCapture())
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
    assert graphs.eager_runs > 0 and graphs.replays > 0  # the prefill eager, decodes replayed
    llm.close()

    def broken_capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    llm = make_llm(tiny_llama_dir, tmp_path / "broken", backend="torch")
    graphs = with_pieces(llm, 64, broken_capture)
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
    assert "stream is capturing" in graphs.failed and graphs.num_graphs == 0
    llm.close()


def test_piece_sizes():
    sizes = piece_sizes(2048)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 2048
    assert sizes == sorted(set(sizes))
    # padding wastes at most an eighth of a piece's rows above 64
    assert all((b - a) / a <= 0.125 for a, b in zip(sizes, sizes[1:], strict=False) if a >= 64)
    assert piece_sizes(100)[-1] == 100
    with pytest.raises(ValueError, match="max_rows"):
        piece_sizes(0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pieces_compile_whole(arch, request, tmp_path):
    """Every dense piece traces as one graph (``fullgraph=True``: a graph break, such as a host
    read of a device value, raises) and computes what it computes eagerly."""
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    llm = make_llm(path, tmp_path, backend="torch")
    model = llm.engine.model.model
    for gemm in small_batch_gemms(model):  # the CPU's packed weights: F.linear, as on a GPU
        gemm.enable(0)
    torch.manual_seed(0)
    n, hidden = 5, model.embed_tokens.embedding_dim
    attn = model.layers[0].self_attn
    heads = torch.randn(n, attn.num_heads * attn.head_dim)
    residual = torch.randn(n, hidden)
    ids = torch.randint(0, model.embed_tokens.num_embeddings, (n,))
    pieces = [
        (model._first, (ids,)),
        (lambda h, r: model._link(1, h, r), (heads, residual)),
        (model._last, (heads, residual)),
    ]
    with torch.inference_mode():
        for fn, inputs in pieces:
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, backend="eager", dynamic=False)
            for got, want in zip(compiled(*inputs), fn(*inputs), strict=True):
                assert torch.equal(got, want)
    llm.close()
