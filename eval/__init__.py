"""Quality/latency evaluation harness (``blendkv eval``).

Model-independent groundwork, one concern per module:

- :mod:`blendkv.eval.datasets`: :class:`Example`/:class:`Passage` and the data set loaders.
- :mod:`blendkv.eval.synthetic`: seeded two-hop QA whose hops sit in different passages.
- :mod:`blendkv.eval.prompts`: prompt pieces (system, one string per passage, query) as data.
- :mod:`blendkv.eval.metrics`: EM/F1/Rouge-L and fidelity to full prefill (KL, top-1).
"""
