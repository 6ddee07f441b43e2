"""A fidelity target instead of a fixed ratio: the calibration on a store's own chunks (saved
beside it, tied to the model), the ratio a target picks from it, and the errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import QUIET_FLAGS, QuietLLM
from rag_helpers import DEMO_DOCS

from blendkv import SamplingParams
from blendkv.blend.config import DEFAULT_TARGET, BlendConfig
from blendkv.cli import main
from blendkv.errors import ConfigError
from blendkv.guards.calibration import (
    CONFIDENT_PROMPTS,
    DEFAULT_PROMPTS,
    UNCALIBRATED_RATIO,
    Calibration,
    CalibrationError,
    calibrate,
    calibrate_store,
    max_bound_confidence,
    uncalibrated_note,
)
from blendkv.rag import RAGPipeline

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def rag(tiny_llama_dir, tmp_path_factory):
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    with RAGPipeline(tmp_path_factory.mktemp("calib") / "store", llm=llm, chunk_tokens=48) as rag:
        rag.ingest([DEMO_DOCS], progress=False)
        yield rag
    llm.close()


@pytest.fixture(scope="module")
def calibration(rag):
    ids = [m.chunk_id for m in rag.store.kv.iter_meta() if m.doc_id]
    made = calibrate(
        rag.llm, ids, rag.instruction, ratios=(0.0, 0.3), num_prompts=3, chunks_per_prompt=3
    )
    made.save(rag.store_dir)
    return made


def test_the_curve_is_monotone_and_read_back(rag, calibration):
    c = calibration
    assert c.ratios == (0.0, 0.3) and c.num_prompts == 3
    assert c.divergence[0] >= c.divergence[1] >= 0.0
    assert c.high[0] >= c.high[1]
    assert all(lo <= d <= hi for lo, d, hi in zip(c.low, c.divergence, c.high, strict=True))
    assert c.divergence[0] > 0.0  # reuse of chunks computed apart does drift
    fingerprint = rag.manager.fingerprint.digest()
    assert Calibration.load(rag.store_dir, fingerprint) == c
    with pytest.raises(CalibrationError, match="measured with another model"):
        Calibration.load(rag.store_dir, "0" * 32)
    assert rag.manager.calibration() == c


def test_a_target_picks_the_least_ratio_within_it(calibration):
    c = calibration
    assert c.ratio_for(c.high[0]) == 0.0  # reuse already meets it
    assert c.ratio_for(c.high[1]) in (0.0, 0.3)
    assert c.ratio_for(-1.0) == 1.0  # nothing measured meets it: full prefill's answer
    replaced = dataclasses.replace(c, high=(0.5, 0.2))
    assert replaced.ratio_for(0.3) == 0.3


def test_target_zero_runs_full_prefill(rag, calibration):
    question = "Who created Python?"
    answer = rag.query(question, k=2, sampling_params=GREEDY, blend=BlendConfig(fidelity_target=0))
    stats = answer.blend_stats
    assert stats.fidelity_target == 0 and stats.calibrated
    assert stats.chosen_recompute_ratio == 1.0 and "fidelity target" in stats.fallback
    ids = rag.manager.prepare(answer.prompt, None).prompt.token_ids
    full = rag.llm.generate([ids], GREEDY)[0]
    assert answer.answer == full.text.strip()


def test_an_explicit_ratio_is_never_overridden(rag, calibration):
    answer = rag.query(
        "Who created Python?", k=2, sampling_params=GREEDY, blend=BlendConfig(recompute_ratio=0.3)
    )
    assert answer.blend_stats.fidelity_target is None
    assert answer.blend_stats.recompute_fraction == pytest.approx(0.3, abs=0.05)


def test_without_a_calibration_a_target_runs_the_conservative_ratio(tiny_llama_dir, tmp_path):
    with QuietLLM(str(tiny_llama_dir), dtype="float32") as llm:
        prompt = {"documents": ["Paris is in France.", "Rome is in Italy."], "query": "Paris?"}
        out = llm.generate([prompt], GREEDY, blend=BlendConfig(fidelity_target=0.05))[0]
    stats = out.blend_stats
    assert stats.calibrated is False and stats.chosen_recompute_ratio == UNCALIBRATED_RATIO


def test_bad_input_is_a_typed_error(rag):
    with pytest.raises(ConfigError, match="fidelity_target must be >= 0"):
        BlendConfig(fidelity_target=-0.1)
    with pytest.raises(ConfigError, match="not both"):
        BlendConfig(recompute_ratio=0.2, fidelity_target=0.1)
    with pytest.raises(CalibrationError, match="no document chunks"):
        calibrate(rag.llm, [], None)


def _assert_reports_the_saved_curve(store, out: str) -> None:
    """A 2-prompt calibration's report: saved beside the store, the default target's pick on
    it, and that 2 prompts are too few to bound the 90th percentile."""
    assert "2 prompts" in out and (store / "calibration.json").exists()
    text = (store / "calibration.json").read_text()
    saved = Calibration.from_json(text, json.loads(text)["fingerprint"], "saved")
    ratio = saved.ratio_for(DEFAULT_TARGET)
    ran = "full prefill" if ratio == 1.0 else f"ratio {ratio:g}"
    assert f"the default fidelity target (1 nat) picks {ran} on this store" in out
    assert "the largest of 2 prompts bounds the p90 with 19% confidence; 29 or more" in out


def test_the_command(tiny_llama_dir, tmp_path, capsys):
    store = tmp_path / "store"
    args = ["--store", str(store), "--model", str(tiny_llama_dir), "--dtype", "float32"]
    args += QUIET_FLAGS
    assert main(["ingest", str(DEMO_DOCS), "--chunk-tokens", "64", "--no-progress", *args]) == 0
    assert "is not calibrated: requests run the default fidelity target" in capsys.readouterr().out
    argv = ["calibrate", "--prompts", "2", "--ratios", "0,0.5", "--no-progress", *args]
    assert main(argv) == 0
    out = capsys.readouterr().out
    _assert_reports_the_saved_curve(store, out)
    assert main(["calibrate", "--prompts", "2", "--ratios", "0.5,0", *args]) == 2
    capsys.readouterr()
    assert main(["ingest", str(DEMO_DOCS), "--chunk-tokens", "64", "--no-progress", *args]) == 0
    assert "not calibrated" not in capsys.readouterr().out  # the store's curve is for this model


def test_a_calibration_on_the_users_questions_uses_the_chunks_each_retrieves(rag, tmp_path):
    """``calibrate_store(questions=...)``: each question over its ``top_k`` retrieved chunks, as
    ``query`` builds it (the first ``prompts`` questions)."""
    questions = ["Who created Python?", "What is Rust?", "Where is the Eiffel Tower?"]
    report = calibrate_store(
        rag, ratios=(0.0, 0.3), questions=questions, prompts=2, top_k=2, progress=False
    )
    assert "2 prompts of 2 retrieved chunks" in report
    saved = rag.manager.calibration()
    assert saved.num_prompts == 2 and saved.chunks_per_prompt == 2
    assert saved.divergence[0] >= saved.divergence[1]
    with pytest.raises(CalibrationError, match="at least 2 questions"):
        calibrate_store(rag, questions=questions[:1], progress=False)


def test_the_command_takes_a_question_file(tiny_llama_dir, tmp_path, capsys):
    store = tmp_path / "store"
    args = ["--store", str(store), "--model", str(tiny_llama_dir), "--dtype", "float32"]
    args += QUIET_FLAGS
    assert main(["ingest", str(DEMO_DOCS), "--chunk-tokens", "64", "--no-progress", *args]) == 0
    questions = tmp_path / "questions.txt"
    questions.write_text("Who created Python?\n\nWhat is Rust?\n")
    argv = ["calibrate", "--questions", str(questions), "--top-k", "3", "--ratios", "0,0.5"]
    assert main([*argv, "--no-progress", *args]) == 0
    assert "2 prompts of 3 retrieved chunks" in capsys.readouterr().out
    questions.write_text("Only one?\n")
    assert main([*argv, *args]) == 2
    assert "holds 1 question" in capsys.readouterr().err
    assert main(["calibrate", "--questions", str(tmp_path / "none.txt"), *args]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_ingest_calibrates_when_asked(tiny_llama_dir, tmp_path, capsys):
    """``ingest --calibrate SECONDS``: the documents, then the curve beside the store (at
    least 2 prompts, however short the time); an LMDB store only, refused before reading."""
    store = tmp_path / "store"
    args = ["--store", str(store), "--model", str(tiny_llama_dir), "--dtype", "float32"]
    args += [*QUIET_FLAGS, "--chunk-tokens", "64", "--no-progress"]
    assert main(["ingest", str(DEMO_DOCS), *args, "--calibrate", "0"]) == 0
    out = capsys.readouterr().out
    _assert_reports_the_saved_curve(store, out)
    for bad in (["--calibrate", "-1"], ["--calibrate", "--workers", "2"]):
        assert main(["ingest", str(DEMO_DOCS), *args, *bad]) == 2
        assert "--calibrate" in capsys.readouterr().err


def test_without_a_calibration_a_target_of_zero_runs_full_prefill(tiny_llama_dir):
    with QuietLLM(str(tiny_llama_dir), dtype="float32") as llm:
        prompt = {"documents": ["Paris is in France.", "Rome is in Italy."], "query": "Paris?"}
        out = llm.generate([prompt], GREEDY, blend=BlendConfig(fidelity_target=0))[0]
        full = llm.generate([out.prompt_token_ids], GREEDY)[0]
    stats = out.blend_stats
    assert stats.calibrated is False and stats.chosen_recompute_ratio == 1.0
    assert out.outputs[0].token_ids == full.outputs[0].token_ids


def test_the_default_config_is_the_default_target():
    default = BlendConfig()
    assert default.target_mode and default.fidelity_target == DEFAULT_TARGET
    assert BlendConfig(selection="v_deviation").fidelity_target == DEFAULT_TARGET
    for explicit in (0.1, "auto"):  # an explicit ratio sets no target
        config = BlendConfig(recompute_ratio=explicit)
        assert config.fidelity_target is None and not config.target_mode
    assert dataclasses.replace(default, selection="k_deviation").target_mode


def test_a_redis_store_keeps_its_calibration_for_every_engine(tiny_llama_dir, redis_server):
    """A store shared over Redis keeps the curve under a key: an engine that calibrates it and
    another that opens it later both run a target at the calibrated ratio; before, both were
    told the store had none."""
    redis_server.flush()
    url = redis_server.url
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    with RAGPipeline(url, llm=llm, chunk_tokens=48) as rag:
        rag.ingest([DEMO_DOCS], progress=False)
        assert "is not calibrated" in uncalibrated_note(rag.manager, url)
        report = calibrate_store(rag, ratios=(0.0, 0.5), prompts=2, progress=False)
        assert f"saved to {url} (key calibration)" in report
        saved = rag.manager.calibration()
        assert saved is not None and saved.ratios == (0.0, 0.5)
        assert uncalibrated_note(rag.manager, url) is None
    llm.close()
    other = QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    with RAGPipeline(url, llm=other, chunk_tokens=48) as rag:
        assert rag.manager.calibration() == saved
        answer = rag.query("Who created Python?", k=2, sampling_params=GREEDY)
        stats = answer.blend_stats
        assert stats.calibrated and stats.predicted_recompute_ratio == saved.ratio_for(1.0)
    other.close()


def test_a_request_with_more_chunks_than_the_calibration_measured_is_warned_once(
    tiny_llama_dir, tmp_path, caplog
):
    """Drift grows with a prompt's chunks: a target request holding well over the chunks the
    calibration's prompts held is told (once) that the picked ratio may be too low."""
    documents = ["Paris is in France.", "Rome is in Italy.", "Bern is in Switzerland."]
    with QuietLLM(str(tiny_llama_dir), dtype="float32", kv_store_dir=str(tmp_path)) as llm:
        manager = llm.blend_manager()
        curve = Calibration(
            manager.fingerprint.digest(), (0.0, 0.3), (2.0, 0.5), (1.0, 0.2), (3.0, 0.8), 4
        )
        manager.save_calibration(dataclasses.replace(curve, chunks_per_prompt=1))
        with caplog.at_level("WARNING", logger="blendkv.connector.manager"):
            outs = [
                llm.generate([{"documents": d, "query": "Rome?"}], GREEDY)[0]
                for d in (documents[:1], documents, documents)
            ]
        warned = [r for r in caplog.records if "calibrate --chunks-per-prompt 3" in r.message]
        assert len(warned) == 1 and "holds 3 chunks" in warned[0].message
        assert [o.blend_stats.calibration_chunks for o in outs] == [1, 1, 1]
        caplog.clear()
        manager.save_calibration(dataclasses.replace(curve, chunks_per_prompt=3))
        with caplog.at_level("WARNING", logger="blendkv.connector.manager"):
            out = llm.generate([{"documents": documents, "query": "Rome?"}], GREEDY)[0]
        assert out.blend_stats.calibration_chunks == 3 and not caplog.records


def test_the_default_prompts_bound_the_90th_percentile_with_95_percent_confidence():
    assert (
        max_bound_confidence(CONFIDENT_PROMPTS)
        >= 0.95
        > max_bound_confidence(CONFIDENT_PROMPTS - 1)
    )
    assert DEFAULT_PROMPTS >= CONFIDENT_PROMPTS
    assert max_bound_confidence(16) == pytest.approx(0.815, abs=0.001)
