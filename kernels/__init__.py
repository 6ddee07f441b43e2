"""Attention and KV-cache kernels (``blendkv.kernels``): the backend interface
(:mod:`.attention`), its torch reference, the CPU's C++ kernels and the Triton kernels.

This file imports nothing: transformers probes for a top-level ``kernels`` package, and from
the repository root it finds this folder; importing blendkv from here would be circular. Pick a
backend with :func:`blendkv.kernels.backends.get_attention_backend`.
"""
