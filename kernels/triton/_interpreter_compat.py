"""Make Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``) run these kernels in any process.

Interpreter mode only; compiled mode is untouched:

1. :func:`patch_interpreter_index`: NumPy >= 2.4 refuses ``int(array)`` on the interpreter's
   one-element scalars, which run-time loop bounds need.
2. :func:`reinterpret_stdlib`: ``triton.language`` helpers decorated before the flag was set
   (``torch._dynamo`` may import Triton first) are re-wrapped as interpreted functions.
3. :func:`patch_bf16`: the interpreter stores bf16 as raw uint16 (``tl.dot`` would multiply bit
   patterns, casts would truncate); this computes them as a GPU does.
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
