from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "rag"))

from rag_helpers import shared_pipeline  # noqa: E402


@pytest.fixture(scope="session")
def rag():
    return shared_pipeline()[0]


@pytest.fixture(scope="session")
def demo_report():
    return shared_pipeline()[1]
