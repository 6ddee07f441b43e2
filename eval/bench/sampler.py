"""``blendkv bench sampler``: one sampler step, plain greedy against each penalty and all three.

A batch of requests with random prompts decodes ``--steps`` greedy steps on random logits; the
penalties' step (``engine/penalties.py``: counts kept per request, applied over each row's seen
tokens) is checked first against a dense whole-vocabulary reference on the same inputs, then
timed. Median step time per setting and the ratio to plain greedy, side by side in one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from blendkv.engine.penalties import TokenCounts
from blendkv.engine.sampler import Sampler
from blendkv.engine.sequence import Sequence
from blendkv.sampling_params import SamplingParams

SETTINGS = {
    "plain": {},
    "repetition": {"repetition_penalty": 1.3},
    "presence+frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.4},
    "all three": {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4},
}


def dense_reference(logits: torch.Tensor, seqs: list[Sequence], p: SamplingParams) -> torch.Tensor:
    """The penalties over the whole vocabulary, row by row (vLLM's and transformers' rules)."""
    out = logits.clone()
    vocab = logits.shape[1]
    for row, seq in enumerate(out):
        prompt = torch.tensor(seqs[row].prompt_token_ids)
        output = torch.tensor(seqs[row].output_token_ids, dtype=torch.long)
        seen = torch.bincount(torch.cat([prompt, output]), minlength=vocab) > 0
        counts = torch.bincount(output, minlength=vocab).to(out.dtype)
        rep = torch.where(seq < 0, seq * p.repetition_penalty, seq / p.repetition_penalty)
        seq.copy_(torch.where(seen, rep, seq))
        seq -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def run_setting(name: str, args: argparse.Namespace) -> tuple[float, bool]:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=None, **SETTINGS[name])
    seqs = [
        Sequence(
            str(i), [rng.randrange(args.vocab) for _ in range(args.prompt_tokens)], params, 10**6
        )
        for i in range(args.batch)
    ]
    sampler, counts = Sampler([0]), TokenCounts(args.vocab, "cpu")
    times, exact = [], True
    for step in range(args.steps):
        logits = torch.randn(args.batch, args.vocab, generator=gen)
        if step == args.steps - 1 and params.has_penalties:  # correctness first (untimed)
            want = dense_reference(logits, seqs, params).argmax(-1).tolist()
            pen = counts.inputs(seqs)
            got = sampler.sample(
                logits.clone(),
                [params] * args.batch,
                [None] * args.batch,
                [s.num_output_tokens for s in seqs],
                pen,
            ).token_ids
            exact = list(got) == want
        t = time.perf_counter()
        pen = counts.inputs(seqs) if params.has_penalties else None
        out = sampler.sample(
            logits,
            [params] * args.batch,
            [None] * args.batch,
            [s.num_output_tokens for s in seqs],
            pen,
        )
        times.append(time.perf_counter() - t)
        for seq, token in zip(seqs, out.token_ids, strict=True):
            seq.append_token(token)
    return statistics.median(times[3:]) * 1e3, exact


def main(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    print(
        f"sampler step: batch {args.batch}, vocabulary {args.vocab}, {args.prompt_tokens}-token "
        f"prompts, {args.steps} greedy steps, {torch.get_num_threads()} thread(s)"
    )
    results = {name: run_setting(name, args) for name in SETTINGS}
    plain = results["plain"][0]
    for name, (ms, exact) in results.items():
        check = "" if name == "plain" else ("  = dense reference" if exact else "  DIFFERS")
        print(f"  {name:20s} {ms:7.2f} ms  {ms / plain:5.2f}x plain{check}")
    return 0 if all(exact for _, exact in results.values()) else 1
