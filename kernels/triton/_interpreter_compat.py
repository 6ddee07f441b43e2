"""Make Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``) run these kernels in any process.

Two problems, both only in interpreter mode, both fixed here without touching compiled mode:

1. NumPy >= 2.4 and run-time loop bounds. The interpreter keeps every scalar as a one-element
   array and converts a loop bound with ``int(array)``, which NumPy 2.4 turned from a
   deprecation into a ``TypeError``. Every kernel here loops to a bound loaded from memory (a
   sequence's length, a row's position). :func:`patch_interpreter_index` re-registers
   ``tensor.__index__`` through the interpreter's own patch scope (restored after each launch).
2. Import order. ``@triton.jit`` picks compiled vs interpreted when it decorates, and
   ``triton.language``'s own helpers (``tl.max``, ``tl.sum``, ``tl.cdiv``, ...) are decorated
   when Triton is first imported, which ``torch._dynamo`` may do before a test sets
   ``TRITON_INTERPRET=1``; calling such a compiled-mode helper from an interpreted kernel raises
   "Cannot call @triton.jit'd outside of the scope of a kernel". :func:`reinterpret_stdlib`
   re-wraps those helpers as interpreted functions, as importing Triton under the flag would.
3. bfloat16 numerics. The interpreter stores bf16 as raw uint16, so ``tl.dot`` on bf16 operands
   multiplies bit patterns, and float32 -> bf16 casts truncate where a GPU rounds to nearest
   even. :func:`patch_bf16` does both through torch's own bf16 conversion, so bf16 results
   under the interpreter are what a GPU computes (products in float32, rounded stores).
"""

from __future__ import annotations


def patch_interpreter_index() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_blendkv_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._blendkv_patched = True
    interpreter._patch_lang_tensor = patched


def reinterpret_stdlib() -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, InterpretedFunction] = {}
    for module in (tl, tl.standard, tl.math):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                # One wrapper per function, so `tl.max is tl.standard.max` still holds (the
                # interpreter recognises its fast reductions by identity).
                fn = wrapped.setdefault(id(value), InterpretedFunction(value.fn))
                setattr(module, name, fn)


def patch_bf16() -> None:
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    if getattr(InterpreterBuilder.cast_impl, "_blendkv_patched", False):
        return
    cast_impl, create_dot = InterpreterBuilder.cast_impl, InterpreterBuilder.create_dot

    def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()

    def patched_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = np.ascontiguousarray(src.data, dtype=np.float32)
            bits = torch.from_numpy(data).to(torch.bfloat16).view(torch.int16).numpy()
            return TensorHandle(bits.view(np.uint16), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a = (
                TensorHandle(bf16_to_f32(a.data), tl.float32)
                if a.dtype.scalar == tl.bfloat16
                else a
            )
            b = (
                TensorHandle(bf16_to_f32(b.data), tl.float32)
                if b.dtype.scalar == tl.bfloat16
                else b
            )
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    patched_cast._blendkv_patched = True
    InterpreterBuilder.cast_impl = patched_cast
    InterpreterBuilder.create_dot = patched_dot


def make_interpreter_work() -> None:
    patch_interpreter_index()
    reinterpret_stdlib()
    patch_bf16()
