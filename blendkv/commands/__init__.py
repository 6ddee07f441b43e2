"""Subcommands of the ``blendkv`` CLI, one module each with a ``register(subparsers)``.

Each module imports what its command runs (``LLM``, the RAG pipeline, the store, the server)
inside its ``run`` function, not at module top: the CLI imports every module to register its
parser, and ``blendkv --help`` should load neither torch nor transformers
(``tests/test_cli_help.py``). The same holds for ``blendkv.eval.commands`` and
``blendkv.eval.bench.commands``.
"""
