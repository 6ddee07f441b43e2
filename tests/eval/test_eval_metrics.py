from __future__ import annotations

import math

import pytest
import torch

from blendkv.eval.metrics import (
    Fidelity,
    answer_divergence,
    exact_match,
    f1_score,
    first_line,
    first_token_agreement,
    kl_divergence,
    normalize_answer,
    rouge_l,
    summarize,
    teacher_forced_fidelity,
)


def test_normalize_answer_squad_rules():
    assert normalize_answer("  The  Cat, an Apple & a dog!  ") == "cat apple dog"
    # Articles only as whole words; "theme" and "banana" keep their letters.
    assert normalize_answer("Theme of a Banana") == "theme of banana"


def test_exact_match():
    assert exact_match("The Cat", ["cat"]) == 1.0
    assert exact_match("cats", ["cat"]) == 0.0
    assert exact_match("Exeter College.", "exeter college") == 1.0


def test_f1_partial_overlap_by_hand():
    # pred -> [quick, brown, fox] (3), gold -> [quick, red, fox, jumps] (4), 2 in common:
    # P = 2/3, R = 1/2, F1 = 2PR / (P + R) = 4/7.
    assert f1_score("the quick brown fox", ["a quick red fox jumps"]) == pytest.approx(4 / 7)
    assert f1_score("fox fox", ["fox"]) == pytest.approx(2 * 0.5 * 1 / 1.5)  # clipped counts


def test_f1_and_em_empty_cases_follow_squad():
    assert f1_score("", ["cat"]) == 0.0
    assert exact_match("", ["cat"]) == 0.0
    assert f1_score("cat", [""]) == 0.0
    assert f1_score("", [""]) == 1.0
    assert exact_match("", [""]) == 1.0
    # "the" normalises to nothing, so it is an empty prediction against an empty gold.
    assert f1_score("The.", ["a"]) == 1.0
    with pytest.raises(ValueError):
        f1_score("cat", [])


def test_multiple_golds_take_the_max():
    assert exact_match("blue car", ["red car", "Blue car"]) == 1.0
    assert f1_score("blue car", ["green truck", "red car"]) == pytest.approx(0.5)
    assert f1_score("blue car", ["red car", "green truck"]) == pytest.approx(0.5)


def test_rouge_l_by_hand():
    # LCS of "the cat sat on the mat" / "the cat lay on the mat" is 5 of 6 tokens each.
    assert rouge_l("the cat sat on the mat", ["the cat lay on the mat"]) == pytest.approx(5 / 6)
    # LCS 2: P = 2/4, R = 2/2, F = 2/3; the max over golds picks it over a 0 score.
    assert rouge_l("a b c d", ["zzz", "a c"]) == pytest.approx(2 / 3)
    assert rouge_l("", ["cat"]) == 0.0
    # The stemmer maps "running" and "run" together.
    assert rouge_l("running", ["run"]) == 1.0
    assert rouge_l("running", ["run"], use_stemmer=False) == 0.0


def test_first_line():
    assert first_line("\n  Exeter College \nThe author studied there.") == "Exeter College"
    assert first_line(" \n\n") == ""


def test_kl_of_identical_logits_is_zero():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    kl = kl_divergence(logits, logits.clone())
    assert kl.dtype == torch.float64 and kl.shape == (3,)
    assert torch.equal(kl, torch.zeros(3, dtype=torch.float64))


def test_kl_two_token_closed_form():
    # float64 logits so that log(3) is exact to the tolerance; p = [1/4, 3/4] and [1, 0].
    ref = torch.tensor([[0.0, math.log(3.0)], [0.0, float("-inf")]], dtype=torch.float64)
    test = torch.zeros(2, 2, dtype=torch.float64)  # q = [1/2, 1/2]
    expected = [0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5), math.log(2.0)]
    assert kl_divergence(ref, test).tolist() == pytest.approx(expected, rel=1e-12)
    # float32 logits are upcast; only the rounding of log(3) to float32 remains.
    assert kl_divergence(ref.float(), test.float()).tolist() == pytest.approx(expected, rel=1e-6)
    # KL is not symmetric: KL(q || p) differs.
    reverse = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_divergence(test[0], ref[0]).item() == pytest.approx(reverse, rel=1e-12)


def test_kl_is_stable_for_large_logits():
    ref = torch.tensor([1000.0, 0.0])
    test = torch.tensor([0.0, 1000.0])
    assert kl_divergence(ref, test).item() == pytest.approx(1000.0, rel=1e-9)
    with pytest.raises(ValueError, match="shapes differ"):
        kl_divergence(torch.zeros(2, 3), torch.zeros(3, 2))


def test_first_token_agreement():
    assert first_token_agreement(torch.tensor([0.1, 2.0, 0.3]), torch.tensor([5.0, 9.0, 1.0]))
    assert not first_token_agreement(torch.tensor([0.1, 2.0, 0.3]), torch.tensor([5.0, 1.0, 1.0]))
    with pytest.raises(ValueError):
        first_token_agreement(torch.zeros(2, 3), torch.zeros(2, 3))


def test_teacher_forced_fidelity_truncates_to_max_tokens():
    ref = torch.tensor([[0.0, math.log(3.0)]] * 5)
    test = ref.clone()
    test[2:] = torch.tensor([math.log(3.0), 0.0])  # rows 2..4 flip the argmax
    row_kl = 0.25 * math.log(0.25 / 0.75) + 0.75 * math.log(0.75 / 0.25)  # = ln(3) / 2

    assert teacher_forced_fidelity(ref, test, max_tokens=2) == Fidelity(0.0, 1.0)
    mean_kl, agree = teacher_forced_fidelity(ref, test, max_tokens=3)
    assert mean_kl == pytest.approx(row_kl / 3) and agree == pytest.approx(2 / 3)
    mean_kl, agree = teacher_forced_fidelity(ref, test)  # default 16 > T = 5
    assert mean_kl == pytest.approx(3 * row_kl / 5) and agree == pytest.approx(2 / 5)
    with pytest.raises(ValueError):
        teacher_forced_fidelity(ref, test, max_tokens=0)
    with pytest.raises(ValueError):
        teacher_forced_fidelity(ref[:0], test[:0])


def test_answer_divergence_is_the_largest_row_kl_within_max_tokens():
    ref = torch.tensor([[0.0, math.log(3.0)]] * 5)
    test = ref.clone()
    test[1] = torch.tensor([math.log(3.0), 0.0])  # one flipped row: KL ln(3) / 2
    test[3] = torch.tensor([0.0, math.log(2.0)])  # a smaller drift
    row_kl = 0.25 * math.log(0.25 / 0.75) + 0.75 * math.log(0.75 / 0.25)
    assert answer_divergence(ref, test) == pytest.approx(row_kl)  # not the mean over rows
    assert answer_divergence(ref, test, max_tokens=1) == 0.0
    assert answer_divergence(ref, ref) == 0.0
    with pytest.raises(ValueError):
        answer_divergence(ref[:0], test[:0])


def test_summarize_linear_percentile():
    out = summarize([10, 1, 4, 3, 2])
    # sorted [1, 2, 3, 4, 10]; p90 at rank 0.9 * 4 = 3.6 -> 4 + 0.6 * (10 - 4) = 7.6
    assert out == pytest.approx({"mean": 4.0, "median": 3.0, "p90": 7.6})
    assert all(type(v) is float for v in out.values())
    assert summarize([2.5]) == {"mean": 2.5, "median": 2.5, "p90": 2.5}
    with pytest.raises(ValueError):
        summarize([])
