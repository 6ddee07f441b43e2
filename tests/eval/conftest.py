from __future__ import annotations

import pytest
from helpers import make_tiny_model_dir


@pytest.fixture(scope="session")
def eval_model_dir(tmp_path_factory):
    """A tiny random Llama for the ``blendkv eval`` plumbing: long enough for the synthetic
    examples' prompts (the embedded model's quality is tests/blend/test_blend_quality's)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("eval-model"), max_position_embeddings=4096)
