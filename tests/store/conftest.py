from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The helpers module is also run as a script by subprocess tests; make it importable by name.
sys.path.insert(0, str(Path(__file__).parent))

from blendkv.store.kv_store import KVStore  # noqa: E402


@pytest.fixture
def store(store_path, fp):
    s = KVStore(store_path, fp)
    yield s
    s.close()
