"""One server for the conformance suite: the tiny random model with a chat template, the plain
torch attention backend (no C++ build), no API key."""

from __future__ import annotations

import openai
import pytest
from helpers import QuietLLM
from server_helpers import make_tiny_chat_model_dir, running_server

from blendkv.entrypoints.openai.api_server import ServeConfig, create_app

MODEL = "tiny"
ENGINE = dict(
    dtype="float32", block_size=4, max_model_len=512, max_num_seqs=16, attention_backend="torch"
)


@pytest.fixture(scope="package")
def server(tmp_path_factory):
    model_dir = make_tiny_chat_model_dir(tmp_path_factory.mktemp("conformance-model"))
    app = create_app(
        lambda: QuietLLM(str(model_dir), **ENGINE), ServeConfig(served_model_name=MODEL)
    )
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="package")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)
