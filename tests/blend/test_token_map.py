"""The token map as a library (blendkv.blend.token_map): a trace of a fused prefill's rows and
the prompt's chunk spans in, one kind per prompt token out, exact letters."""

from __future__ import annotations

import pytest
import torch

from blendkv.blend.token_map import KINDS, TokenTrace, build_token_map, plain_token_map


def test_kinds_scores_and_mass_from_a_trace():
    # prompt: 2 cached | 1 template | chunk 0 (4) | chunk 1 (3) | 2 query  = 12 tokens
    spans = [(3, 7), (7, 10)]
    start, n = 2, 12
    reused = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)  # rows 2..11
    trace = TokenTrace(n - start, ["lmdb", "computed"])
    rows = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    trace.record_scores(
        0,
        "prophet",
        rows,
        torch.tensor([5.0, 1, 2, 3, 9, 0.5, float("inf")]),
        torch.tensor([0, 0, 0, 0, 0, 0, 1], dtype=torch.bool),
    )
    trace.record_dropped(0, torch.tensor([2, 3, 6]))  # rows left the set at layer 0
    trace.record_dropped(2, torch.tensor([4]))  # and one deeper
    trace.record_corrected(torch.tensor([2, 4]))
    mass = torch.arange(n, dtype=torch.float32)
    exact = torch.zeros(n - start, dtype=torch.bool)
    exact[1:5] = True  # chunk 0's rows
    tm = build_token_map(n, spans, start, 4, reused, trace, mass, exact)
    assert tm.kinds == "ppn" + "rcsc" + "rsr" + "nn"
    assert tm.counts() == {
        "prefix_cached": 2,
        "reused": 2,
        "corrected": 2,
        "recomputed": 3,
        "computed": 3,
    }
    assert tm.chunks == [-1, -1, -1, 0, 0, 0, 0, 1, 1, 1, -1, -1]
    assert tm.offsets == [-1, -1, -1, 0, 1, 2, 3, 0, 1, 2, -1, -1]
    assert tm.dropped_at == [-1, -1, -1, -1, 0, 0, 2, -1, 0, -1, -1, -1]
    assert tm.scores[:4] == [None, None, None, 5.0] and tm.scores[9] is None  # inf: forced
    assert tm.forced[9] and not any(tm.forced[:9])
    assert tm.chunk_tiers == ["lmdb", "computed"] and tm.chunk_exact == [True, False]
    assert sum(tm.query_mass) == pytest.approx(1) and tm.query_mass[11] == pytest.approx(11 / 66)
    d = tm.to_dict()
    assert d["legend"] == KINDS and d["num_tokens"] == n
    assert d["selections"] == [{"layer": 0, "score": "prophet"}]


def test_rows_past_the_fused_prefill_are_computed():
    trace = TokenTrace(3)
    tm = build_token_map(5, [(0, 2)], 0, 2, torch.tensor([True, True, False]), trace)
    assert tm.kinds == "rrnnn" and tm.query_mass is None


def test_plain_map():
    tm = plain_token_map(6, [(1, 4)], 2, 3)
    assert tm.kinds == "ppnnnn" and tm.chunks == [-1, 0, 0, 0, -1, -1]
    assert tm.counts()["prefix_cached"] == 2 and tm.dropped_at is None
