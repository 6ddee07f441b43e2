"""Device kernels a request launches, counted without a GPU.

    blendkv bench launches [--layers 32] [--docs 10] [--ratio 0.15]

On a GPU a blended prefill computes few rows per layer, so its time is the host's: one launch
per kernel, a few microseconds each. This counts those launches for one blended request, one
full reuse and one full prefill of the same tokens, on a random-weight model with the given
number of layers, the Triton attention backend (on the CPU under ``TRITON_INTERPRET=1``), warm
chunk store: every aten op that would run a kernel (views, allocations and metadata-only ops
excluded) plus every Triton launch, and the ops that make the host wait for the device
(``.item()``, ``.cpu()`` / ``.tolist()`` of a device tensor, ``nonzero``). The counts depend on the
code path, not on widths or token counts (within a prompt's few hundred tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

# Read at @triton.jit: set before anything imports triton (transformers may).
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# aten ops that launch nothing on a GPU (views, allocations, metadata)
_NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view",
    "_unsafe_view", "as_strided", "alias", "slice", "select", "expand", "permute", "transpose",
    "t", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "detach",
    "lift_fresh", "_reshape_alias", "resize_", "unfold", "diagonal", "view_as_real",
    "set_", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "result_type", "_has_compatible_shallow_copy_type", "is_nonzero", "record_stream",
    # composites seen before they lower: their copies show up as _to_copy / clone / copy_
    "to", "reshape", "contiguous", "detach_",
}  # fmt: skip
# ops whose result the host reads (a device sync on a GPU)
_SYNCS = {"_local_scalar_dense", "nonzero", "item"}


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = func.__name__.split(".")[0]
            if name not in _NO_KERNEL:
                self.ops[name] += 1
            if name in _SYNCS:
                self.syncs += 1
        return func(*args, **(kwargs or {}))


def _count(run) -> dict:
    """Count one call of ``run``: aten kernels, Triton launches, host syncs."""
    from triton.runtime import interpreter

    counter = _Counter()
    triton_launches: Counter[str] = Counter()
    original = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        triton_launches[self.fn.__name__] += 1
        counter.paused = True  # the interpreter's own host copies are not the kernel's
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.paused = False

    interpreter.InterpretedFunction.run = counted
    try:
        with counter:
            run()
    finally:
        interpreter.InterpretedFunction.run = original
    aten = sum(counter.ops.values())
    triton = sum(triton_launches.values())
    return {
        "launches": aten + triton,
        "aten_kernels": aten,
        "triton_launches": triton,
        "host_syncs": counter.syncs,
        "top_aten": dict(counter.ops.most_common(12)),
        "triton": dict(triton_launches),
    }


def main(args: argparse.Namespace) -> int:

    from transformers import LlamaConfig, LlamaForCausalLM

    from blendkv import LLM, SamplingParams
    from blendkv.blend.config import BlendConfig
    from blendkv.eval.random_model import make_tokenizer, random_text

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="blendkv-launches-") as tmp:
        LlamaForCausalLM(config).save_pretrained(tmp)
        make_tokenizer(config.vocab_size).save_pretrained(tmp)
        llm = LLM(tmp, dtype="float32", device="cpu", attention_backend="triton",
                  enable_prefix_caching=False, kv_store_dir=str(Path(tmp) / "store"))  # fmt: skip
        prompt = {
            "documents": [random_text(args.doc_words, seed=100 + d) for d in range(args.docs)],
            "query": "Which city is the capital of France?",
        }
        one = SamplingParams(temperature=0.0, max_tokens=1)
        blend = BlendConfig(recompute_ratio=args.ratio)
        reuse = BlendConfig(recompute_ratio=0.0)
        full_ids = llm.blend_manager().prepare(prompt, blend).prompt.token_ids
        runs = {
            "blend": lambda: llm.generate([prompt], one, blend=blend),
            "reuse": lambda: llm.generate([prompt], one, blend=reuse),
            "full": lambda: llm.generate([full_ids], one),
        }
        rows = {"layers": args.layers, "prompt_tokens": len(full_ids), "ratio": args.ratio}
        for name, run in runs.items():
            run()  # warm: chunks stored, kernels interpreted once
            rows[name] = _count(run)
            r = rows[name]
            print(
                f"{name:>5}: {r['launches']:6d} launches ({r['aten_kernels']} aten + "
                f"{r['triton_launches']} Triton), {r['host_syncs']} host syncs; "
                f"{r['launches'] / args.layers:.1f} a layer",
                flush=True,
            )
        llm.close()
    print(json.dumps(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0
