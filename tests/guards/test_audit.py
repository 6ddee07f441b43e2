"""The blend audit (``EngineConfig.blend_audit_rate``, ``blendkv.guards.audit``): a sampled share of
blended requests also runs full prefill after the answer, when the engine is idle; it never
changes the answer nor the step of its first token, and records KL(full || blend) along the
blend's own answer (the first token's, the largest) and top-1."""

from __future__ import annotations

import pytest
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import QuietLLM

from blendkv import LLM, SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.errors import ConfigError
from blendkv.guards.audit import Auditor
from blendkv.guards.fidelity import ANSWER_TOKENS, kl_divergence, teacher_forced_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
FULL_REUSE = BlendConfig(recompute_ratio=0.0)


def _llm(model_dir, rate: float) -> LLM:
    return QuietLLM(
        str(model_dir),
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,
        prefetch_kv=False,
        blend_audit_rate=rate,
    )


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    audited, plain = _llm(tiny_llama_dir, 1.0), _llm(tiny_llama_dir, 0.0)
    yield audited, plain
    audited.close()
    plain.close()


def _run(engine, prompt, blend, request_id):
    """Step ``engine`` until idle: (tokens, step of the first token, steps in all, output)."""
    engine.add_request(prompt, GREEDY, request_id=request_id, blend=blend)
    steps, first_step, final = 0, None, None
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.request_id == request_id:
                if first_step is None:
                    first_step = steps
                final = out
    return list(final.outputs[0].token_ids), first_step, steps, final


@pytest.mark.parametrize("ratio", [1.0, 0.0])
def test_audit_changes_neither_answer_nor_first_token_step(pair, ratio):
    audited, plain = pair
    prompt = {"documents": DOCS, "query": f"{QUERY} ({ratio})"}
    blend = BlendConfig(recompute_ratio=ratio)
    rid = f"r{ratio}"
    a_tokens, a_first, a_steps, a_out = _run(audited.engine, prompt, blend, rid)
    p_tokens, p_first, p_steps, _ = _run(plain.engine, prompt, blend, rid)
    assert a_tokens == p_tokens
    assert a_first == p_first
    assert a_steps == p_steps + 1  # the audit: one idle step after the answer
    assert "prompt_logits" not in (a_out.extra or {})  # asked by the audit only
    record = audited.engine.blend_audit_records()[-1]
    assert record.request_id == rid
    assert record.num_prompt_tokens == len(a_out.prompt_token_ids)
    assert a_out.blend_stats.audit == record  # lands in the answer's stats once it ran
    assert record.num_answer_tokens == len(a_tokens) and record.max_kl >= record.kl
    if ratio == 1.0:  # a blend that recomputes everything is full prefill
        assert record.max_kl < 1e-4 and record.top1_agree and record.flips == 0
    else:  # full reuse of chunks computed apart differs from full prefill
        assert record.kl > 1e-6
    assert plain.engine.blend_audit_records() == []


def test_max_kl_is_the_largest_kl_along_the_blends_own_answer(pair):
    """The record against an offline recomputation: full prefill and the blend, each
    teacher-forced on the blend's answer; only the first ANSWER_TOKENS positions count."""
    audited, _ = pair
    prompt = {"documents": DOCS, "query": "Which river flows through it?"}
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS + 2, ignore_eos=True)
    out = audited.generate(prompt, params, blend=FULL_REUSE)[0]
    record = audited.blend_audit_records()[-1]
    assert record.request_id == out.request_id
    ids, answer = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
    kept = answer[:ANSWER_TOKENS]
    full = teacher_forced_logits(audited, ids, kept).rows[:ANSWER_TOKENS]
    blend = teacher_forced_logits(audited, ids, kept, prompt, FULL_REUSE).rows[:ANSWER_TOKENS]
    kls = kl_divergence(full, blend)
    assert record.num_answer_tokens == ANSWER_TOKENS
    assert record.max_kl == pytest.approx(float(kls.max()), rel=1e-3)
    assert record.kl == pytest.approx(float(kls[0]), rel=1e-3)
    assert record.flips == int((full.argmax(-1) != blend.argmax(-1)).sum())
    assert int(kls.argmax()) > 0  # the largest is not the first token's: max_kl sees further
    audited.blend_audit_records()  # the offline runs' own audits run now, not in later tests


def test_audit_waits_while_other_requests_run(pair):
    """An audit ready while another request decodes runs only once that one is done."""
    audited, _ = pair
    engine = audited.engine
    before = len(engine.blend_audit_records())
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request(
        {"documents": DOCS, "query": "Short?"}, short, request_id="s", blend=FULL_REUSE
    )
    engine.add_request([5, 6, 7, 8], long, request_id="p")
    finished_at = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        n_records = len(engine.blend_audit_records())
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = step
        if len(engine.blend_audit_records()) > n_records:
            audit_step = step
    assert finished_at["s"] < finished_at["p"] < audit_step
    assert len(engine.blend_audit_records()) == before + 1


def test_user_prompt_logits_are_kept(pair):
    audited, plain = pair
    prompt = {"documents": DOCS, "query": "With logits?"}
    n = len(plain.engine.prepare_request(prompt, GREEDY, blend=FULL_REUSE).prompt_token_ids)
    outs = [
        llm.generate(prompt, GREEDY, blend=FULL_REUSE, logits_from=n - 3)[0]
        for llm in (audited, plain)
    ]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    a, p = (o.extra["prompt_logits"] for o in outs)
    assert a.shape == p.shape == (3, a.shape[1]) and bool((a == p).all())
    record = audited.blend_audit_records()[-1]  # the LLM runs the pending audit first
    assert record.kl > 1e-6 and record.num_prompt_tokens == n


def test_choice_is_seeded_and_follows_the_rate():
    def drawn(seed):
        auditor = Auditor(0.25, seed)
        return [auditor.choose(f"r{i}", [1, 2]) for i in range(400)]

    assert drawn(3) == drawn(3) and drawn(3) != drawn(4)
    assert 60 < sum(drawn(3)) < 140
    assert not Auditor(1.0, 0).choose("blendkv-start-gate-blend", [1])
    with pytest.raises(ConfigError, match="blend_audit_rate"):
        from blendkv.config import GuardConfig

        GuardConfig(blend_audit_rate=1.5)


def test_watch_warns_once_per_crossing(caplog):
    from blendkv.guards.audit import AuditRecord, AuditWatch

    def record(kl):
        return AuditRecord("r", kl, True, 1, 1, 10, max_kl=kl, flips=0, num_answer_tokens=1)

    watch = AuditWatch(warn_kl=0.5, window=2)
    with caplog.at_level("WARNING", logger="blendkv.guards.audit"):
        for kl in (0.2, 0.6, 1.0, 2.0):  # means 0.2, 0.4, 0.8, 1.5: one crossing
            watch.observe(record(kl))
        assert caplog.text.count("blend audit") == 1 and watch.warning
        for kl in (0.0, 0.0, 3.0):  # below again (0.0), then above (1.5): warns again
            watch.observe(record(kl))
    assert caplog.text.count("blend audit") == 2
