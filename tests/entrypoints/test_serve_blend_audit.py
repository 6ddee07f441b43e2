"""The blend audit in the server: audited requests land in ``/metrics`` histograms (and, for a
fidelity target, the fidelity controller's gauges), and a mean KL above ``blend_audit_warn_kl``
logs a warning (``blendkv.guards.audit``)."""

from __future__ import annotations

import logging

import pytest
from helpers import QuietLLM
from server_helpers import make_tiny_chat_model_dir, raw_request, running_server, scrape, wait_for

from blendkv.entrypoints.openai.api_server import ServeConfig, create_app

pytestmark = pytest.mark.timeout(300)

ENGINE = dict(dtype="float32", block_size=4, max_model_len=256, blend_audit_rate=1.0)
DOCS = [
    "Paris is the capital of France. The Seine flows through Paris.",
    "Berlin is the capital of Germany. It has many museums and parks.",
]


def test_audits_reach_metrics_and_warn(tmp_path, caplog):
    model_dir = make_tiny_chat_model_dir(tmp_path / "tiny-chat")
    config = ServeConfig(served_model_name="tiny", blend_audit_warn_kl=0.0)
    app = create_app(lambda: QuietLLM(str(model_dir), **ENGINE), config)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Which river?"}],
        "max_tokens": 3,
        "temperature": 0,
        "documents": [{"text": d} for d in DOCS],
    }
    with caplog.at_level(logging.WARNING, logger="blendkv.guards.audit"):
        with running_server(app) as url:
            before = scrape(url)
            assert before["blendkv_blend_audit_kl_count"] == 0
            status, _, reply = raw_request(url, "POST", "/v1/chat/completions", body=body)
            assert status == 200, reply
            landed = wait_for(lambda: scrape(url)["blendkv_blend_audit_kl_count"] == 1)
            assert landed
            after = scrape(url)
            assert after["blendkv_blend_audit_top1_agreement_count"] == 1
            assert after["blendkv_blend_audit_kl_sum"] > 0
            assert "blendkv_blend_audit_kl_bucket{le=+Inf}" in after
            # a fidelity target's request: the controller's ratio and audited p90 per target
            body["blend"] = {"fidelity_target": 0.01}
            status, _, reply = raw_request(url, "POST", "/v1/chat/completions", body=body)
            assert status == 200, reply
            p90 = "blendkv_fidelity_target_audit_p90{target=0.01}"
            assert wait_for(lambda: p90 in scrape(url))
            targets = scrape(url)
            assert targets["blendkv_blend_audit_kl_count"] == 2
            assert targets["blendkv_fidelity_target_recompute_ratio{target=0.01}"] == 0.3
            assert targets[p90] > 0
    assert "above --blend-audit-warn-kl 0" in caplog.text
