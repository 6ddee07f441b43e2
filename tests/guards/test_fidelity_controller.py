"""The fidelity controller (``blendkv.guards.fidelity_controller``): audits of a target's requests
move its ratio along the calibration grid, up on drift and down on headroom, between the
calibration's floor and full prefill, one step per fresh window. The engine test runs it on the
tiny random model with every request audited."""

from __future__ import annotations

import pytest
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.errors import ConfigError
from blendkv.guards.audit import AuditRecord
from blendkv.guards.calibration import DEFAULT_RATIOS, UNCALIBRATED_RATIO
from blendkv.guards.fidelity_controller import FidelityController

TARGET = 0.4  # nats
GRID = DEFAULT_RATIOS  # 0.0, 0.05, 0.1, 0.2, 0.3, 0.5
FLOOR = 0.1  # what the calibration picked for TARGET
DRIFT, CALM = 2 * TARGET, 0.1 * TARGET  # above the target; below headroom x target


def _audit(ratio: float, max_kl: float, target: float = TARGET) -> AuditRecord:
    return AuditRecord(
        "r", max_kl, True, 0, 0, 10, max_kl, 0, 16, fidelity_target=target, recompute_ratio=ratio
    )


def _feed(ctl: FidelityController, max_kl: float, n: int) -> list[int]:
    """``n`` audits at the ratio the target runs at now (re-read before each); their steps."""
    return [ctl.observe(_audit(ctl.ratio_for(TARGET, FLOOR, GRID), max_kl)) for _ in range(n)]


def test_drift_steps_up_after_min_audits_and_climbs_to_full_prefill():
    ctl = FidelityController(window=16, min_audits=4)
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == FLOOR
    assert _feed(ctl, DRIFT, 4) == [0, 0, 0, 1]
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == 0.2
    # the ladder above the floor: 0.2, 0.3, 0.5, then full prefill; 4 audits per step
    assert _feed(ctl, DRIFT, 12) == [0, 0, 0, 1] * 3
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == 1.0
    assert _feed(ctl, DRIFT, 8) == [0] * 8  # never above 1.0
    assert ctl.state()[TARGET].ratio == 1.0 and ctl.state()[TARGET].floor == FLOOR


def test_a_step_waits_for_a_fresh_window_at_the_new_ratio():
    ctl = FidelityController(window=16, min_audits=4)
    ctl.ratio_for(TARGET, FLOOR, GRID)
    _feed(ctl, DRIFT, 4)
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == 0.2
    # late audits of requests run at the floor: not counted, however far they drift
    assert [ctl.observe(_audit(FLOOR, 10.0)) for _ in range(10)] == [0] * 10
    assert ctl.state()[TARGET].num_audits == 0
    assert _feed(ctl, DRIFT, 3) == [0, 0, 0]  # not yet a fresh window
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == 0.2
    assert _feed(ctl, DRIFT, 1) == [1]
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == 0.3


def test_headroom_steps_down_after_a_full_window_never_below_the_floor():
    ctl = FidelityController(window=6, min_audits=2)
    ctl.ratio_for(TARGET, FLOOR, GRID)
    _feed(ctl, DRIFT, 4)
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == 0.3
    assert _feed(ctl, CALM, 6) == [0] * 5 + [-1]  # a whole window of headroom
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == 0.2
    assert _feed(ctl, CALM, 6) == [0] * 5 + [-1]
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == FLOOR
    assert _feed(ctl, CALM, 18) == [0] * 18  # the floor holds
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == FLOOR


def test_within_the_band_it_holds():
    ctl = FidelityController(window=4, min_audits=2, headroom=0.5)
    ctl.ratio_for(TARGET, FLOOR, GRID)
    _feed(ctl, DRIFT, 2)
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == 0.2
    # between headroom x target and the target: neither up nor down
    assert _feed(ctl, 0.75 * TARGET, 20) == [0] * 20
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == 0.2
    assert ctl.state()[TARGET].p90 == pytest.approx(0.75 * TARGET)


def test_the_high_percentile_not_the_mean_decides():
    ctl = FidelityController(window=10, min_audits=10)
    ctl.ratio_for(TARGET, FLOOR, GRID)
    # 8 calm audits and 2 far above: the mean is within the target, the 90th percentile is not
    kls = [CALM] * 8 + [1.5 * TARGET] * 2
    assert sum(kls) / len(kls) < TARGET
    assert [ctl.observe(_audit(FLOOR, kl)) for kl in kls] == [0] * 9 + [1]


def test_targets_are_held_apart_and_a_new_calibration_starts_over():
    ctl = FidelityController(window=4, min_audits=2)
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == FLOOR
    assert ctl.ratio_for(1.0, 0.0, GRID) == 0.0
    _feed(ctl, DRIFT, 2)
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == 0.2 and ctl.ratio_for(1.0, 0.0, GRID) == 0.0
    assert ctl.observe(_audit(0.0, 9.0, target=7.0)) == 0  # a target never resolved
    # a calibration appears (another floor and grid): the target starts from its floor
    assert ctl.ratio_for(TARGET, 0.05, (0.0, 0.05, 0.5)) == 0.05
    assert ctl.ratio_for(0.0, 1.0, GRID) == 1.0  # only full prefill meets it: nothing to move


def test_bad_knobs_are_typed_errors():
    with pytest.raises(ConfigError, match="min_audits"):
        FidelityController(window=4, min_audits=5)
    with pytest.raises(ConfigError, match="headroom"):
        FidelityController(headroom=1.0)
    with pytest.raises(ConfigError, match="window"):
        FidelityController(window=0)


GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_the_engine_raises_a_drifting_targets_ratio_and_leaves_explicit_ratios(tiny_llama_dir):
    """No calibration: a target runs at the conservative ratio (0.3). A target of 1e-6 nats is one
    the real blends on the random model miss, so the audits (every request, each run before the
    next request) move it up a step within ``min_audits`` requests; an explicit ratio runs as
    given and moves nothing."""
    llm = QuietLLM(
        str(tiny_llama_dir), dtype="float32", block_size=4, prefetch_kv=False, blend_audit_rate=1.0
    )
    with llm:
        ctl = llm.engine.fidelity
        target = BlendConfig(fidelity_target=1e-6)
        stats = []
        for i in range(ctl.min_audits + 1):
            prompt = {"documents": DOCS, "query": f"{QUERY} ({i})"}
            stats.append(llm.generate([prompt], GREEDY, blend=target)[0].blend_stats)
            llm.blend_audit_records()  # an idle engine: the audit runs
        assert [s.predicted_recompute_ratio for s in stats] == [UNCALIBRATED_RATIO] * len(stats)
        chosen = [s.chosen_recompute_ratio for s in stats]
        assert chosen[: ctl.min_audits] == [UNCALIBRATED_RATIO] * ctl.min_audits
        assert chosen[-1] == 0.5  # the next grid step (DEFAULT_RATIOS) above 0.3
        records = llm.blend_audit_records()
        assert all(r.fidelity_target == 1e-6 for r in records)
        assert [r.recompute_ratio for r in records][: ctl.min_audits] == chosen[: ctl.min_audits]
        assert ctl.state()[1e-6].ratio == 0.5

        before = ctl.state()
        prompt = {"documents": DOCS, "query": f"{QUERY} (explicit)"}
        out = llm.generate([prompt], GREEDY, blend=BlendConfig(recompute_ratio=0.1))[0]
        assert out.blend_stats.fidelity_target is None
        assert out.blend_stats.predicted_recompute_ratio is None
        assert llm.blend_audit_records()[-1].fidelity_target is None  # audited, not fed
        assert out.blend_stats.recompute_fraction == pytest.approx(0.1, abs=0.05)
        assert ctl.state() == before


def test_full_prefill_is_probed_again_after_probe_after_requests():
    """Full prefill is never audited: after ``probe_after`` requests there the target steps
    down one to be measured again, and back up if the drift stayed."""
    ctl = FidelityController(window=16, min_audits=4, probe_after=10)
    ctl.ratio_for(TARGET, FLOOR, GRID)
    _feed(ctl, DRIFT, 16)
    ratios = [ctl.ratio_for(TARGET, FLOOR, GRID) for _ in range(11)]
    assert ratios == [1.0] * 10 + [0.5]
    assert _feed(ctl, DRIFT, 4) == [0, 0, 0, 1]  # the drift stayed: back to full prefill
    assert ctl.ratio_for(TARGET, FLOOR, GRID) == 1.0
    with pytest.raises(ConfigError, match="probe_after"):
        FidelityController(probe_after=0)
