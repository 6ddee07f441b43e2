"""``EngineConfig.prune_last_layer``: the last layer attends and runs its MLP only for the rows a
step reads, and still writes every row's K/V.

Oracle: the same engine with pruning off. The KV pool must hold the same bits afterwards (the
rows skipped at the last layer wrote their K/V all the same), sampled tokens and returned
logits must match, and the last layer's MLP must really have seen fewer rows.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import BLEND_DOCS, BLEND_QUERY, QuietLLM

from blendkv import LLM, SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.models.hooks import output_keep, output_row_order

ONE = SamplingParams(temperature=0.0, max_tokens=1)


def _prompts(n=4, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 320) for _ in range(length)] for length in (40, 7, 64, 23)[:n]]


def _engine(path, prune: bool, **kwargs) -> LLM:
    llm = QuietLLM(str(path), dtype="float32", block_size=4, prune_last_layer=prune, **kwargs)
    for cache in llm.engine.runner.kv_caches:
        cache.zero_()  # unused slots compare equal too
    return llm


def _count_last_mlp_rows(llm) -> list[int]:
    """Rows each call of the last layer's MLP gets (recorded into the returned list)."""
    seen: list[int] = []
    mlp = llm.engine.model.model.layers[-1].mlp
    mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("setup", [{}, {"max_num_batched_tokens": 16}])
def test_pruned_last_layer_writes_the_same_kv_and_samples_the_same(request, arch, setup):
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = _prompts()
    outs, pools, rows = {}, {}, {}
    for prune in (False, True):
        llm = _engine(path, prune, enable_prefix_caching=False, **setup)
        rows[prune] = _count_last_mlp_rows(llm)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        outs[prune] = llm.generate(prompts, params)
        pools[prune] = [c.clone() for c in llm.engine.runner.kv_caches]
    for off, on in zip(outs[False], outs[True], strict=True):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
    for off, on in zip(pools[False], pools[True], strict=True):
        assert torch.equal(on, off)
    # Unpruned, the prefill steps put every prompt row through the last MLP; pruned, a prefill
    # step puts through it only its sampled rows (and decode rows).
    assert sum(rows[False]) > sum(rows[True])
    assert max(rows[True]) <= len(prompts)


def test_prompt_logits_rows_survive_the_pruning(tiny_llama_dir):
    """Rows of requested prompt logits run the whole last layer: their logits equal the
    unpruned engine's, next to a request that asks for none."""
    prompts = _prompts(2)
    got = {}
    for prune in (False, True):
        llm = _engine(tiny_llama_dir, prune, enable_prefix_caching=False)
        got[prune] = [
            llm.generate([prompts[0]], ONE, logits_from=25)[0].extra["prompt_logits"],
            llm.generate(prompts, ONE)[1].outputs[0].token_ids,
        ]
    assert got[True][0].shape == (len(prompts[0]) - 25, got[False][0].shape[1])
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
    assert got[True][1] == got[False][1]


@pytest.mark.parametrize("selection", ["prophet", "v_deviation"])
def test_blend_prunes_after_its_correction(tiny_llama_dir, tmp_path, selection):
    """A blended prefill: the last layer's K correction still sees the recomputed rows (the
    pool holds the same bits), and only the rows read (the last 4: prompt logits) run the last
    MLP."""
    prompt = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
    blend = BlendConfig(selection=selection, recompute_ratio=0.3)
    logits, pools, rows = {}, {}, {}
    for prune in (False, True):
        llm = _engine(
            tiny_llama_dir,
            prune,
            enable_prefix_caching=False,
            kv_store_dir=str(tmp_path / f"store{int(prune)}"),
        )
        llm.generate([prompt], ONE, blend=blend)  # computes and stores the chunks
        llm.blend_manager().flush()
        for cache in llm.engine.runner.kv_caches:
            cache.zero_()
        rows[prune] = _count_last_mlp_rows(llm)
        n = len(llm.blend_manager().prepare(prompt, blend).prompt.token_ids)
        out = llm.generate([prompt], ONE, blend=blend, logits_from=n - 4)[0]
        assert out.blend_stats.chunks_hit == out.blend_stats.num_chunks
        logits[prune] = out.extra["prompt_logits"]
        pools[prune] = [c.clone() for c in llm.engine.runner.kv_caches]
    for off, on in zip(pools[False], pools[True], strict=True):
        assert torch.equal(on, off)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
    # (ProphetKV's query pass runs first, its own rows through every layer)
    assert rows[True][-1] == 4 and rows[False][-1] > 4


def test_output_rows_helpers_follow_the_row_plan():
    class Plan:
        rows = torch.tensor([0, 3, 5, 9])

    outputs = torch.tensor([5, 9])
    keep, idx = output_keep(None, outputs, 10)
    assert keep.tolist() == [i in (5, 9) for i in range(10)] and idx.tolist() == [5, 9]
    keep, idx = output_keep(Plan(), torch.tensor([1, 5, 9]), 4)  # row 1 not computed
    assert keep.tolist() == [False, False, True, True] and idx.tolist() == [2, 3]
    assert output_keep(Plan(), torch.tensor([0, 3, 5, 9]), 4) is None
    assert output_row_order(Plan(), outputs, 10).tolist() == [5, 9]
    assert output_row_order(Plan(), None, 10).tolist() == [0, 3, 5, 9]
    assert output_row_order(None, outputs, 10).tolist() == [5, 9]
