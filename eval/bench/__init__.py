"""Benchmarks run by ``blendkv bench <kind>`` (:mod:`blendkv.eval.bench.commands`): each checks
correctness first, then times the paths side by side in one run and prints machine-readable
results.

- :mod:`~blendkv.eval.bench.engine`, :mod:`~blendkv.eval.bench.decode`: batched throughput,
  prefill and decode against transformers (and llama.cpp).
- :mod:`~blendkv.eval.bench.blend`: TTFT of full prefill, blend and reuse on MuSiQue
  (:mod:`~blendkv.eval.bench.profile_blend` with ``--profile``).
- :mod:`~blendkv.eval.bench.gpu`: random-weight real shapes on a GPU
  (:mod:`~blendkv.eval.bench.profile_gpu` with ``--profile``);
  :mod:`~blendkv.eval.bench.launches`: the kernels a request launches, counted on the CPU.
- :mod:`~blendkv.eval.bench.gemm`: the CPU GEMM libraries at a model's shapes.
- :mod:`~blendkv.eval.bench.threads`: the CPU engine per OpenMP wait setting, alone and beside
  a busy process.
- :mod:`~blendkv.eval.bench.prefetch`: reads ahead of a step against reads in it, cold
  (:mod:`~blendkv.eval.bench.page_cache`, :mod:`~blendkv.eval.bench.redis_server`).
- :mod:`~blendkv.eval.bench.store`, :mod:`~blendkv.eval.bench.store_scaling`: the chunk store's
  reads, writes, lookups and search, and how they grow with its size (LMDB against Redis).
"""
