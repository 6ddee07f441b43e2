"""Fusion strategies beyond CacheBlend's V deviation, on a 6-layer random model:
ratio 1.0 is full prefill, ratio 0 is reuse, the picked rows are the ones each definition
names, budgets hold, and requests with different strategies batched in one step equal each
run alone."""

from __future__ import annotations

import time

import pytest
import torch
import transformers
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import QuietLLM, make_tiny_model_dir, standalone_chunk_kv
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.blend.correction import chunk_mean_shift
from blendkv.blend.selection import query_attention_mass
from blendkv.connector.blend_connector import BlendConnector
from blendkv.errors import ConfigError
from blendkv.eval.methods import MethodError, parse_method

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1)
PROMPT = {"documents": DOCS, "query": QUERY}
NUM_LAYERS = 6

STRATEGIES = {
    "default": dict(),  # V deviation with the K correction
    "cacheblend": dict(correction="none"),
    "prophet": dict(selection="prophet", correction="none"),
    "heads": dict(selection="heads"),
    "chunk_heads": dict(chunk_head_tokens=3),
    "correct_v": dict(correction="v"),
    "correct_kv": dict(correction="kv", correction_shrink=0.0),
    "reselect": dict(reselect=2, correction="kv"),
    "prophet_all": dict(selection="prophet", correction="k", chunk_head_tokens=2),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny6"), "llama", num_hidden_layers=NUM_LAYERS
    )


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = QuietLLM(str(model_dir), dtype="float32", block_size=4, enable_prefix_caching=False)
    yield llm
    llm.close()


@pytest.fixture
def plans(monkeypatch):
    """Every blended row plan the engine builds (``plan.rows``: rows computed to the end)."""
    built = []
    original = BlendConnector.row_plan

    def capture(self, inputs):
        plan = original(self, inputs)
        if plan is not None:
            built.append(plan)
        return plan

    monkeypatch.setattr(BlendConnector, "row_plan", capture)
    return built


def prompt_logits(llm, prompt, config):
    state = llm.blend_manager().prepare(prompt, config)
    start = state.prompt.query_start
    out = llm.generate([prompt], GREEDY, blend=config, logits_from=start)[0]
    return out, state.prompt


def picked_positions(plan) -> set[int]:
    """Reused positions recomputed to the last layer (one request from position 0)."""
    sb = plan.blends[0]
    return {int(r) for r in plan.rows if r < len(sb.reused) and sb.reused[r]}


@pytest.mark.parametrize("name", STRATEGIES)
def test_ratio_one_equals_full_prefill(llm, name):
    out, prompt = prompt_logits(llm, PROMPT, BlendConfig(recompute_ratio=1.0, **STRATEGIES[name]))
    start = prompt.query_start
    full = llm.generate([prompt.token_ids], GREEDY, logits_from=start)[0]
    torch.testing.assert_close(
        out.extra["prompt_logits"], full.extra["prompt_logits"], atol=1e-5, rtol=0
    )
    assert out.blend_stats.recompute_fraction == 1.0


@pytest.mark.parametrize("name", STRATEGIES)
def test_ratio_zero_equals_reuse(llm, name):
    out, _ = prompt_logits(llm, PROMPT, BlendConfig(recompute_ratio=0.0, **STRATEGIES[name]))
    reuse, _ = prompt_logits(llm, PROMPT, BlendConfig(recompute_ratio=0.0))
    torch.testing.assert_close(
        out.extra["prompt_logits"], reuse.extra["prompt_logits"], atol=0, rtol=0
    )
    assert out.blend_stats.reused_tokens_recomputed == 0
    # and ratio 0.3 is neither (the two checks above could fail)
    mid, _ = prompt_logits(llm, PROMPT, BlendConfig(recompute_ratio=0.3, **STRATEGIES[name]))
    assert not torch.equal(mid.extra["prompt_logits"], reuse.extra["prompt_logits"])


@pytest.mark.parametrize("name", STRATEGIES)
def test_budget_respected(llm, name, plans):
    ratio = 0.3
    config = BlendConfig(recompute_ratio=ratio, **STRATEGIES[name])
    out, _ = prompt_logits(llm, PROMPT, config)
    stats = out.blend_stats
    final_ratio = min(config.selection_layers(NUM_LAYERS).values())
    assert stats.reused_tokens_recomputed == round(final_ratio * stats.tokens_reused)
    # The mean share of reused rows computed over the partial layers stays within the ratio.
    sb = plans[-1].blends[0]
    others = len(sb.reused) - sb.total_reused
    per_layer = [0.0] * NUM_LAYERS
    for layer, _, kept, _ in sb._events:
        per_layer[layer:] = [(kept - others) / sb.total_reused] * (NUM_LAYERS - layer)
    first = config.first_selection_layer
    assert sum(per_layer[first:]) / (NUM_LAYERS - first) <= ratio + 1 / sb.total_reused
    assert 0 < stats.compute_fraction < 1


def test_cost_counts_selection(llm, plans):
    """V deviation: layer 0 in full, Q/K/V of every row at the check layer, then the picked
    rows; prophet: its query pass, then the picked rows from layer 0 on (it picks before the
    projections: the dropped rows never run them, nor do the rows before the first chunk,
    which the query pass computed exactly)."""
    for selection in ("v_deviation", "prophet"):
        out, _ = prompt_logits(llm, PROMPT, BlendConfig(recompute_ratio=0.3, selection=selection))
        plan = plans[-1]
        n = len(plan.blends[0].reused)
        others = n - plan.blends[0].total_reused
        kept = out.blend_stats.tokens_recomputed
        share = plan.qkv_share
        assert 0 < share < 0.5
        if selection == "v_deviation":
            expected = n + kept + (n - kept) * share + kept * (NUM_LAYERS - 2)
        else:
            lead = llm.blend_manager().prepare(PROMPT, BlendConfig()).prompt.chunk_starts[0]
            assert lead > 0
            expected = others * NUM_LAYERS + (kept - lead) * NUM_LAYERS
        assert out.blend_stats.row_layers == pytest.approx(expected)
        assert out.blend_stats.full_row_layers == n * NUM_LAYERS


def test_heads_are_the_first_tokens_of_every_chunk(llm, plans):
    k = 2
    prompt = llm.blend_manager().prepare(PROMPT, BlendConfig()).prompt
    spans = prompt.chunk_spans
    ratio = k * len(spans) / prompt.num_chunk_tokens
    # skip_exact off: the first chunk (stored behind the prompt's own prefix) has heads too
    heads = BlendConfig(recompute_ratio=ratio, selection="heads", skip_exact=False)
    llm.generate([PROMPT], GREEDY, blend=heads)
    expected = {p for s, _ in spans for p in range(s, s + k)}
    assert picked_positions(plans[-1]) == expected
    assert all(s > 0 for s, _ in spans)  # absolute positions: the template comes first


def test_chunk_heads_are_forced_into_the_budget(llm, plans):
    config = BlendConfig(recompute_ratio=0.3, chunk_head_tokens=3, skip_exact=False)
    out = llm.generate([PROMPT], GREEDY, blend=config)[0]
    spans = llm.blend_manager().prepare(PROMPT, config).prompt.chunk_spans
    picked = picked_positions(plans[-1])
    assert {p for s, _ in spans for p in range(s, s + 3)} <= picked
    assert len(picked) == round(0.3 * out.blend_stats.tokens_reused)
    plain = BlendConfig(recompute_ratio=0.3, skip_exact=False)
    plain = llm.generate([PROMPT], GREEDY, blend=plain)[0]
    assert picked != picked_positions(plans[-1])  # without heads the pick differs
    assert plain.blend_stats.reused_tokens_recomputed == len(picked)


def test_chunk_samples_are_spread_over_every_chunk(llm, plans):
    n = 2
    config = BlendConfig(recompute_ratio=0.2, chunk_samples=n)
    out = llm.generate([PROMPT], GREEDY, blend=config)[0]
    prompt = llm.blend_manager().prepare(PROMPT, config).prompt
    picked = picked_positions(plans[-1])
    first, *others = prompt.chunk_spans  # the first chunk is exact: never picked
    assert not picked & set(range(*first))
    for s, e in others:
        assert {s + (2 * i + 1) * (e - s) // (2 * n) for i in range(n)} <= picked
    assert len(picked) == round(0.2 * out.blend_stats.tokens_reused)
    plain = llm.generate([PROMPT], GREEDY, blend=BlendConfig(recompute_ratio=0.2))[0]
    assert picked != picked_positions(plans[-1])  # without samples the pick differs
    assert plain.blend_stats.reused_tokens_recomputed == len(picked)


def test_query_attention_mass_finds_the_obvious_token():
    torch.manual_seed(0)
    k = torch.randn(10, 1, 8) * 0.1
    q = torch.randn(3, 2, 8)
    k[4, 0] = q[:, 0].mean(0) * 20 + q[:, 1].mean(0) * 20  # every query row looks at key 4
    mass = query_attention_mass(q, k, torch.tensor([7, 8, 9]), torch.arange(10))
    assert int(mass.argmax()) == 4
    assert mass.sum().item() == pytest.approx(6.0)  # 3 rows x 2 heads, each summing to 1
    # causality: a key after every query row gets nothing
    late = query_attention_mass(q, k, torch.tensor([2, 3, 3]), torch.arange(10))
    assert late[4:].sum() == 0


def reuse_attention_reference(model_dir, manager, prompt):
    """transformers (eager): prefix in full, each chunk's standalone K/V at its fused positions
    appended to the cache, then the query rows; their attention summed over layers, heads and
    rows, per position."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = prompt.token_ids
    cache = DynamicCache()
    with torch.no_grad():
        hf(torch.tensor([ids[: prompt.prefix_len]]), past_key_values=cache, use_cache=True)
        for chunk, (s, e) in zip(prompt.chunks, prompt.chunk_spans, strict=True):
            kv = standalone_chunk_kv(hf, manager.anchor_ids, chunk)
            cos, sin = hf.model.rotary_emb(torch.zeros(1, e - s, 1), torch.arange(s, e)[None])
            for layer, (k, v) in enumerate(kv):
                k4 = k.transpose(0, 1)[None]
                k4, _ = apply_rotary_pos_emb(k4, k4, cos, sin)
                cache.update(k4, v.transpose(0, 1)[None], layer)
        rest = torch.tensor([ids[prompt.query_start :]])
        pos = torch.arange(prompt.query_start, len(ids))[None]
        out = hf(rest, past_key_values=cache, position_ids=pos, output_attentions=True)
    return sum(a[0].sum(dim=(0, 1)) for a in out.attentions)  # [len(ids)]


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_prophet_scores_are_the_query_attention_over_reused_kv(llm, model_dir, plans, backend):
    """The CPU backend scores inside its attention; Triton's kernels score each layer after
    attention wrote the rows' K/V, and the last layer (no attention) before it."""
    if backend == "triton":
        llm = QuietLLM(
            str(model_dir),
            dtype="float32",
            block_size=4,
            enable_prefix_caching=False,
            attention_backend="triton",
        )
    config = BlendConfig(recompute_ratio=0.25, selection="prophet")
    # one token: the scores and the pick are the prefill's (decode steps add nothing here)
    out = llm.generate([PROMPT], ONE, blend=config)[0]
    manager = llm.blend_manager()
    prompt = manager.prepare(PROMPT, config).prompt
    ref = reuse_attention_reference(model_dir, manager, prompt)
    sb = plans[-1].blends[0]
    torch.testing.assert_close(sb.query_scores, ref.float(), atol=1e-4, rtol=1e-4)
    # the first chunk is stored behind the prompt's own prefix: exact, never picked
    first, end = prompt.chunk_spans[0]
    assert torch.nonzero(sb.exact).flatten().tolist() == list(range(first, end))
    reused = torch.nonzero(sb.reused & ~sb.exact).flatten()
    top = reused[ref[reused].topk(out.blend_stats.reused_tokens_recomputed).indices]
    assert picked_positions(plans[-1]) == set(top.tolist())
    if backend == "triton":
        llm.close()


def fused_kv(llm, prompts_and_configs):
    """Run the requests' fused prefills in ONE engine step; their K/V read back per layer.
    Their chunks are stored first (a missed chunk is computed in a step of its own) and read
    before the step (the scheduler admits a request whose reads are under way only alone)."""
    engine, manager = llm.engine, llm.blend_manager()
    for prompt, config in prompts_and_configs:
        state = manager.prepare(prompt, config)
        llm.precompute_chunks(state.prompt.chunks, contexts=state.chunk_contexts)
    seqs = []
    for prompt, config in prompts_and_configs:
        params = SamplingParams(temperature=0, max_tokens=2)
        rid = engine.add_request(prompt, params, blend=config)
        seqs.append((rid, engine.requests[rid].seq))
    deadline = time.monotonic() + 60
    while not all(engine.scheduler.connector.kv_ready(seq) for _, seq in seqs):
        assert time.monotonic() < deadline, "the chunk reads never finished"
        time.sleep(0.01)
    engine.step()
    bs = engine.config.cache.block_size
    out = []
    for rid, seq in seqs:
        n = seq.num_prompt_tokens
        assert seq.num_computed_tokens >= n  # its prefill ran in that step
        table = torch.tensor(seq.block_table)
        slots = table[torch.arange(n) // bs] * bs + torch.arange(n) % bs
        out.append(
            torch.stack([c.view(2, -1, *c.shape[-2:])[:, slots] for c in engine.runner.kv_caches])
        )
        engine.abort_request(rid)
    return out


def test_batched_strategies_equal_each_alone(llm):
    other = {"documents": DOCS[::-1], "query": "Tell me about dogs and foxes, please."}
    requests = [
        (PROMPT, BlendConfig(recompute_ratio=0.3, selection="prophet", correction="kv")),
        (other, BlendConfig(recompute_ratio=0.3, reselect=2, chunk_head_tokens=2)),
        (PROMPT, BlendConfig(recompute_ratio=0.2, selection="heads", correction="v")),
    ]
    together = fused_kv(llm, requests)
    for (prompt, config), kv in zip(requests, together, strict=True):
        [alone] = fused_kv(llm, [(prompt, config)])
        torch.testing.assert_close(kv, alone, atol=1e-5, rtol=1e-5)


def test_correction_makes_the_check_layer_exact(llm):
    """Layer 0 runs in full, so every row's fresh K/V at the check layer is full prefill's;
    with a correction the rows not picked keep it there instead of the reused K/V."""
    prompt = llm.blend_manager().prepare(PROMPT, BlendConfig()).prompt
    [ref] = fused_kv(llm, [(PROMPT, BlendConfig(recompute_ratio=1.0))])
    vdev = dict(recompute_ratio=0.2, selection="v_deviation")  # a check layer after layer 0
    [corrected] = fused_kv(llm, [(PROMPT, BlendConfig(**vdev, correction="v"))])
    [plain] = fused_kv(llm, [(PROMPT, BlendConfig(**vdev, correction="none"))])
    end = prompt.query_start
    torch.testing.assert_close(corrected[1, :, :end], ref[1, :, :end], atol=1e-5, rtol=0)
    assert (plain[1, :, :end] - ref[1, :, :end]).abs().max() > 1e-3
    # deeper layers: the kept rows' V moved by the mean shift
    assert not torch.equal(corrected[3, 1, :end], plain[3, 1, :end])


def test_chunk_mean_shift_and_shrinkage():
    delta = torch.tensor([1.0, 3.0, 10.0]).view(3, 1, 1).expand(3, 2, 2)
    chunks = torch.tensor([0, 0, 2])
    for pooled in (False, True):  # no shrinkage: the prior does not matter
        exact = chunk_mean_shift(delta, chunks, 3, shrink=0.0, pooled=pooled)
        assert exact[0].eq(2.0).all() and exact[1].eq(0.0).all() and exact[2].eq(10.0).all()
    shrunk = chunk_mean_shift(delta, chunks, 3, shrink=2.0, pooled=False)  # n / (n + 2)
    assert shrunk[0].eq(1.0).all() and shrunk[1].eq(0.0).all()
    torch.testing.assert_close(shrunk[2], torch.full((2, 2), 10.0 / 3))
    # towards the three rows' sum shrunk the same way, 14 / (3 + 2): (sum + 2 * 14 / 5) / (n + 2)
    pooled = chunk_mean_shift(delta, chunks, 3, shrink=2.0, pooled=True)
    for c, (total, n) in enumerate([(4.0, 2), (0.0, 0), (10.0, 1)]):
        want = torch.full((2, 2), (total + 2 * 14 / 5) / (n + 2))
        torch.testing.assert_close(pooled[c], want)
    assert chunk_mean_shift(delta[:0], chunks[:0], 3, 2.0, pooled=True).eq(0.0).all()


def test_chunk_sums_one_hot_path_equals_the_cpu_path():
    """The CUDA path (one-hot matmul: deterministic, no host sync) and the CPU path
    (index_add_, bincount) give the same per-chunk sums and counts, unsorted ids included."""
    from blendkv.blend.correction import _sums_index_add, _sums_one_hot

    g = torch.Generator().manual_seed(0)
    delta = torch.randn(9, 2, 4, generator=g)
    chunks = torch.tensor([3, 0, 0, 1, 3, 3, 1, 0, 3])
    sums, counts = _sums_index_add(delta, chunks, 5)
    sums1, counts1 = _sums_one_hot(delta, chunks, 5)
    torch.testing.assert_close(sums1, sums)
    assert torch.equal(counts1, counts) and counts.tolist() == [3, 2, 0, 4, 0]


def test_unrotate_inverts_rotate(llm):
    rotary = llm.engine.runner.model.model.rotary_emb
    x = torch.randn(5, 2, rotary.head_dim)
    pos = torch.tensor([0, 3, 17, 100, 511])
    torch.testing.assert_close(rotary.unrotate_k(pos, rotary.rotate_k(pos, x)), x)


def test_config_validation_and_cache_key():
    for bad in (
        dict(correction="q"),
        dict(correction_shrink=-1.0),
        dict(chunk_head_tokens=-2),
        dict(reselect=3),
        dict(reselect=1, schedule=((5, 0.1),)),
        dict(selection="oracle"),
        dict(correction_prior="chunk"),
    ):
        with pytest.raises(ConfigError):
            BlendConfig(**bad)
    cacheblend = dict(recompute_ratio=0.15, selection="v_deviation", correction="none")
    base = BlendConfig(**cacheblend)
    assert base.cache_key() == repr((0.15, 1, "v_deviation", (), 0)).encode()
    assert BlendConfig(**cacheblend, correction_shrink=3.0).cache_key() == base.cache_key()
    assert BlendConfig(**cacheblend, correction_prior="pooled").cache_key() == base.cache_key()
    keys = {base.cache_key()} | {
        BlendConfig(**kw).cache_key()
        for kw in (
            dict(),  # the default: correction="k"
            dict(correction="v"),
            dict(correction="v", correction_shrink=2.0),
            dict(chunk_head_tokens=4),
            dict(reselect=1),
            dict(selection="v_deviation"),
            dict(correction_prior="pooled"),
        )
    }
    assert len(keys) == 8
    with pytest.raises(ConfigError, match="out of range"):
        BlendConfig(reselect=2).validate_for(2)  # a target: checked at a ratio below 1
    with pytest.raises(ConfigError, match="out of range"):
        BlendConfig(recompute_ratio=0.1, reselect=2).validate_for(2)
    reselect = BlendConfig(recompute_ratio=0.1, reselect=2, selection="v_deviation")
    assert reselect.selection_layers(30) == pytest.approx({1: 0.15, 10: 0.1, 20: 0.05})
    assert BlendConfig(selection="prophet").first_partial_layer == 0


def test_method_names():
    cfg = parse_method("blend@0.1:prophet+ckv+h4+s2+rs1").blend
    assert (cfg.selection, cfg.correction, cfg.chunk_head_tokens) == ("prophet", "kv", 4)
    assert (cfg.correction_shrink, cfg.reselect, cfg.recompute_ratio) == (2.0, 1, 0.1)
    assert parse_method("blend@0.1:v_deviation+c0").blend.correction == "none"
    assert parse_method("blend@0.1").blend.correction == "k"  # the default
    assert parse_method("blend@0.1").blend.skip_exact
    assert not parse_method("blend@0.1:prophet+ck+s32+x0").blend.skip_exact
    assert parse_method("blend@0.1:prophet+e8").blend.chunk_samples == 8
    assert parse_method("blend@0.1").blend.correction_prior == "zero"
    assert parse_method("blend@0.1:prophet+ck+s32+pp").blend.correction_prior == "pooled"
    assert parse_method("blend@0.1:prophet+ck+s32+pp+p0").blend.correction_prior == "zero"
    for bad in ("blend@0.1:prophet+zz", "blend@0.1:+cv", "blend@0.1:heads+rs9"):
        with pytest.raises(MethodError):
            parse_method(bad)


def test_key_row_layers_price_rows_by_their_positions(llm, plans):
    """V deviation: every row attends in layer 0, the kept rows from the check layer 1 on (the
    dropped ones only got their Q/K/V there); a row at position p attends to p + 1 keys (the
    profile's key-weighted floor)."""
    prompt_logits(llm, PROMPT, BlendConfig(recompute_ratio=0.3, selection="v_deviation"))
    plan = plans[-1]
    n = len(plan.blends[0].reused)
    kept_keys = int(plan.positions.sum()) + len(plan.positions)  # the rows left after layer 1
    assert len(plan.positions) < n
    all_keys = n * (n + 1) // 2  # positions 0..n-1, no prefix hit
    assert plan.key_row_layers(NUM_LAYERS) == all_keys + kept_keys * (NUM_LAYERS - 1)
    assert plan.row_layers(NUM_LAYERS) == n + len(plan.positions) * (NUM_LAYERS - 1)


@pytest.mark.parametrize("visible_prefix", [0, 1, 17, 20])
def test_query_attention_mass_equals_a_dense_softmax(visible_prefix):
    """GQA (6 query heads on 2 KV heads), query rows at the end: per head and row a plain
    masked softmax over the keys, summed; masking only after ``visible_prefix`` keys (all of
    which every row sees) changes nothing."""
    torch.manual_seed(1)
    q, k = torch.randn(4, 6, 16), torch.randn(24, 2, 16)
    q_pos = torch.tensor([20, 21, 22, 23])
    want = torch.zeros(24, dtype=torch.float64)
    for row in range(4):
        for head in range(6):
            logits = k[:, head // 3].double() @ q[row, head].double() / 4.0
            logits[torch.arange(24) > q_pos[row]] = float("-inf")
            want += logits.softmax(0)
    got = query_attention_mass(q, k, q_pos, torch.arange(24), visible_prefix)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert got[21:].tolist() != [0.0] * 3 and got[23] > 0  # the tail is seen by later rows


def test_row_layers_count_the_prophet_query_pass(llm, plans):
    """ProphetKV: the rows of its query pass (those without reused K/V) ran every layer before
    the fused forward, each over its position + 1 keys; the plan's counts include them (the
    profile's floors and the loading controller's compute rate use these counts)."""
    prompt_logits(llm, PROMPT, BlendConfig(recompute_ratio=0.3, selection="prophet"))
    plan = plans[-1]
    sb = plan.blends[0]
    others = torch.nonzero(~sb.reused).flatten()  # rows of this seq = positions (no prefix hit)
    assert sb.extra_row_layers == len(others) * NUM_LAYERS
    assert sb.extra_key_row_layers == int((others + 1).sum()) * NUM_LAYERS
    from blendkv.blend.row_plan import _layers_sum

    fused_keys = _layers_sum(plan._key_counts, NUM_LAYERS)
    assert plan.key_row_layers(NUM_LAYERS) == fused_keys + sb.extra_key_row_layers
    assert plan.row_layers(NUM_LAYERS) > sb.extra_row_layers > 0


def test_rows_the_query_pass_settled_are_not_recomputed(llm, plans, monkeypatch):
    """ProphetKV's fused forward leaves out the rows before the first chunk (the template's
    head): they see no reused K/V, so the query pass computed them exactly and wrote their K/V
    at every layer. Recomputing them changes nothing but the cost."""
    from blendkv.blend.row_plan import BlendRowPlan

    config = BlendConfig(recompute_ratio=0.3)
    llm.generate([PROMPT], GREEDY, blend=config)  # the chunks computed and stored first
    settled, prompt = prompt_logits(llm, PROMPT, config)
    plan = plans[-1]
    lead = prompt.chunk_starts[0]
    assert lead > 0 and not (plan.rows < lead).any()
    monkeypatch.setattr(
        BlendRowPlan, "_settled_by_query_pass", lambda self, sb: torch.zeros_like(self.reused)
    )
    again, _ = prompt_logits(llm, PROMPT, config)
    assert (plans[-1].rows < lead).sum() == lead  # recomputed this time
    torch.testing.assert_close(
        settled.extra["prompt_logits"], again.extra["prompt_logits"], atol=1e-5, rtol=0
    )
    assert settled.blend_stats.tokens_recomputed == again.blend_stats.tokens_recomputed
    saved = lead * NUM_LAYERS
    assert again.blend_stats.row_layers - settled.blend_stats.row_layers == pytest.approx(saved)


def test_rows_prophet_drops_skip_layer_0s_projections(llm, monkeypatch):
    """ProphetKV's picks are known before layer 0 (its query pass): the dropped rows never run
    the input norm and Q/K/V. V deviation needs every row's fresh V at its check layer."""
    for selection in ("prophet", "v_deviation"):  # the chunks computed and stored first
        llm.generate([PROMPT], GREEDY, blend=BlendConfig(selection=selection))
    llm.blend_manager().flush()
    layers = llm.engine.model.model.layers
    seen: dict[int, list[int]] = {0: [], 1: []}
    for i in seen:
        original = layers[i].self_attn.project

        def project(normed, i=i, original=original):
            seen[i].append(normed.shape[0])
            return original(normed)

        monkeypatch.setattr(layers[i].self_attn, "project", project)
    prompt = llm.blend_manager().prepare(PROMPT, BlendConfig()).prompt
    n, lead = len(prompt.token_ids), prompt.chunk_starts[0]
    out = llm.generate([PROMPT], GREEDY, blend=BlendConfig(recompute_ratio=0.3))[0]
    kept = out.blend_stats.tokens_recomputed
    assert 0 < lead < kept < n
    # the query pass's rows first, then the fused forward's (the kept rows only, at layer 0,
    # less those before the first chunk: the query pass settled them), then the decode steps'
    assert seen[0][0] == seen[1][0] == n - out.blend_stats.tokens_reused
    assert seen[0][1] == kept - lead and seen[1][1] == kept - lead
    for i in seen:
        seen[i].clear()
    out = llm.generate(
        [PROMPT], GREEDY, blend=BlendConfig(recompute_ratio=0.3, selection="v_deviation")
    )[0]
    assert seen[0][0] == seen[1][0] == n  # layer 0 in full; every row's Q/K/V at layer 1
