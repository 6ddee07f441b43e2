"""Facts found while starting the engine: the KV pool's size in blocks, ``max_model_len``, the
EOS ids. Never written back into the (frozen) :class:`~blendkv.config.EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blendkv.config import EngineConfig, resolve_kv_cache_memory_bytes
from blendkv.engine.model_runner import kv_block_bytes


@dataclass(frozen=True)
class RuntimeInfo:
    """Facts found while starting the engine (never written back into the config)."""

    model_name: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    device: str = "cpu"  # resolved from EngineConfig.device ("auto" -> cuda or cpu)
    dtype: str = "float32"  # resolved from EngineConfig.dtype


def runtime_info(
    config: EngineConfig,
    model: torch.nn.Module,
    tokenizer,
    model_name: str,
    device: str,
    dtype: str,
) -> RuntimeInfo:
    """The run-time facts of ``model`` loaded on ``device`` in ``dtype`` under ``config``."""
    cfg, conf = model.config, config
    model_max = getattr(cfg, "max_position_embeddings", None) or 1 << 30
    max_model_len = min(conf.max_model_len or model_max, model_max)
    # Never more blocks than max_num_seqs full-length sequences can hold: a small model would
    # otherwise zero a whole kv_cache_memory_bytes pool it can never fill.
    block_size = conf.cache.block_size
    most_needed = conf.scheduler.max_num_seqs * -(-max_model_len // block_size)
    num_blocks = conf.cache.num_kv_blocks or max(
        1,
        min(
            most_needed,
            resolve_kv_cache_memory_bytes(conf, device)
            // kv_block_bytes(cfg, block_size, getattr(torch, dtype)),
        ),
    )
    # One sequence must always fit in the whole pool, or preemption could never resolve.
    max_model_len = min(max_model_len, num_blocks * block_size)
    if not conf.scheduler.enable_chunked_prefill:
        max_model_len = min(max_model_len, conf.scheduler.max_num_batched_tokens)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return RuntimeInfo(
        model_name=model_name,
        architecture=(cfg.architectures or [type(model).__name__])[0],
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids(model, tokenizer),
        device=device,
        dtype=dtype,
    )


def eos_token_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    """The model's EOS ids: its generation config's, its config's, then the tokenizer's."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        ids.extend(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
