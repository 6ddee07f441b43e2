"""Quality on MuSiQue dev with the embedded model: divergence from full prefill shrinks as the
recompute ratio grows (teacher-forced KL along full prefill's greedy answer, 16 tokens)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.eval.datasets import load_cacheblend_json
from blendkv.eval.metrics import teacher_forced_fidelity
from blendkv.eval.prompts import get_prompt_spec, render_prompt

# The first 2 examples of shared/data/musique_dev.json (MuSiQue, CC BY 4.0), shipped so the
# test runs in CI; their first 2 of 10 passages each, cut to 100 words (~450-token prompts
# with the template: the embedded model's prefills are most of the suite's time otherwise).
DATA = Path(__file__).resolve().parents[1] / "data" / "musique_dev_first2.json"
NUM_EXAMPLES = 2
NUM_PASSAGES = 2
PASSAGE_WORDS = 100
ANSWER_TOKENS = 16


def teacher_forced_logits(llm, prompt, answer, blend):
    """Logits at the last prompt token and along ``answer`` (16 rows)."""
    if blend is None:
        ids = prompt + answer
        out = llm.generate(
            [ids], SamplingParams(temperature=0, max_tokens=1), logits_from=len(prompt) - 1
        )
    else:
        prompt = {**prompt, "continuation": answer}
        state = llm.blend_manager().prepare(prompt, blend)
        start = len(state.prompt.token_ids) - len(answer) - 1
        out = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=1), blend=blend, logits_from=start
        )
    return out[0].extra["prompt_logits"][: len(answer)]


def test_divergence_shrinks_with_recompute_ratio():
    spec = get_prompt_spec("musique")
    examples = load_cacheblend_json(DATA, limit=NUM_EXAMPLES)
    llm = QuietLLM(None, dtype="float32", enable_prefix_caching=False)
    kls = {"reuse": [], "blend@0.5": [], "blend@1.0": []}
    configs = {"reuse": 0.0, "blend@0.5": 0.5, "blend@1.0": 1.0}
    for ex in examples:
        passages = [
            replace(p, text=" ".join(p.text.split()[:PASSAGE_WORDS]))
            for p in ex.passages[:NUM_PASSAGES]
        ]
        ex = replace(ex, passages=passages)
        r = render_prompt(ex, spec)
        blended = {"documents": r.documents, "query": r.query, "system": r.system or None}
        state = llm.blend_manager().prepare(blended, BlendConfig(recompute_ratio=1.0))
        full_ids = state.prompt.token_ids
        answer = (
            llm.generate(
                [full_ids], SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
            )[0]
            .outputs[0]
            .token_ids
        )
        ref = teacher_forced_logits(llm, full_ids, answer, None)
        for name, ratio in configs.items():
            test = teacher_forced_logits(llm, blended, answer, BlendConfig(recompute_ratio=ratio))
            kls[name].append(teacher_forced_fidelity(ref, test, ANSWER_TOKENS).mean_kl)
    mean = {k: sum(v) / len(v) for k, v in kls.items()}
    print("mean teacher-forced KL vs full prefill:", mean)
    assert mean["blend@1.0"] < 1e-4
    assert mean["reuse"] > mean["blend@0.5"] > mean["blend@1.0"]
