from __future__ import annotations

import json

import pytest
from helpers import QuietLLM

from blendkv.blend.config import DEFAULT_TARGET, BlendConfig
from blendkv.eval.methods import MethodError, parse_method, parse_methods
from blendkv.eval.report import _blend_sweeps, format_table, write_outputs
from blendkv.eval.runner import EvalConfig, EvalResult, summarize_method


def test_parse_blend_ratio():
    m = parse_method("blend@0.15")
    assert (m.name, m.kind, m.blend) == ("blend@0.15", "blend", BlendConfig(recompute_ratio=0.15))
    assert parse_method("blend@1.0").blend == BlendConfig(recompute_ratio=1.0)
    assert parse_method("reuse").blend == BlendConfig(recompute_ratio=0.0)
    for name in ("full", "prefix", "hf"):
        assert parse_method(name) == parse_method(f" {name} ")
        assert parse_method(name).blend is None


def test_parse_blend_selection():
    m = parse_method("blend@0.15:attention")
    assert (m.name, m.kind) == ("blend@0.15:attention", "blend")
    assert m.blend == BlendConfig(recompute_ratio=0.15, selection="attention")
    assert parse_method("blend@0.3:random").blend.selection == "random"
    # Same ratio, other strategies: distinct methods, compared side by side.
    names = "blend@0.15,blend@0.15:attention,blend@0.15:k_deviation,blend@0.15:random"
    assert [m.blend.selection for m in parse_methods(names)] == [
        "prophet",
        "attention",
        "k_deviation",
        "random",
    ]


def test_parse_default_and_fidelity_target():
    m = parse_method("default")
    assert (m.name, m.kind, m.blend) == ("default", "blend", BlendConfig())  # as shipped
    assert m.fidelity_target == DEFAULT_TARGET  # the default is a target
    t = parse_method("target@0.5")
    assert (t.name, t.kind, t.blend) == ("target@0.5", "blend", BlendConfig(fidelity_target=0.5))
    assert t.blend.target_mode and t.fidelity_target == 0.5
    assert parse_method("target@0").fidelity_target == 0.0
    # Targets are told apart by T (their ratio is the engine's pick, not part of the name).
    names = [m.name for m in parse_methods("full,default,target@0.5,target@2,blend@0.2")]
    assert names == ["full", "default", "target@0.5", "target@2", "blend@0.2"]


@pytest.mark.parametrize("spec", ["target@-1", "target@x", "target@", "target@inf", "target@nan"])
def test_bad_fidelity_target_is_a_method_error(spec):
    with pytest.raises(MethodError, match="fidelity target after 'target@' must be a finite"):
        parse_method(spec)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("blend@x", "must be a number"),
        ("blend@1.5", "not in [0, 1]"),
        ("blend@-0.1", "not in [0, 1]"),
        ("blend@nan", "not in [0, 1]"),
        ("blend", "unknown method"),
        ("fulll", "unknown method"),
        ("", "no methods"),
        (" , ", "no methods"),
        ("full,full", "same method"),
        ("reuse,blend@0", "same method"),
        ("blend@1,blend@1.0", "same method"),
        ("blend@0.15:best", "unknown selection 'best'"),
        ("blend@0.15:", "unknown selection ''"),
        ("blend@x:attention", "must be a number"),
        ("blend@0.15,blend@0.15:prophet", "same method"),  # the default strategy
        ("reuse,blend@0:attention", "same method"),  # nothing recomputed: no pick to make
        ("blend@1,blend@1.0:random", "same method"),  # everything recomputed
        ("default,target@1", "same method"),  # BlendConfig() is the default target
        ("target@0.5,target@0.50", "same method"),
        ("target", "unknown method"),
    ],
)
def test_bad_method_names_raise_clearly(spec, message):
    with pytest.raises(MethodError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_methods(spec)


def test_eval_config_validates_before_loading_and_puts_full_first():
    with pytest.raises(MethodError):
        EvalConfig(data="synthetic", methods="full,bogus")
    with pytest.raises(ValueError, match="max_tokens"):
        EvalConfig(data="synthetic", max_tokens=0)
    names = [m.name for m in EvalConfig(data="synthetic", methods="reuse,blend@0.5").method_list]
    assert names == ["full", "reuse", "blend@0.5"]  # full added: it is the fidelity reference


def _record(method, ttft, f1, full_ttft=2.0):
    keys = (
        "em rouge_l first_token_agreement first_token_kl answer_kl answer_agreement "
        "continuation_match recompute_fraction computed_fraction kv_bytes_loaded load_seconds"
    ).split()
    rec = {k: 0.5 for k in keys}
    rec.update(method=method, ttft_s=ttft, f1=f1, ttft_speedup=full_ttft / ttft)
    return rec


def test_summarize_method_by_hand():
    recs = [_record("blend@0.1", t, f) for t, f in [(1.0, 0.0), (2.0, 1.0), (4.0, 0.5)]]
    s = summarize_method(recs)
    assert s["n"] == 3
    assert s["f1"] == pytest.approx(0.5)
    assert s["ttft_median_s"] == pytest.approx(2.0)
    assert s["ttft_p90_s"] == pytest.approx(2.0 + 0.8 * 2.0)  # 0.9 * (3 - 1) = 1.8 -> v1 + .8 d
    assert s["ttft_speedup_paired_median"] == pytest.approx(1.0)  # ratios 2, 1, 0.5


def test_summarize_within_target_and_greedy_differs_by_hand():
    recs = [_record("target@0.5", 1.0, 0.0) for _ in range(4)]
    for r, kl, match in zip(recs, [0.0, 0.2, 0.5, 0.9], [1.0, 1.0, 0.0, 0.0], strict=True):
        r.update(answer_max_kl=kl, continuation_match=match)
    s = summarize_method(recs, fidelity_target=0.5)
    assert s["fidelity_target"] == 0.5
    assert s["within_target"] == 0.75  # 0.5 itself is within: the calibration's "<="
    assert s["greedy_differs"] == 0.5
    assert summarize_method(recs, fidelity_target=0.0)["within_target"] == 0.25
    # Records of older runs lack the measure: no fraction rather than a wrong one.
    old = summarize_method([_record("blend@0.1", 1.0, 0.0)])
    assert old["within_target"] is None and old["greedy_differs"] == 0.5


def test_write_outputs_files_and_sweep_only_with_two_ratios(tmp_path):
    config = {
        "data": "synthetic",
        "num_examples": 1,
        "model": None,
        "model_name": "m",
        "dtype": "float32",
        "max_tokens": 4,
        "answer_tokens": 16,
        "selection": "v_deviation",
        "check_layer": 1,
    }
    ttfts = [("full", 2.0), ("reuse", 1.0)]
    summary = {m: summarize_method([_record(m, t, 0.5)]) for m, t in ttfts}
    for s in summary.values():
        s["ttft_speedup"] = 2.0 / s["ttft_median_s"]
    result = EvalResult(config, [_record("full", 2.0, 0.5)], summary)
    paths = write_outputs(tmp_path / "a", result)
    assert "recompute_sweep" not in paths
    assert (tmp_path / "a" / "quality_vs_ttft.png").stat().st_size > 0
    assert json.loads(paths["results"].read_text())["methods"]["reuse"]["ttft_speedup"] == 2.0
    table = format_table(summary)
    assert table.count("\n") == 3 and "| reuse | 1 |" in table and "2.00x" in table
    for r in (0.1, 0.3):
        summary[f"blend@{r}"] = summary["reuse"]
    paths = write_outputs(tmp_path / "b", result)
    assert paths["recompute_sweep"].stat().st_size > 0


def test_sweep_lines_group_ratios_by_selection():
    names = ["full", "reuse", "blend@0.3", "blend@0.1", "blend@0.1:attention", "blend@1.0:random"]
    sweeps = _blend_sweeps(dict.fromkeys(names, {}))
    assert sweeps == {
        "prophet": [(0.0, "reuse"), (0.1, "blend@0.1"), (0.3, "blend@0.3")],
        "attention": [(0.0, "reuse"), (0.1, "blend@0.1:attention")],
        "random": [(0.0, "reuse"), (1.0, "blend@1.0:random")],
    }
    assert _blend_sweeps(dict.fromkeys(["full", "blend@0.2"], {})) == {
        "prophet": [(0.2, "blend@0.2")]
    }


def test_teacher_forced_rows_reuse_the_runs_own_kv(tiny_llama_dir):
    """Right after a method's run, its teacher-forced request hits that run's prompt blocks
    (exact or fused K/V) and gives the rows a cold request gives."""
    import torch

    from blendkv import SamplingParams
    from blendkv.eval.methods import ExamplePrompt, run_method, teacher_forced_rows

    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    try:
        manager = llm.blend_manager()
        docs = ["alpha beta gamma delta epsilon zeta", "one two three four five six seven"]
        blended = {"documents": docs, "query": "which words come first in the list?"}
        ids = list(manager.prepare(blended, BlendConfig()).prompt.token_ids)
        ex = ExamplePrompt(blended, ids, ids)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        answer = run_method(llm, None, parse_method("full"), ex, params).token_ids[:4]
        # V deviation: ProphetKV's pick follows the query, and a cold teacher-forced request's
        # query includes the answer, so only a warm one reproduces the run's rows.
        for name in ("full", "blend@0.3:v_deviation"):
            m = parse_method(name)
            run_method(llm, None, m, ex, params)
            warm = teacher_forced_rows(llm, None, m, ex, answer)
            assert warm.num_cached_tokens == (len(ids) - 1) // 4 * 4  # every full prompt block
            llm.engine.block_manager.reset_prefix_cache()
            cold = teacher_forced_rows(llm, None, m, ex, answer)
            assert cold.num_cached_tokens == 0
            warm, cold = warm.rows, cold.rows
            assert warm.shape == cold.shape == (len(answer) + 1, warm.shape[1])
            torch.testing.assert_close(warm, cold, rtol=1e-4, atol=1e-4)
    finally:
        llm.close()
