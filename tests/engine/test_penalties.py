"""Penalties and logit_bias: against transformers' ``generate`` and a dense reference.

repetition_penalty and logit_bias are transformers' own processors (``repetition_penalty=``,
``sequence_bias=``); presence and frequency penalties (which transformers lacks) run as a dense
``LogitsProcessor`` written here from OpenAI's definition, inside the same ``generate``.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from helpers import QuietLLM

from blendkv import LLM, SamplingParams
from blendkv.engine.penalties import PenaltyInputs, TokenCounts, apply_penalties
from blendkv.engine.sampler import Sampler
from blendkv.engine.sequence import Sequence
from blendkv.errors import InvalidSamplingParamsError

MAX_TOKENS = 16
VOCAB = 320


def prompts(seed: int = 0, lengths: tuple[int, ...] = (5, 23, 11, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


class DensePresenceFrequency(transformers.LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens, one row at a time."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            generated = ids[self.prompt_len :]
            for token in set(generated):
                scores[row, token] -= self.frequency * generated.count(token)
                scores[row, token] -= self.presence
        return scores


def hf_generate(hf, prompt: list[int], seed: int | None = None, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    if seed is not None:
        torch.manual_seed(seed)
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_TOKENS,
        eos_token_id=None,
        pad_token_id=0,
        top_k=0,
        top_p=1.0,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def token_ids(llm: LLM, prompts_: list[list[int]], params) -> list[list[int]]:
    outs = llm.generate(prompts_, params)
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


# ------------------------------------------------------------------ against transformers
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_greedy_matches_transformers(llm, hf, penalty):
    ps = prompts()
    refs = [hf_generate(hf, p, do_sample=False, repetition_penalty=penalty) for p in ps]
    plain = [hf_generate(hf, p, do_sample=False) for p in ps]
    assert refs != plain, "the penalty must change the reference, or the test proves nothing"
    assert token_ids(llm, ps, greedy(repetition_penalty=penalty)) == refs


def test_repetition_penalty_seeded_sampling_matches_transformers(llm, hf):
    ps = prompts(1)
    params = [
        SamplingParams(
            temperature=0.8,
            seed=10 + i,
            repetition_penalty=1.5,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
        )
        for i in range(len(ps))
    ]
    refs = [
        hf_generate(hf, p, seed=10 + i, do_sample=True, temperature=0.8, repetition_penalty=1.5)
        for i, p in enumerate(ps)
    ]
    plain = [
        hf_generate(hf, p, seed=10 + i, do_sample=True, temperature=0.8) for i, p in enumerate(ps)
    ]
    assert refs != plain
    assert token_ids(llm, ps, params) == refs


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.9), (0.6, 1.2)])
def test_presence_frequency_greedy_match_dense_reference(llm, hf, presence, frequency):
    ps = prompts(2)
    refs = [
        hf_generate(
            hf,
            p,
            do_sample=False,
            logits_processor=[DensePresenceFrequency(len(p), presence, frequency)],
        )
        for p in ps
    ]
    assert refs != [hf_generate(hf, p, do_sample=False) for p in ps]
    params = greedy(presence_penalty=presence, frequency_penalty=frequency)
    assert token_ids(llm, ps, params) == refs


def test_logit_bias_matches_transformers_sequence_bias(llm, hf):
    ps = prompts(3)
    bias = {7: 6.0, 42: 4.5, 100: -50.0}
    refs = [
        hf_generate(hf, p, do_sample=False, sequence_bias={(t,): b for t, b in bias.items()})
        for p in ps
    ]
    assert refs != [hf_generate(hf, p, do_sample=False) for p in ps]
    assert token_ids(llm, ps, greedy(logit_bias=bias)) == refs


def test_all_together_match_transformers_plus_dense(llm, hf):
    """Bias, then repetition, then presence/frequency: the order of both libraries."""
    ps = prompts(4)
    bias = {9: 3.0, 11: 2.0}
    refs = [
        hf_generate(
            hf,
            p,
            do_sample=False,
            repetition_penalty=1.2,
            sequence_bias={(t,): b for t, b in bias.items()},
            logits_processor=[DensePresenceFrequency(len(p), 0.4, 0.3)],
        )
        for p in ps
    ]
    params = greedy(
        logit_bias=bias, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3
    )
    assert token_ids(llm, ps, params) == refs


# ------------------------------------------------------------------ engine behaviour
def test_penalised_and_plain_requests_share_a_batch(llm):
    ps = prompts(5)
    plain = token_ids(llm, ps, greedy())
    penalised = [token_ids(llm, [p], greedy(frequency_penalty=1.0))[0] for p in ps]
    assert penalised != plain
    mixed = [greedy(frequency_penalty=1.0) if i % 2 else greedy() for i in range(len(ps))]
    expected = [penalised[i] if i % 2 else plain[i] for i in range(len(ps))]
    assert token_ids(llm, ps, mixed) == expected
    counts = llm.engine.runner.token_counts
    assert counts.slots == {} and counts.num_counted == {}  # released on finish
    counts.check_integrity()


def test_penalties_survive_preemption(tiny_llama_dir):
    ps = prompts(6, (9, 17, 40, 25))
    params = greedy(repetition_penalty=1.4, presence_penalty=0.5)
    roomy = QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    tight = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=24,
        block_size=4,
        max_num_batched_tokens=64,
    )
    outs = tight.generate(ps, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs] == token_ids(roomy, ps, params)


def test_logprobs_stay_those_of_the_model(llm):
    [p] = prompts(7, (12,))
    plain = llm.generate([p], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    top = plain.outputs[0].logprobs[0]  # token id -> logprob: the argmax and the top 5
    forced_id = next(t for t in range(2, VOCAB) if t not in top)
    params = SamplingParams(
        temperature=0,
        max_tokens=1,
        logprobs=5,
        logit_bias={forced_id: 100.0},
        repetition_penalty=1.5,
        presence_penalty=1.0,
    )
    biased = llm.generate([p], params)[0].outputs[0]
    assert biased.token_ids == [forced_id]
    # The top 5 are the model's, and the forced token reports its unbiased (small) logprob.
    assert {t: v for t, v in biased.logprobs[0].items() if t != forced_id} == top
    assert biased.logprobs[0][forced_id] < min(top.values())


def test_logit_bias_outside_vocab_is_refused_at_request_time(llm):
    with pytest.raises(InvalidSamplingParamsError, match=r"logit_bias.*\[0, 320\).*\[320\]"):
        llm.generate([[5, 6, 7]], greedy(logit_bias={3: 1.0, 320: 1.0}))
    assert not llm.engine.has_unfinished_requests()


# ------------------------------------------------------------------ units
def dense_penalties(logits, prompt_ids, output_ids, rep, presence, frequency):
    out = logits.clone()
    for t in set(prompt_ids) | set(output_ids):
        out[t] = out[t] * rep if out[t] < 0 else out[t] / rep
    for t in set(output_ids):
        out[t] -= frequency * output_ids.count(t)
        out[t] -= presence
    return out


def make_seq(rid: str, prompt: list[int], outputs: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence(rid, prompt, params, max_output_tokens=100)
    seq.output_token_ids = list(outputs)
    return seq


def test_apply_penalties_matches_dense_per_row():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    params = [
        SamplingParams(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=-0.3),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.6),
        SamplingParams(frequency_penalty=2.0),
    ]
    seqs = [
        make_seq(
            str(i),
            [rng.randrange(vocab) for _ in range(8)],
            [rng.randrange(vocab) for _ in range(12)],
            p,
        )
        for i, p in enumerate(params)
    ]
    counts = TokenCounts(vocab, "cpu")
    inputs = counts.inputs(seqs)
    assert inputs.rows == [0, 2, 3]
    logits = torch.randn(4, vocab, generator=gen)
    got = logits.clone()
    apply_penalties(got, params, inputs)
    for i, (seq, p) in enumerate(zip(seqs, params, strict=True)):
        want = dense_penalties(
            logits[i],
            seq.prompt_token_ids,
            seq.output_token_ids,
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        )
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)


def seen(inputs: PenaltyInputs, row: int) -> dict[int, int]:
    """Row ``row``'s seen tokens -> output counts (padding repeats collapse into one)."""
    ids, counts = inputs.token_ids[row].tolist(), inputs.output_counts[row].tolist()
    return dict(zip(ids, counts, strict=True))


def test_token_counts_slots_catch_up_and_reuse():
    params = SamplingParams(frequency_penalty=1.0)
    counts = TokenCounts(10, "cpu")
    a = make_seq("a", [1, 2, 2], [], params)
    b = make_seq("b", [3], [4, 4], params)
    inputs = counts.inputs([a, b])
    assert counts.slots == {"a": 0, "b": 1} and counts.token_ids.shape == (8, 16)
    assert inputs.token_ids.shape == (2, 2)  # the most distinct tokens of a row
    assert seen(inputs, 0) == {1: 0, 2: 0} and seen(inputs, 1) == {3: 0, 4: 2}
    assert inputs.token_ids[1].tolist() == [3, 4]
    a.output_token_ids += [5]
    b.output_token_ids += [4, 6]  # two steps' tokens at once: both are added
    inputs = counts.inputs([b, a])
    assert inputs.token_ids.tolist() == [[3, 4, 6], [1, 2, 5]]
    assert inputs.output_counts.tolist() == [[0, 3, 1], [0, 0, 1]]
    counts.release("a")
    c = make_seq("c", [9], [], params)
    inputs = counts.inputs([c])
    assert counts.slots["c"] == 0  # a's slot, zeroed
    assert seen(inputs, 0) == {9: 0}
    for i in range(20):  # grows past the first 8 slots
        counts.inputs([make_seq(f"x{i}", [1], [2], params)])
    assert counts.token_ids.shape[0] == 32
    long = make_seq("long", list(range(40)), [7], params)  # grows the width, keeps the rest
    inputs = counts.inputs([long, b])
    assert counts.width == 40 and seen(inputs, 1) == {3: 0, 4: 3, 6: 1}
    assert inputs.token_ids[1, 3:].eq(3).all()  # padded with its first token
    counts.check_integrity()
    assert counts.inputs([make_seq("plain", [1], [1], SamplingParams())]) is None


def dense_apply_penalties(logits, params, prompts, outputs):
    """The whole-vocabulary form (masks and counts over every token), as an exact oracle."""
    out = logits.clone()
    vocab = logits.shape[-1]
    for i, (p, prompt, output) in enumerate(zip(params, prompts, outputs, strict=True)):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)
        counts = counts.to(torch.int32).unsqueeze(0)
        mask = torch.zeros(1, vocab, dtype=torch.bool)
        mask[0, prompt] = True
        row = out[i : i + 1]
        r = torch.tensor([p.repetition_penalty]).unsqueeze(1)
        row = torch.where(mask | (counts > 0), torch.where(row < 0, row * r, row / r), row)
        row -= torch.tensor([p.frequency_penalty]).unsqueeze(1) * counts
        row -= torch.tensor([p.presence_penalty]).unsqueeze(1) * (counts > 0)
        out[i] = row[0]
    return out


def test_seen_token_penalties_equal_the_whole_vocabulary_form_bit_for_bit():
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    vocab = 300
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.1),
        SamplingParams(presence_penalty=2.0),
    ]
    seqs = [
        make_seq(
            str(i),
            [rng.randrange(vocab) for _ in range(n)],
            [rng.randrange(vocab) for _ in range(m)],
            p,
        )
        for i, (p, n, m) in enumerate(zip(params, (90, 7, 30), (40, 3, 60), strict=True))
    ]
    logits = torch.randn(3, vocab, generator=gen) * 4
    logits[0, seqs[0].prompt_token_ids[0]] = 0.0  # zero is divided (transformers' form)
    got = logits.clone()
    apply_penalties(got, params, TokenCounts(vocab, "cpu").inputs(seqs))
    want = dense_apply_penalties(
        logits, params, [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs]
    )
    assert torch.equal(got, want)


def test_sampler_refuses_penalised_rows_without_counts():
    with pytest.raises(AssertionError, match="counts"):
        Sampler().sample(torch.zeros(1, 5), [SamplingParams(presence_penalty=1.0)], [None], [0])
    ids = torch.tensor([[1, 3]])
    counts = torch.tensor([[0, 2]], dtype=torch.int32)
    inputs = PenaltyInputs([0], ids, counts)
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.5]])
    params = [SamplingParams(temperature=0, frequency_penalty=0.5)]
    assert Sampler().sample(logits, params, [None], [0], inputs).token_ids == [4]


# ------------------------------------------------------------------ command line
def test_cli_penalty_flags_reach_sampling_params(capsys):
    from blendkv.cli import build_parser, main
    from blendkv.commands.generate import sampling_params

    flags = [
        "--repetition-penalty",
        "1.3",
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "-1",
    ]
    for command in (["generate", "hi"], ["chat"]):
        params = sampling_params(build_parser().parse_args([*command, *flags]))
        assert (params.repetition_penalty, params.presence_penalty) == (1.3, 0.5)
        assert params.frequency_penalty == -1.0
    ask = build_parser().parse_args(["ask", "q", "--store", "s", "--repetition-penalty", "1.2"])
    assert ask.repetition_penalty == 1.2
    # A bad value is refused before any model loads.
    assert main(["generate", "hi", "--model", "/nonexistent", "--presence-penalty", "3"]) == 2
    assert "presence_penalty" in capsys.readouterr().err
