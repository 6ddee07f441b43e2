from __future__ import annotations

import pytest
import torch

from blendkv.engine.penalties import TokenCounts
from blendkv.engine.sampler import Sampler, SamplerOutput, _filtered_sorted_probs
from blendkv.engine.sequence import Sequence
from blendkv.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits, params, generators=None, num_output_tokens=None, eos_token_ids=()):
    if generators is None:
        generators = [None] * len(params)
    if num_output_tokens is None:
        num_output_tokens = [0] * len(params)
    return Sampler(eos_token_ids).sample(logits, params, generators, num_output_tokens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(device, dtype):
    logits = torch.randn(7, 50, generator=gen(0)).to(device=device, dtype=dtype)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # tie -> lowest id
    out = sample(logits, [SamplingParams(temperature=0)] * 7)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[3] == 10
    assert out.logprobs == [None] * 7 and out.top_logprobs == [None] * 7


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_1_is_greedy_for_any_temperature(device):
    logits = torch.randn(6, 300, generator=gen(1)).to(device)
    logits[2, 5] = logits[2, 250] = logits[2].max() + 0.5
    for temperature in (0.01, 0.7, 1.0, 10.0, 1000.0):
        params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(6)]
        gens = [gen(i, device) for i in range(6)]
        assert sample(logits, params, gens).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_is_argmax():
    logits = torch.randn(5, 100, generator=gen(2))
    params = [SamplingParams(temperature=2.0, top_p=1e-6)] * 5
    for _ in range(3):
        assert sample(logits, params).token_ids == logits.argmax(-1).tolist()


PROBS = torch.tensor([0.05, 0.5, 0.1, 0.2, 0.15])  # sorted: 1, 3, 4, 2, 0


def support(params: SamplingParams, logits: torch.Tensor | None = None) -> set[int]:
    logits = PROBS.log() if logits is None else logits
    probs, order = _filtered_sorted_probs(logits.unsqueeze(0), [params])
    return set(order[0][probs[0] > 0].tolist())


def test_filters_exact_on_hand_built_distribution():
    assert support(SamplingParams()) == {0, 1, 2, 3, 4}
    # min-p 0.25: threshold 0.125 keeps 0.5, 0.2, 0.15; min-p 0.35: 0.175 keeps 0.5, 0.2.
    assert support(SamplingParams(min_p=0.25)) == {1, 3, 4}
    assert support(SamplingParams(min_p=0.35)) == {1, 3}
    assert support(SamplingParams(min_p=1.0)) == {1}
    assert support(SamplingParams(min_p=0.15)) == {1, 2, 3, 4}
    # top-p: cumulative 0.5, 0.7, 0.85, 0.95, 1.0 -> smallest prefix reaching p.
    assert support(SamplingParams(top_p=0.5)) == {1}
    assert support(SamplingParams(top_p=0.6)) == {1, 3}
    assert support(SamplingParams(top_p=0.8)) == {1, 3, 4}
    assert support(SamplingParams(top_p=0.9)) == {1, 2, 3, 4}
    assert support(SamplingParams(top_k=2)) == {1, 3}
    assert support(SamplingParams(top_k=100)) == {0, 1, 2, 3, 4}
    # top-p applies to the top-k renormalised distribution: 0.5/0.85 = 0.59 < 0.7.
    assert support(SamplingParams(top_k=3, top_p=0.7)) == {1, 3}
    # Ties at the top-k boundary keep the lowest ids.
    assert support(SamplingParams(top_k=2), torch.tensor([1.0, 2.0, 2.0, 2.0])) == {1, 2}


def test_filters_vectorised_per_row():
    params = [SamplingParams(min_p=0.25), SamplingParams(top_p=0.6), SamplingParams(top_k=1)]
    probs, order = _filtered_sorted_probs(PROBS.log().expand(3, 5), params)
    got = [set(order[i][probs[i] > 0].tolist()) for i in range(3)]
    assert got == [{1, 3, 4}, {1, 3}, {1}]


def test_min_p_sampling_stays_in_support_with_right_frequencies():
    params = [SamplingParams(min_p=0.25)] * 4000
    out = sample(PROBS.log().expand(4000, 5), params, [gen(3)] * 4000)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).float()
    assert counts[0] == 0 and counts[2] == 0
    expected = torch.tensor([0, 0.5, 0, 0.2, 0.15]) / 0.85 * 4000
    assert torch.allclose(counts, expected, atol=4000 * 0.03)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_reproducible_and_independent_of_batch(device):
    vocab = 1000
    target = torch.randn(vocab, generator=gen(4)).to(device)
    params = SamplingParams(temperature=1.3, top_p=0.95, top_k=500, seed=1234)

    def run(batch_size: int, position: int, other_seed: int) -> list[int]:
        others = torch.randn(batch_size, vocab, generator=gen(other_seed)).to(device)
        logits = others.clone()
        logits[position] = target
        all_params = [
            SamplingParams(temperature=0.9, seed=other_seed + i) for i in range(batch_size)
        ]
        all_params[position] = params
        gens = [gen(other_seed + i, device) for i in range(batch_size)]
        gens[position] = gen(params.seed, device)
        tokens = []
        for _ in range(20):  # 20 decode steps, the generator carries its state across steps
            tokens.append(sample(logits, all_params, gens).token_ids[position])
        return tokens

    alone = run(1, 0, 10)
    assert len(set(alone)) > 1  # really random
    assert run(5, 3, 11) == alone
    assert run(8, 7, 12) == alone
    assert run(3, 0, 13) == alone


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.5])
    temperature = 0.7
    n = 20000
    out = sample(logits.expand(n, 6), [SamplingParams(temperature=temperature)] * n, [gen(5)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).double()
    expected = torch.softmax(logits.double() / temperature, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom, p = 0.001
    # The test can fail: the untempered distribution is far off.
    wrong = torch.softmax(logits.double(), -1) * n
    assert float(((counts - wrong) ** 2 / wrong).sum()) > 100


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax(device):
    logits = torch.randn(4, 64, generator=gen(6)).to(device)
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0, logprobs=20),
    ]
    out = sample(logits, params, [gen(i, device) for i in range(4)])
    expected = torch.log_softmax(logits.float(), -1).cpu()
    for i in (0, 1, 3):
        assert out.logprobs[i] == pytest.approx(float(expected[i, out.token_ids[i]]), abs=1e-5)
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    assert out.top_logprobs[1] == []
    for i, n in ((0, 5), (3, 20)):
        top = out.top_logprobs[i]
        assert len(top) == n
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        ref_values, ref_ids = expected[i].topk(n)
        assert [t for t, _ in top] == ref_ids.tolist()
        assert values == pytest.approx(ref_values.tolist(), abs=1e-5)
    # Greedy with logprobs: the chosen token is the top one.
    assert out.top_logprobs[3][0][0] == out.token_ids[3]


def test_random_rows_never_pick_filtered_or_masked_tokens():
    logits = torch.randn(64, 200, generator=gen(7))
    logits[:, 100:] = float("-inf")  # e.g. padded vocabulary
    params = [SamplingParams(temperature=1.5, top_k=10)] * 64
    out = sample(logits, params, [gen(i) for i in range(64)])
    top10 = logits.topk(10, -1).indices
    for i, t in enumerate(out.token_ids):
        assert t in top10[i].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_keeps_eos_and_stop_ids_from_being_sampled(device):
    """vLLM's contract: under min_tokens, EOS and stop_token_ids are masked before sampling
    (greedy too, and whatever ignore_eos says); from min_tokens on they are sampled again."""
    eos, stop = 7, 11
    logits = torch.randn(4, 50, generator=gen(8))
    logits[:, eos] = 100.0  # every row wants EOS most, then the stop id
    logits[:, stop] = 90.0
    logits = logits.to(device)
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop]),
        SamplingParams(temperature=0, min_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.8, min_tokens=3, stop_token_ids=[stop], seed=1),
        SamplingParams(temperature=0),  # no min_tokens: untouched
    ]
    without = logits.clone()
    without[:, [eos, stop]] = float("-inf")
    for done in (0, 2):
        gens = [None, None, gen(1, device), None]
        out = sample(logits, params, gens, [done] * 4, eos_token_ids=(eos,))
        assert out.token_ids[0] == int(without[0].argmax())
        assert out.token_ids[1] == stop  # the request's own stop id is not masked here
        assert out.token_ids[2] not in (eos, stop)
        assert out.token_ids[3] == eos
    out = sample(logits, params, [None, None, gen(1, device), None], [3] * 4, (eos,))
    assert out.token_ids == [eos, eos, eos, eos]
    # The caller's logits are not modified by the mask.
    assert float(logits[0, eos]) == 100.0


def test_min_tokens_mask_never_draws_masked_ids_when_sampling():
    eos = 3
    logits = torch.zeros(2000, 8)
    logits[:, eos] = 5.0  # 95% of the mass on EOS
    params = [SamplingParams(temperature=1.0, top_p=0.99, min_tokens=1)] * 2000
    out = sample(logits, params, [gen(9)] * 2000, [0] * 2000, eos_token_ids=(eos, 99))
    assert eos not in out.token_ids and len(set(out.token_ids)) == 7


def test_logprobs_are_raw_under_the_min_tokens_mask():
    eos = 2
    logits = torch.randn(1, 40, generator=gen(10))
    logits[0, eos] = logits.max() + 3.0
    params = [SamplingParams(temperature=0, min_tokens=5, logprobs=3)]
    out = sample(logits, params, None, [0], eos_token_ids=(eos,))
    raw = torch.log_softmax(logits, -1)[0]
    assert out.token_ids[0] != eos
    assert out.logprobs[0] == pytest.approx(float(raw[out.token_ids[0]]), abs=1e-6)
    # EOS stays the most likely token of the reported (raw) distribution.
    assert out.top_logprobs[0][0] == (eos, pytest.approx(float(raw[eos]), abs=1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_bias_mask_and_penalties_in_vllm_order_on_every_row_kind(device):
    """logit_bias, then the min-tokens mask, then the penalties, then greedy/temperature: each
    row's choice equals the argmax of a dense reference; the caller's logits stay as given."""
    vocab, eos = 30, 1
    logits = torch.randn(4, vocab, generator=gen(11)).to(device)
    given = logits.clone()
    params = [
        SamplingParams(temperature=0, logit_bias={5: 8.0, eos: 50.0}, min_tokens=2),
        SamplingParams(temperature=0, repetition_penalty=3.0, frequency_penalty=0.5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, top_k=1, seed=0, presence_penalty=2.0, logit_bias={9: 3}),
    ]
    prompts = [[2, 3], [4, 5, 6], [7], [8, 9]]
    outputs = [[5], [int(logits[1].argmax())] * 2, [], [int(logits[3].argmax()), 9]]
    seqs = []
    for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs, strict=True)):
        seq = Sequence(str(i), prompt, p, max_output_tokens=10)
        seq.output_token_ids = out
        seqs.append(seq)
    penalties = TokenCounts(vocab, device).inputs(seqs)
    assert penalties.rows == [1, 3]
    got = Sampler((eos,)).sample(
        logits, params, [None, None, None, gen(0, device)], [len(o) for o in outputs], penalties
    )
    want = given.cpu().clone()
    for i, p in enumerate(params):
        for t, b in p.logit_bias.items():
            want[i, t] += b
    want[0, eos] = float("-inf")  # biased, but still short of min_tokens
    for i in (1, 3):
        p, seen = params[i], set(prompts[i]) | set(outputs[i])
        for t in seen:
            r = p.repetition_penalty
            want[i, t] = want[i, t] * r if want[i, t] < 0 else want[i, t] / r
        for t in set(outputs[i]):
            want[i, t] -= p.frequency_penalty * outputs[i].count(t) + p.presence_penalty
    assert got.token_ids == want.argmax(-1).tolist()
    assert got.token_ids[0] == 5 and got.token_ids[1] != outputs[1][0]
    assert torch.equal(logits, given)
