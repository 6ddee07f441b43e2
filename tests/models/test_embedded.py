"""The embedded SmolLM2-135M-Instruct (GGUF -> safetensors) against transformers.

Runs in CI (not marked slow). The first run converts the GGUF (~30 s) into the session cache
directory (``$BLENDKV_CACHE`` or ``~/.cache/blendkv``, see conftest); later runs reuse it.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from blendkv.kernels.torch_attention import TorchAttentionBackend
from blendkv.models import model_files
from blendkv.models.model_files import (
    CONVERTED_MARKER,
    embedded_gguf_path,
    load_model,
    load_tokenizer,
    resolve_model,
)

IM_START, IM_END = 1, 2


@pytest.fixture(scope="module")
def embedded(blendkv_cache_dir):
    resolved = resolve_model(None, cache_dir=blendkv_cache_dir)
    ours = load_model(resolved, torch.float32, TorchAttentionBackend())
    hf = transformers.LlamaForCausalLM.from_pretrained(resolved.model_dir, dtype=torch.float32)
    return resolved, ours, hf.eval(), load_tokenizer(resolved)


def test_resolve_reuses_conversion(embedded, blendkv_cache_dir, monkeypatch, tmp_path):
    resolved = embedded[0]
    marker = resolved.model_dir / CONVERTED_MARKER
    mtime = marker.stat().st_mtime_ns

    def no_conversion(*args):
        raise AssertionError("GGUF converted again")

    monkeypatch.setattr(model_files, "_convert_gguf", no_conversion)
    again = resolve_model(None, cache_dir=blendkv_cache_dir)
    assert again == resolved and marker.stat().st_mtime_ns == mtime
    # A directory holding the same GGUF file shares the conversion.
    (tmp_path / "gguf").mkdir()
    gguf = embedded_gguf_path()
    (tmp_path / "gguf" / gguf.name).symlink_to(gguf)
    by_dir = resolve_model(tmp_path / "gguf", cache_dir=blendkv_cache_dir)
    assert by_dir.model_dir == resolved.model_dir and by_dir.name == gguf.stem


def test_tokenizer_and_generation_config(embedded):
    resolved, ours, hf, tok = embedded
    assert resolved.name == "SmolLM2-135M-Instruct"
    assert ours.config.architectures == ["LlamaForCausalLM"] and ours.config.tie_word_embeddings
    assert not hasattr(ours.config, "quantization_config")
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START, IM_END]
    assert (tok.bos_token_id, tok.eos_token_id) == (IM_START, IM_END)
    assert tok("hello").input_ids[0] != IM_START  # no BOS added: the chat template has it
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_end|>\n<|im_start|>user\nHi<|im_end|>" in text
    gen = transformers.GenerationConfig.from_pretrained(resolved.model_dir)
    assert gen.eos_token_id == IM_END


@torch.no_grad()
def test_prefill_logits_and_paged_greedy_decode_match_hf(embedded, paged_kv):
    _, ours, hf, tok = embedded
    messages = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert 30 <= len(ids) <= 60

    expected = hf(torch.tensor([ids])).logits[0]
    dense = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids)), None, None))
    assert (dense - expected).abs().max() < 1e-3

    kv = paged_kv(ours.config, num_blocks=24, block_size=4)
    table = list(range(23, 0, -1))  # descending: nothing works by accident of ordering
    md = kv.metadata([(list(range(len(ids))), len(ids), table)])
    hidden = ours(torch.tensor(ids), md.positions, kv.kv_caches, md)
    tokens = list(ids)
    hf_out = hf(torch.tensor([ids]), use_cache=True)  # HF's own incremental decode as oracle
    for _ in range(8):
        logits = ours.compute_logits(hidden[-1:])[0]
        hf_logits = hf_out.logits[0, -1]
        assert (logits - hf_logits).abs().max() < 1e-3
        assert int(logits.argmax()) == int(hf_logits.argmax())
        tokens.append(int(logits.argmax()))
        hf_out = hf(
            torch.tensor([tokens[-1:]]), past_key_values=hf_out.past_key_values, use_cache=True
        )
        n = len(tokens)
        md = kv.metadata([([n - 1], n, table)])
        hidden = ours(torch.tensor(tokens[-1:]), md.positions, kv.kv_caches, md)
    assert len(set(tokens[len(ids) :])) > 1  # a real continuation, not one repeated token
