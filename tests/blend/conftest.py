from __future__ import annotations

import pytest
import torch
import transformers

from blendkv import LLM


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_dir(request):
    return request.param, request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def blend_llm(arch_dir):
    _, path = arch_dir
    llm = LLM(str(path), dtype="float32", block_size=4, enable_prefix_caching=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def hf_model(arch_dir):
    _, path = arch_dir
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
