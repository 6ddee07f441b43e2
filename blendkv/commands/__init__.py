"""Subcommands of the ``blendkv`` CLI, one module each with a ``register(subparsers)``."""
