"""Triton kernels for the paged KV pool; imported only by the Triton attention backend and tests.

One kernel per file, each with the torch function it is tested against named in its docstring:

- :mod:`.kv_write`: scatter a step's K/V into their slots.
- :mod:`.decode_attention`: one query row per sequence, flash-decoding over key splits.
- :mod:`.prefill_attention`: rows at arbitrary absolute positions (chunked prefill, prefix hits,
  CacheBlend's scattered rows, decode rows too).
- :mod:`.rope_load`: RoPE applied to stored pre-RoPE K while writing a chunk into every layer.

``TRITON_INTERPRET=1`` runs them on the CPU (slowly): the tests do that on machines without a GPU.
"""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from blendkv.kernels.triton._interpreter_compat import make_interpreter_work

    make_interpreter_work()

from blendkv.kernels.triton.decode_attention import decode_attention  # noqa: E402
from blendkv.kernels.triton.kv_write import write_kv  # noqa: E402
from blendkv.kernels.triton.prefill_attention import prefill_attention  # noqa: E402
from blendkv.kernels.triton.rope_load import rope_load  # noqa: E402

__all__ = ["decode_attention", "prefill_attention", "rope_load", "write_kv"]
