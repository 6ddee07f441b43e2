"""``blendkv bench sampler``: the penalised steps are checked against the dense reference before
they are timed, and a wrong result makes the run fail."""

from __future__ import annotations

import argparse

from blendkv.eval.bench import sampler

ARGS = argparse.Namespace(batch=4, vocab=512, prompt_tokens=16, steps=6, num_threads=None)


def test_every_penalty_setting_equals_the_dense_reference(capsys):
    assert sampler.main(ARGS) == 0
    out = capsys.readouterr().out
    assert out.count("= dense reference") == len(sampler.SETTINGS) - 1
    assert "DIFFERS" not in out


def test_a_penalised_step_that_differs_fails_the_run(monkeypatch, capsys):
    reference = sampler.dense_reference

    def off_by_one_token(logits, seqs, params):
        out = reference(logits, seqs, params)
        for row, seq in enumerate(seqs):
            out[row, seq.output_token_ids[-1]] += 100.0  # the last token unpenalised, and more
        return out

    monkeypatch.setattr(sampler, "dense_reference", off_by_one_token)
    assert sampler.main(ARGS) == 1
    assert "DIFFERS" in capsys.readouterr().out
