"""The health window's fidelity summary, from injected audit records (no model)."""

from __future__ import annotations

import pytest

from blendkv.entrypoints.openai.health_log import HealthLog
from blendkv.guards.audit import AuditRecord


def record(max_kl: float, target: float | None, ratio: float | None) -> AuditRecord:
    return AuditRecord(
        request_id="r",
        kl=max_kl / 2,
        top1_agree=True,
        full_top1=1,
        blend_top1=1,
        num_prompt_tokens=100,
        max_kl=max_kl,
        flips=0,
        num_answer_tokens=16,
        fidelity_target=target,
        recompute_ratio=ratio,
    )


def test_each_target_gets_its_p90_whether_it_is_within_and_the_ratio_it_runs_at():
    log = HealthLog()
    for i in range(10):  # target 0.5: max KL 0.1 .. 1.0, the last at ratio 0.3
        log.on_audit(record(0.1 * (i + 1), 0.5, 0.2 if i < 9 else 0.3))
    for _ in range(4):
        log.on_audit(record(0.05, 1.0, 0.1))
    log.on_audit(record(3.0, None, None))  # an explicit ratio: no target, not summarised
    fidelity = log.snapshot()["audit"]["fidelity"]
    assert [f["target"] for f in fidelity] == [0.5, 1.0]
    half, one = fidelity
    assert half["audits"] == 10 and half["p90_max_kl"] == pytest.approx(0.91)
    assert half["within"] is False and half["recompute_ratio"] == 0.3
    assert one["audits"] == 4 and one["p90_max_kl"] == pytest.approx(0.05)
    assert one["within"] is True and one["recompute_ratio"] == 0.1


def test_no_target_no_summary():
    log = HealthLog()
    log.on_audit(record(0.2, None, None))
    assert log.snapshot()["audit"]["fidelity"] == []
