"""Quality/latency evaluation harness (``blendkv eval``).

One concern per module:

- :mod:`blendkv.eval.examples`: :class:`Example`/:class:`Passage`, the shape of every data set.
- :mod:`blendkv.eval.datasets`: the data set loaders.
- :mod:`blendkv.eval.synthetic`: seeded two-hop QA whose hops sit in different passages.
- :mod:`blendkv.eval.cross_doc`: the same at RAG length in MuSiQue's format, with distractors.
- :mod:`blendkv.eval.prompts`: prompt pieces (system, one string per passage, query) as data.
- :mod:`blendkv.eval.metrics`: EM/F1/Rouge-L and fidelity to full prefill (KL, top-1).
- :mod:`blendkv.eval.methods`: method names (full, prefix, reuse, blend@R, hf) and running one
  method on one example, timed and teacher-forced.
- :mod:`blendkv.eval.runner`: the loop (store warm-up, interleaved methods, aggregation).
- :mod:`blendkv.eval.report`: results.json, per_example.jsonl, report.md and the plots.
- :mod:`blendkv.eval.paired`: per-example pairing of runs against a baseline run.
- :mod:`blendkv.eval.bootstrap`: paired bootstrap intervals; a method is better only by them.
- :mod:`blendkv.eval.commands`: the ``blendkv eval`` command (found by entry point).
- :mod:`blendkv.eval.bench`: the ``blendkv bench`` command and its benchmarks.

The dependency runs one way: this package imports :mod:`blendkv`, never the reverse.
"""
