"""Tiny random checkpoints: our model vs transformers' on dense, paged and scattered passes."""

from __future__ import annotations

import pytest
import torch
import transformers

from blendkv.kernels.torch_attention import TorchAttentionBackend
from blendkv.models.model_files import load_model, resolve_model

ATOL = 1e-5

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)

CONFIGS = {
    "llama-tied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama-untied": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=False, attention_bias=True
    ),
    "llama3-rope": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE
    ),
    "mistral": lambda: transformers.MistralConfig(
        **COMMON, tie_word_embeddings=False, sliding_window=None
    ),
    "qwen2-untied": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen2-tied": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
}
HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
}


def _randomize(model: torch.nn.Module) -> None:
    """Weights large enough that logits are O(1-10) and every parameter matters (HF's init
    leaves norms at 1 and biases at 0, which would hide a skipped norm weight or bias)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(HF model, our model loaded through the loader from HF's save_pretrained output)."""
    config = CONFIGS[request.param]()
    torch.manual_seed(0)
    hf = HF_CLASSES[config.model_type](config).eval()
    _randomize(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    ours = load_model(resolve_model(path), torch.float32, TorchAttentionBackend())
    return hf, ours


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def test_loaded_parameters_match_checkpoint(pair):
    hf, ours = pair
    hf_params = dict(hf.named_parameters())
    our_params = dict(ours.named_parameters())
    assert sorted(our_params) == sorted(hf_params)
    for name, p in our_params.items():
        assert torch.equal(p, hf_params[name]), name
    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


@torch.no_grad()
def test_dense_prefill_matches_hf(pair):
    hf, ours = pair
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (23,), generator=gen)
    expected = hf_logits(hf, ids.tolist())
    hidden = ours(ids, torch.arange(23), None, None)
    logits = ours.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert expected.abs().max() > 1.0  # the comparison below is not vacuous
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_paged_chunked_prefill_and_batched_decode(pair, paged_kv):
    """Seq A: 11-token prompt in two chunks (7 + 4); seq B: 6-token prompt; then both decode
    greedily, batched in one step. Every computed row must equal HF's full-sequence logits."""
    hf, ours = pair
    kv = paged_kv(ours.config, num_blocks=16, block_size=4)
    gen = torch.Generator().manual_seed(2)
    tokens = {
        "A": torch.randint(0, 300, (11,), generator=gen).tolist(),
        "B": torch.randint(0, 300, (6,), generator=gen).tolist(),
    }
    tables = {"A": [7, 2, 12, 4, 9], "B": [3, 14, 1, 8]}  # non-contiguous, interleaved
    computed = {"A": 0, "B": 0}  # num_computed_tokens

    def step(plan: dict[str, int]) -> None:
        """Run ``plan[seq]`` new tokens of each sequence in one batch; greedy-append on
        sequences whose whole context is computed afterwards."""
        ids, seqs = [], []
        for name, n in plan.items():
            lo = computed[name]
            ids += tokens[name][lo : lo + n]
            seqs.append((list(range(lo, lo + n)), lo + n, tables[name]))
        md = kv.metadata(seqs)
        logits = ours.compute_logits(ours(torch.tensor(ids), md.positions, kv.kv_caches, md))
        for i, (name, n) in enumerate(plan.items()):
            lo = computed[name]
            rows = logits[md.query_start_loc_cpu[i] : md.query_start_loc_cpu[i + 1]]
            expected = hf_logits(hf, tokens[name][: lo + n])[lo : lo + n]
            torch.testing.assert_close(rows, expected, atol=ATOL, rtol=0)
            computed[name] = lo + n
            if computed[name] == len(tokens[name]):
                tokens[name].append(int(rows[-1].argmax()))

    step({"A": 7, "B": 6})  # A's first chunk and B's whole prompt
    step({"A": 4, "B": 1})  # A's last chunk next to B's first decode
    for _ in range(5):
        step({"B": 1, "A": 1})  # batched decodes, different context lengths
    assert len(tokens["A"]) == 11 + 6 and len(tokens["B"]) == 6 + 7
    assert computed == {"A": 16, "B": 12}


@torch.no_grad()
def test_scattered_recompute_rows_match_dense(pair, paged_kv):
    """CacheBlend-style: recompute rows 2, 5, 9 of a cached sequence (their old K/V clobbered
    first); the rows must equal the dense pass's rows."""
    hf, ours = pair
    kv = paged_kv(ours.config, num_blocks=8, block_size=4)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (12,), generator=gen)
    table = [5, 1, 6]
    dense = ours.compute_logits(ours(ids, torch.arange(12), None, None))

    md = kv.metadata([(list(range(12)), 12, table)])
    ours(ids, md.positions, kv.kv_caches, md)
    rows = [2, 5, 9]
    md = kv.metadata([(rows, 12, table)])
    assert md.is_contiguous_prefill == [False]
    for cache in kv.kv_caches:
        cache.view(2, -1, *cache.shape[3:])[:, md.slot_mapping] = 1e3
    logits = ours.compute_logits(ours(ids[rows], md.positions, kv.kv_caches, md))
    torch.testing.assert_close(logits, dense[rows], atol=ATOL, rtol=0)
    torch.testing.assert_close(dense, hf_logits(hf, ids.tolist()), atol=ATOL, rtol=0)
