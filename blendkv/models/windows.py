"""Which decoder layers attend through a sliding window, from a model's config."""

from __future__ import annotations

from blendkv.errors import ModelLoadError


def layer_windows(config, applies: bool = True) -> list[int | None]:
    """Each layer's sliding window (a row attends to the ``window`` latest positions, itself
    included, as transformers' ``sliding_window``), None for a global layer.

    ``layer_types`` names the windowed layers (``"sliding_attention"``); without it every layer
    is windowed (Mistral). ``applies=False`` (a family that ignores the field): all None.
    """
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not applies or not window:
        return [None] * n
    types = getattr(config, "layer_types", None)
    if types is None:
        return [int(window)] * n
    if len(types) != n:
        raise ModelLoadError(f"layer_types has {len(types)} entries for {n} layers")
    return [int(window) if t == "sliding_attention" else None for t in types]
