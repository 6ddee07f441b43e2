"""Test helpers: tiny random checkpoints with a real byte-level BPE tokenizer on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from blendkv import LLM
from blendkv.eval import random_model
from blendkv.eval.bench.engine import hf_greedy  # noqa: F401  (re-exported for tests)

# Behaviour switches a test's engine runs without unless the test asks for them, set through
# config (never the environment): no warm-up request at load (the suite builds many engines and
# times none of their first requests), no start gate (tests that want it ask for it), no cost
# check and no time budget of steps (measured rates would turn tests' default blends into full
# prefill, and split their prompts, at random).
QUIET = {
    "warmup": False,
    "blend_start_gate": False,
    "blend_cost_check": False,
    "max_step_latency": None,
    # Half the default pool: 11K tokens of the embedded model in float32, more than one
    # sequence of max_model_len; each engine zeroes its pool, and a worker holds several.
    "kv_cache_memory_bytes": 512 << 20,
}
# The same for a command that loads a model (``blendkv.cli.main`` or a spawned ``blendkv``).
QUIET_FLAGS = (
    "--no-warmup",
    "--no-blend-start-gate",
    "--no-blend-cost-check",
    "--max-step-latency",
    "none",
)


class QuietLLM(LLM):
    """:class:`blendkv.LLM` with :data:`QUIET`'s settings unless given otherwise."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        super().__init__(model, **{**QUIET, **kwargs})


TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=1,
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join while others decode.",
    "CacheBlend recomputes a few tokens to restore cross-attention.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Emoji 😀 and café and 東京 test multi-byte characters.",
]


def make_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    return random_model.make_tokenizer(vocab_size, _CORPUS * 20)


def make_tiny_model_dir(path: Path, arch: str = "llama", **overrides) -> Path:
    """Save a random-weight ``arch`` ("llama" or "qwen2") model plus tokenizer to ``path``."""
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    config = cfg_cls(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = model_cls(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peaky logits: greedy ties between implementations stay unlikely
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    model.save_pretrained(path, safe_serialization=True)
    tok = make_tokenizer(config.vocab_size)
    assert len(tok) <= config.vocab_size
    tok.save_pretrained(path)
    return path


BLEND_DOCS = [
    "Paris is the capital of France. The Seine flows through Paris. " * 2,
    "Berlin is the capital of Germany. It has many museums and parks.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
]
BLEND_QUERY = "Which city is the capital of France?"


def blend_llm(path, store, pipelined: bool | None, **options):
    """An engine on ``path``'s tiny model for the loading tests: float32, blocks of 4, no
    prefix cache, its chunk store in ``store`` (``options``: more of its options)."""
    return QuietLLM(
        str(path),
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,
        kv_store_dir=str(store),
        pipeline_kv_load=pipelined,
        **options,
    )


def standalone_chunk_kv(hf, anchor, chunk):
    """Pre-RoPE K and V of ``chunk`` prefilled behind ``anchor``, captured from transformers."""
    captured = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        for name in ("k_proj", "v_proj"):
            mod = getattr(layer.self_attn, name)
            hooks.append(
                mod.register_forward_hook(
                    lambda m, inp, out, i=i, name=name: captured.__setitem__((i, name), out[0])
                )
            )
    with torch.no_grad():
        hf(torch.tensor([anchor + chunk]))
    for h in hooks:
        h.remove()
    cfg = hf.config
    hd = (
        cfg.hidden_size // cfg.num_attention_heads
        if not getattr(cfg, "head_dim", None)
        else cfg.head_dim
    )
    shape = (-1, cfg.num_key_value_heads, hd)
    n = len(anchor)
    return [
        (captured[(i, "k_proj")].view(shape)[n:], captured[(i, "v_proj")].view(shape)[n:])
        for i in range(cfg.num_hidden_layers)
    ]


def reference_full_reuse_logits(hf, manager, state, contexts=None):
    """transformers: prefix normally, then the standalone chunk K/V (each behind
    ``contexts[i]``, default the anchor) with RoPE at the fused positions appended to its cache,
    then only the query/suffix rows."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    p = state.prompt
    ids = p.token_ids
    cache = transformers.DynamicCache()
    with torch.no_grad():
        hf(torch.tensor([ids[: p.prefix_len]]), past_key_values=cache, use_cache=True)
        contexts = contexts or [manager.anchor_ids] * len(p.chunks)
        for chunk, ctx, (s, e) in zip(p.chunks, contexts, p.chunk_spans, strict=True):
            kv = standalone_chunk_kv(hf, ctx, chunk)
            pos = torch.arange(s, e)[None]
            dummy = torch.zeros(1, e - s, 1)
            cos, sin = hf.model.rotary_emb(dummy, pos)
            for layer, (k, v) in enumerate(kv):
                k4 = k.transpose(0, 1)[None]  # [1, H, T, D]
                k4, _ = apply_rotary_pos_emb(k4, k4, cos, sin)
                cache.update(k4, v.transpose(0, 1)[None], layer)
        rest = torch.tensor([ids[p.query_start :]])
        pos = torch.arange(p.query_start, len(ids))[None]
        out = hf(rest, past_key_values=cache, position_ids=pos, use_cache=True)
    return out.logits[0].float()


def has_cpp_compiler() -> bool:
    """The C++ CPU kernels (and torch.compile on the CPU) are built at run time."""
    from blendkv.kernels.cpu_extension import find_compiler

    return find_compiler() is not None


needs_cpp_compiler = pytest.mark.skipif(
    not has_cpp_compiler(), reason="no C++ compiler to build the CPU kernels on this machine"
)


def dense_attention_reference(q, k, v, q_positions, scale):
    """The attention oracle: q [Lq, Hq, D] at ``q_positions`` over keys 0..Lk-1 (GQA by
    repetition), an explicit softmax over each row's keys, float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(k.shape[0])[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
