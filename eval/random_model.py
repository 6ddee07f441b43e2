"""Random-weight checkpoints of real model shapes (no download): benchmarks and tests.

``save_random_model(dir, shape)`` writes a transformers checkpoint (config, safetensors) plus a
small byte-level BPE tokenizer, and returns the transformers model it saved (on ``device``) so a
benchmark can time transformers on the very same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

SHAPES: dict[str, tuple[str, dict]] = {
    # Llama-3.1-8B's config.
    "llama8b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
        ),
    ),
    # Qwen2.5-0.5B's config (QKV biases, tied embeddings).
    "qwen05": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    # Small enough for a CPU smoke run.
    "tiny": (
        "llama",
        dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
        ),
    ),
}

WORDS = (
    "the capital of France is Paris and the river Seine flows through the city while Berlin "
    "is the capital of Germany with many museums parks bridges and old streets where people "
    "walk at night under bright lamps near the water in winter and summer alike"
).split()


def make_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer trained on ``corpus`` (default :data:`WORDS`); any text
    encodes."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus or [" ".join(WORDS)] * 20, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )


def save_random_model(
    path: Path, shape: str, dtype: torch.dtype, device: str, seed: int = 0, **overrides
) -> torch.nn.Module:
    """Write a random ``shape`` checkpoint (config fields replaced by ``overrides``) to ``path``;
    return the transformers model."""
    import transformers

    arch, fields = SHAPES[shape]
    fields = {**fields, **overrides}
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    config = config_cls(**fields, bos_token_id=0, eos_token_id=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config).to(dtype).eval()
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(min(512, config.vocab_size)).save_pretrained(path)
    return model


def random_text(num_words: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), (num_words,), generator=g).tolist()
    return " ".join(WORDS[i] for i in picks)
