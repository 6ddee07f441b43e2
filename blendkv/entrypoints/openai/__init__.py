"""The OpenAI-compatible HTTP server (``blendkv serve``); needs ``pip install 'blendkv[serve]'``."""
