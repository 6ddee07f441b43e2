"""``blendkv bench compile``: every Triton kernel the engine launches, compiled for a GPU this
machine does not have.

    blendkv bench compile [--arch 90] [--shapes tiny,qwen05,llama8b] [--dtype bfloat16]
        [--json FILE]

Triton lowers a kernel to PTX and assembles a cubin (its bundled ``ptxas``) without a device.
Here the engine runs a short workload on the CPU with the Triton backend -- batched and
chunked prefill, decode, the default blend, CacheBlend's pick, the K+V correction with the
pooled prior, an int8 store -- and every kernel launch is compiled for the target instead of
run. No kernel writes its outputs, so the tokens are meaningless (and no correctness is
checked: the interpreter tests do that); what it checks is what only a GPU build showed before:

- each launch the engine makes at these shapes compiles for the target (the interpreter accepts
  code that the compiler rejects);
- each compiled variant's shared memory fits the target's per-block limit (else the launch fails
  on the GPU with ``OutOfResources``);
- registers and spills per variant (``cuobjdump --dump-resource-usage`` of the cubin), reported.

Shapes are :mod:`blendkv.eval.random_model`'s with 2 layers, a 512-token vocabulary and an MLP
of at most 1,024 columns: the kernels' specializations depend on the hidden size, the head
counts, the head size and the dtype, not on those. The prefill kernel's tiles are the tuned
table's for the target (``kernels/triton/tuned``) where it has the head shape.

Exit status 1 when a launch does not compile or does not fit; the JSON holds every variant.
Run it in a process where ``TRITON_INTERPRET`` is unset (the kernels must be compiled, not
interpreted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Largest shared memory one block may use (opt-in), bytes, per compute capability.
SHARED_LIMITS = {80: 166_912, 86: 101_376, 87: 166_912, 89: 101_376, 90: 232_448, 100: 232_448}

# Every kernel module: imported before any engine code, so each ``@triton.jit`` makes a
# compiled (not interpreted) function.
KERNEL_MODULES = (
    "chunk_shift",
    "decode_attention",
    "elementwise",
    "kv_write",
    "prefill_attention",
    "query_mass",
    "rope_load",
)


@dataclass
class Variant:
    """One compiled specialization of a kernel."""

    kernel: str
    shape: str
    hash: str  # Triton's key of the compiled binary
    num_warps: int
    num_stages: int
    shared: int  # bytes of shared memory the launch asks for
    registers: int | None = None  # per thread, from the cubin
    local: int | None = None  # bytes of local memory per thread (spills)
    constants: dict = field(default_factory=dict)


class OfflineDriver:
    """What :meth:`JITFunction.run` asks of Triton's driver, for a device that is not here."""

    compile_only = True  # (blendkv.kernels.backends accepts the Triton backend on the CPU)

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, local bytes) of a cubin's one function, from the bundled cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    fields = dict(
        part.split(":", 1) for line in out.splitlines() if "REG:" in line for part in line.split()
    )
    return int(fields.get("REG", -1)), int(fields.get("LOCAL", -1))


@contextlib.contextmanager
def compile_only(arch: int, variants: list[Variant], shape: str) -> Iterator[None]:
    """Within: a Triton launch compiles its kernel for ``sm_<arch>`` (once per
    specialization, as on a GPU), appends a :class:`Variant` and runs nothing."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    run = JITFunction.run
    seen = {v.hash for v in variants}

    def compile_launch(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        md = kernel.metadata
        if md.hash not in seen:
            seen.add(md.hash)
            registers, local = _resources(kernel.asm["cubin"])
            constants = {k: v for k, v in kwargs.items() if isinstance(v, int | bool)}
            variants.append(
                Variant(
                    self.fn.__name__,
                    shape,
                    md.hash,
                    md.num_warps,
                    md.num_stages,
                    md.shared,
                    registers,
                    local,
                    constants,
                )
            )
        return None

    driver.set_active(OfflineDriver(arch))
    JITFunction.run = compile_launch
    try:
        yield
    finally:
        JITFunction.run = run
        driver.set_active(None)  # the next use finds the machine's own driver


def _checks_pass(name, kernel, check, module, like) -> bool:
    """The element-wise kernels' start checks compare outputs no kernel writes here: each
    kernel is compiled by its check's launch and switched on, as a passing check does."""
    with contextlib.suppress(AssertionError):
        check(kernel, module, like)
    return True


def run_workload(
    model_dir: Path,
    dtype: str,
    store: Path,
    arch: int,
    codec: str | None,
    variants: list[Variant],
    shape: str,
) -> None:
    """The engine's launches, compiled: batched prefill and decode, a chunked prefill (without
    ``codec`` only), and three blends whose chunks come from the store (``codec``). The store
    is filled first by the CPU backend: no compiled kernel writes an output, so chunks computed
    here would hold unwritten memory (without it, the 8B shape's int8 loads were never
    launched)."""
    from blendkv import LLM, SamplingParams
    from blendkv.blend.config import BlendConfig
    from blendkv.eval.random_model import random_text

    def engine(backend="triton"):
        llm = LLM(
            str(model_dir),
            dtype=dtype,
            device="cpu",
            attention_backend=backend,
            enable_prefix_caching=False,
            max_model_len=2048,
            max_num_batched_tokens=256,
            kv_cache_memory_bytes=64 << 20,  # a few sequences of 2,048 tokens at the 8B shape
            kv_store_dir=str(store),
            kv_codec=codec,
            blend_start_gate=False,
            blend_cost_check=False,
            prefill_tiles=f"sm{arch}",  # the target GPU's tuned table (the Triton backend's)
        )
        return llm

    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = {
        "documents": [random_text(40 + 10 * i, 10 + i) for i in range(3)],
        "query": random_text(12, 20),
    }
    llm = engine("cpu")
    llm.generate([prompt], greedy, blend=BlendConfig())
    llm.blend_manager().flush()  # the chunks' writes
    llm.close()
    with compile_only(arch, variants, shape):
        _compiled_workload(engine, prompt, greedy, prefills=codec is None)


def _compiled_workload(engine, prompt, greedy, prefills: bool = True) -> None:
    """``prefills``: the plain prefills too (they read no stored chunk: a second codec's run
    leaves them out, its blends are what its loads change)."""
    from blendkv.blend.config import BlendConfig
    from blendkv.eval.random_model import random_text

    llm = engine()
    if prefills:
        llm.generate([random_text(30, 1), random_text(60, 2)], greedy)
        # ~900 tokens in steps of 256: the third and fourth steps split their keys over programs
        llm.generate([random_text(900, 3)], greedy)
    for blend in (
        BlendConfig(),
        BlendConfig(selection="v_deviation", recompute_ratio=0.15, correction="none"),
        BlendConfig(correction="kv", correction_prior="pooled"),
    ):
        llm.generate([prompt], greedy, blend=blend)
    llm.close()


def compile_shape(shape: str, dtype: str, arch: int, variants: list[Variant]) -> None:
    import torch

    from blendkv.eval.random_model import SHAPES, save_random_model
    from blendkv.layers import fused_kernels

    mlp = min(SHAPES[shape][1]["intermediate_size"], 1024)
    with tempfile.TemporaryDirectory(prefix=f"blendkv-compile-{shape}-") as tmp:
        model_dir = Path(tmp) / "model"
        save_random_model(
            model_dir,
            shape,
            getattr(torch, dtype),
            "cpu",
            num_hidden_layers=2,
            vocab_size=512,
            intermediate_size=mlp,
        )
        passes = fused_kernels._passes
        fused_kernels._passes = _checks_pass
        try:
            for codec in (None, "int8"):
                store = Path(tmp) / f"store-{codec}"
                run_workload(model_dir, dtype, store, arch, codec, variants, shape)
        finally:
            fused_kernels._passes = passes


def problems(variants: list[Variant], arch: int) -> list[str]:
    limit = SHARED_LIMITS.get(arch)
    out = []
    for v in variants:
        if limit is not None and v.shared > limit:
            out.append(f"{v.kernel} ({v.shape}): {v.shared} bytes of shared memory > {limit}")
    return out


def main(args: argparse.Namespace) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(
            "unset TRITON_INTERPRET: this compiles the kernels, it does not interpret them",
            file=sys.stderr,
        )
        return 2
    import importlib

    from blendkv.eval.random_model import SHAPES

    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    for name in KERNEL_MODULES:
        importlib.import_module(f"blendkv.kernels.triton.{name}")
    variants: list[Variant] = []
    failed = []
    for shape in shapes:
        try:
            compile_shape(shape, args.dtype, args.arch, variants)
        except Exception as e:  # a compile error: report it with its shape, go on
            failed.append(f"{shape}: {type(e).__name__}: {str(e)[:2000]}")
    failed += problems(variants, args.arch)
    print(
        f"{'kernel':<26} {'shape':<8} {'warps':>5} {'stages':>6} {'shared':>8} {'regs':>5} "
        f"{'spill B':>7}"
    )
    for v in sorted(variants, key=lambda v: (v.kernel, v.shape, v.shared)):
        print(
            f"{v.kernel:<26} {v.shape:<8} {v.num_warps:>5} {v.num_stages:>6} {v.shared:>8} "
            f"{v.registers if v.registers is not None else '-':>5} "
            f"{v.local if v.local is not None else '-':>7}"
        )
    print(
        f"{len(variants)} variants of {len({v.kernel for v in variants})} kernels compiled "
        f"for sm_{args.arch}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"arch": args.arch, "variants": [asdict(v) for v in variants], "failed": failed},
                indent=1,
            )
        )
    for line in failed:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failed else 0
