"""Device kernels a request launches, counted without a GPU.

    blendkv bench launches [--layers 32] [--docs 10] [--ratio 0.15] [--eager]
        [--max-model-len 4096]

On a GPU a blended prefill computes few rows per layer, so its time is the host's: one launch
per kernel, a few microseconds each. This counts those launches for one blended request, one
full reuse and one full prefill of the same tokens, on a random-weight model with the given
number of layers, the Triton attention backend (on the CPU under ``TRITON_INTERPRET=1``), warm
chunk store: every aten op that would run a kernel (views, allocations and metadata-only ops
excluded, and ops on host tensors only: the host bookkeeping a GPU run keeps on the CPU) plus
every Triton launch, and the points where the host waits for the device
(:class:`HostSyncs`: ``.item()``, ``.cpu()`` / ``.tolist()`` of a device tensor, ``nonzero``,
boolean-mask indexing, ...), each listed with the file:line it happens at. The counts depend on
the code path, not on widths or token counts (within a prompt's few hundred tokens).

As on a GPU, the dense pieces between attentions replay captured graphs
(:mod:`blendkv.engine.piecewise_graphs`), and so does ProphetKV's query pass, one graph per
loading stage (:mod:`blendkv.engine.query_pass_graphs`; ``--eager``: neither): the capture
records a graph once, in the warm-up request, and each replay counts as one launch
(``graph_replay``), the kernels inside it not at all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

# Read at @triton.jit: set before anything imports triton (transformers may).
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from torch.utils.weak import WeakIdKeyDictionary  # noqa: E402

from blendkv.engine.cuda_graphs import EagerCapture  # noqa: E402

# aten ops that launch nothing on a GPU (views, allocations, metadata)
_NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "view",
    "_unsafe_view",
    "as_strided",
    "alias",
    "slice",
    "select",
    "expand",
    "permute",
    "transpose",
    "t",
    "unsqueeze",
    "squeeze",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "detach",
    "lift_fresh",
    "_reshape_alias",
    "resize_",
    "unfold",
    "diagonal",
    "view_as_real",
    "set_",
    "is_same_size",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "result_type",
    "_has_compatible_shallow_copy_type",
    "is_nonzero",
    "record_stream",
    # composites seen before they lower: their copies show up as _to_copy / clone / copy_
    "to",
    "reshape",
    "contiguous",
    "detach_",
}
# Ops whose output size depends on the values of a device input: the host waits for them.
_DATA_DEPENDENT = {
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "bincount",
}
# Tensor methods that copy a tensor's values to the host.
_HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}
_PROJECT = (str(Path(__file__).resolve().parents[2]) + os.sep, "blendkv" + os.sep)


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = False
        # False while a torch call on host tensors only runs (HostSyncs sets it per call):
        # host bookkeeping a GPU run keeps on the CPU launches no kernel there.
        self.device_call = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and self.device_call:
            name = func.__name__.split(".")[0]
            if name not in _NO_KERNEL:
                self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class HostSyncs(TorchFunctionMode):
    """Counts the points where a GPU host would wait for the device, with where each happens.

    On the CPU every tensor is a host tensor, so this follows which ones a GPU run would hold
    on the device: the ``device_tensors`` given (weights, K/V pools), those made with an
    explicit ``device=`` torch.device (``torch.tensor(ids, device=self.device)``) or moved with
    ``.to(device)`` / ``.to(tensor)``, and every result of an op with a device input. A sync is
    a host read of a device tensor (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
    ``.to("cpu")``, ``int()``/``bool()``/``float()``), an op whose output size depends on
    its values (``nonzero``, boolean-mask indexing, ``bincount``, ``repeat_interleave`` without
    ``output_size``, ...), or a copy of host values to the device that is not ``non_blocking``
    (``.to(device)``, ``torch.tensor(..., device=)``, ``copy_``: torch synchronizes the stream
    after such a copy, so the host waits for every kernel queued before it). ``where`` counts
    them by the innermost project frame (file:line). Host bookkeeping (CPU tensors a GPU run
    keeps on the CPU too) is not a sync, however it is read.
    """

    def __init__(self, device_tensors=(), kernels: _Counter | None = None) -> None:
        super().__init__()
        self.kernels = kernels  # paused for the copies this mode makes itself
        self.device = WeakIdKeyDictionary()
        for t in device_tensors:
            self.device[t] = True
        self.where: Counter[str] = Counter()
        self.paused = False

    @contextlib.contextmanager
    def quiet(self):
        if self.kernels is None:
            yield
            return
        paused, self.kernels.paused = self.kernels.paused, True
        try:
            yield
        finally:
            self.kernels.paused = paused

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(t in self.device for t in inputs)
        host_target = name == "to" and _to_host(args[1:], kwargs)
        dev = kwargs.get("device")
        made_on_device = isinstance(dev, torch.device) or (
            name == "to" and not host_target and _to_device(args[1:], kwargs)
        )
        out = self._call(func, args, kwargs, on_device or made_on_device)
        if on_device and (
            name in _HOST_READS or host_target or _sizes_from_values(name, args, kwargs)
        ):
            self.where[_frame()] += 1
        elif self._blocking_upload(name, args, kwargs, inputs, made_on_device):
            self.where[_frame()] += 1
        if name in _HOST_READS or host_target:
            if on_device and out is args[0]:
                # On a GPU ``.cpu()`` of a device tensor is a new tensor; the device one stays.
                with self.quiet():
                    out = out.clone()
            return out
        if made_on_device and name == "to" and out is args[0]:
            # On a GPU ``.to(device)`` of a host tensor is a new tensor; the host one stays.
            with self.quiet():
                out = out.clone()
        if on_device or made_on_device:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.device[t] = True
        return out

    def _blocking_upload(self, name, args, kwargs, inputs, made_on_device: bool) -> bool:
        """A copy of host values to the device that waits for the stream: torch makes the
        host wait for every queued kernel unless the copy is ``non_blocking`` (from pinned
        memory: :func:`blendkv.kernels.attention_metadata.to_device`)."""
        if kwargs.get("non_blocking", False):
            return False
        if name in ("tensor", "as_tensor"):
            return made_on_device and not any(t in self.device for t in inputs)
        if name == "to":
            return made_on_device and args[0] not in self.device
        if name == "copy_":
            return args[0] in self.device and args[1] not in self.device
        return False

    def _call(self, func, args, kwargs, device_call: bool):
        """``func`` with the kernel counter told whether it runs on device tensors."""
        if self.kernels is None:
            return func(*args, **kwargs)
        outer, self.kernels.device_call = self.kernels.device_call, device_call
        try:
            return func(*args, **kwargs)
        finally:
            self.kernels.device_call = outer


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.startswith("cpu")


def _to_device(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, torch.device | torch.Tensor)


def _sizes_from_values(name: str, args, kwargs) -> bool:
    """Whether the op's output size comes from its input's values (the host must wait)."""
    if name in _DATA_DEPENDENT:
        return True
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name in ("__getitem__", "__setitem__"):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


def _frame() -> str:
    """The innermost project frame below this module: ``path:line (function)``."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if frame.f_code.co_filename != __file__ and _in_project(path):
            for root in _PROJECT[:1]:
                path = path.removeprefix(root)
            return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _in_project(path: str) -> bool:
    return path.startswith(_PROJECT[0]) or _PROJECT[1] in path and "site-packages" not in path


class CountedCapture:
    """The piecewise graphs' capture for counting: a replay reruns the piece eagerly with the
    counters paused and counts as one launch, what replaying a CUDA graph costs the host."""

    def __init__(self) -> None:
        self.counters: tuple[_Counter, HostSyncs] | None = None  # set while count() runs

    def __call__(self, fn):
        out = fn()

        def replay() -> None:
            if self.counters is None:
                fn()
                return
            self.counters[0].ops["graph_replay"] += 1
            with self._paused():
                fn()

        return replay, out

    def segments(self, fn):
        """The query pass's segmented capture (the eager stand-in's): each segment's replay
        counts as one launch."""
        replay = EagerCapture().segments(fn)

        def counted(before) -> None:
            if self.counters is None:
                replay(before)
                return

            def start(k: int) -> None:
                self.counters[0].ops["graph_replay"] += 1
                before(k)

            with self._paused():
                replay(start)

        return counted

    @contextlib.contextmanager
    def _paused(self):
        """Inside a replay: what the graph runs costs the host nothing."""
        counter, syncs = self.counters
        paused = counter.paused, syncs.paused
        counter.paused = syncs.paused = True
        try:
            yield
        finally:
            counter.paused, syncs.paused = paused


def device_tensors(llm) -> list[torch.Tensor]:
    """What a GPU run holds on the device from the start: weights, buffers, K/V pools, the
    piecewise graphs' and the query pass graphs' static buffers."""
    runner = llm.engine.runner
    model = runner.model
    caches = tree_flatten(runner.kv_caches)[0]
    pieces = runner.piece_graphs
    query = runner.query_graphs
    return [
        *model.parameters(),
        *model.buffers(),
        *(t for t in caches if isinstance(t, torch.Tensor)),
        *(pieces.buffers() if pieces is not None else ()),
        *(query.buffers() if query is not None else ()),
    ]


def count(run, device=(), capture: CountedCapture | None = None) -> dict:
    """Count one call of ``run``: aten kernels, Triton launches, host syncs (and where);
    ``capture``: the piecewise graphs' capture, whose replays count as one launch each."""
    from triton.runtime import interpreter

    counter = _Counter()
    syncs = HostSyncs(device, kernels=counter)
    if capture is not None:
        capture.counters = (counter, syncs)
    triton_launches: Counter[str] = Counter()
    original = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        if not counter.paused:  # (paused: inside a graph replay)
            triton_launches[self.fn.__name__] += 1
        # the interpreter's own host copies are not the kernel's
        paused = counter.paused, syncs.paused
        counter.paused = syncs.paused = True
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.paused, syncs.paused = paused

    interpreter.InterpretedFunction.run = counted
    try:
        with syncs, counter:
            run()
    finally:
        interpreter.InterpretedFunction.run = original
        if capture is not None:
            capture.counters = None
    aten = sum(counter.ops.values())
    triton = sum(triton_launches.values())
    return {
        "launches": aten + triton,
        "aten_kernels": aten,
        "triton_launches": triton,
        "host_syncs": syncs.count,
        "syncs_at": dict(syncs.where.most_common()),
        "top_aten": dict(counter.ops.most_common(12)),
        "triton": dict(triton_launches),
    }


def main(args: argparse.Namespace) -> int:

    from transformers import LlamaForCausalLM

    from blendkv import LLM
    from blendkv.eval.random_model import make_tokenizer

    torch.manual_seed(0)
    config = _llama_config(args.layers)
    with tempfile.TemporaryDirectory(prefix="blendkv-launches-") as tmp:
        LlamaForCausalLM(config).save_pretrained(tmp)
        make_tokenizer(config.vocab_size).save_pretrained(tmp)
        llm = LLM(
            tmp,
            dtype="float32",
            device="cpu",
            attention_backend="triton",
            enable_prefix_caching=False,
            kv_store_dir=str(Path(tmp) / "store"),
            max_model_len=args.max_model_len,
        )
        capture = None if args.eager else _capture_graphs(llm)  # what the engine does on CUDA
        rows = _count_requests(llm, args, capture)
        llm.close()
    print(json.dumps(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _llama_config(layers: int):
    """A tiny Llama of ``layers`` decoder layers (random weights)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
    )


def _capture_graphs(llm) -> CountedCapture:
    """Give the runner piecewise and query-pass graphs (as on CUDA) whose capture is counted."""
    from blendkv.engine.piecewise_graphs import PiecewiseGraphs
    from blendkv.engine.query_pass_graphs import QueryPassGraphs

    capture = CountedCapture()
    runner = llm.engine.runner
    runner.piece_graphs = PiecewiseGraphs("cpu", capture=capture)
    runner.query_graphs = QueryPassGraphs(
        runner.model,
        runner.attn_backend,
        runner.kv_caches,
        runner.block_size,
        llm.engine.info.max_model_len,
        capture=capture,
    )
    return capture


def _count_requests(llm, args, capture: CountedCapture | None) -> dict:
    """A blend, a reuse and a full prefill of one prompt, each counted once warm."""
    from blendkv import SamplingParams
    from blendkv.blend.config import BlendConfig
    from blendkv.eval.random_model import random_text

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
    rows = {
        "layers": args.layers,
        "prompt_tokens": len(full_ids),
        "ratio": args.ratio,
        "graphs": not args.eager,
    }
    for name, run in runs.items():
        run()  # warm: chunks stored, kernels interpreted once, pieces captured
        rows[name] = count(run, device_tensors(llm), capture)
        _print_counts(name, rows[name], args.layers)
    return rows


def _print_counts(name: str, r: dict, layers: int) -> None:
    print(
        f"{name:>5}: {r['launches']:6d} launches ({r['aten_kernels']} aten + "
        f"{r['triton_launches']} Triton), {r['host_syncs']} host syncs; "
        f"{r['launches'] / layers:.1f} a layer",
        flush=True,
    )
    for where, n in r["syncs_at"].items():
        print(f"       {n:3d} sync(s) at {where}", flush=True)
