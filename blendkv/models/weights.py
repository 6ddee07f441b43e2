"""Checkpoint tensors into a model's parameters, by name (``LlamaForCausalLM.load_weights``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from blendkv.errors import ModelLoadError

# Checkpoint entries that are not parameters (old transformers saved the RoPE buffer).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@torch.no_grad()
def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into ``model``'s parameters by name (cast to each parameter's
    dtype); a parameter on the ``meta`` device becomes the checkpoint tensor itself. With tied
    embeddings a stored ``lm_head.weight`` is skipped. Raises ModelLoadError naming unexpected,
    shape-mismatched or missing keys."""
    params = dict(model.named_parameters())  # tied lm_head is de-duplicated away
    loaded: set[str] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.tie_word_embeddings:
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(name)
        elif tuple(param.shape) != tuple(tensor.shape):
            mismatched.append(
                f"{name}: checkpoint {tuple(tensor.shape)} != model {tuple(param.shape)}"
            )
        else:
            _set_param(model, name, param, tensor)
            loaded.add(name)
    model.tie_weights()
    missing = sorted(set(params) - loaded)
    problems = []
    if unexpected:
        problems.append(f"unexpected keys {_head(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches {_head(mismatched)}")
    if missing:
        problems.append(f"missing keys {_head(missing)}")
    if problems:
        raise ModelLoadError(
            f"checkpoint does not match {type(model).__name__} "
            f"({model.config.num_hidden_layers} layers): " + "; ".join(problems)
        )


def _set_param(model: nn.Module, name: str, param: nn.Parameter, tensor: torch.Tensor) -> None:
    if not param.is_meta:
        param.copy_(tensor)
        return
    module_name, _, attr = name.rpartition(".")
    tensor = tensor.to(param.dtype)
    setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))


def _head(names: list[str], n: int = 5) -> str:
    shown = ", ".join(names[:n])
    return f"[{shown}{f', ... ({len(names)} total)' if len(names) > n else ''}]"
