"""``blendkv serve --deterministic``: greedy completions sent by concurrent clients (the openai
client, one thread each) equal the same requests sent one at a time, in bfloat16.

Concurrent requests arrive at different steps, so each one's prompt is computed next to other
requests' decode rows and prompts, in chunks the scheduler picks; the requests sent one at a
time then hit the prefix cache. The default mode runs the same setup and must differ somewhere,
so the equality in deterministic mode proves something.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import QuietLLM, make_tiny_model_dir
from server_helpers import running_server

from blendkv.entrypoints.openai.api_server import ServeConfig, create_app

WORDS = "the a river city capital France Paris over dog fox quick lazy museum park Berlin".split()
N_CLIENTS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("det") / "m"
    return make_tiny_model_dir(path, hidden_size=256, intermediate_size=512)


@pytest.mark.parametrize("deterministic", [False, True])
def test_concurrent_greedy_completions_equal_sequential_only_when_deterministic(
    model_dir, deterministic
):
    # a small token budget: the concurrent prompts are chunked next to each other's decodes
    llm = QuietLLM(
        str(model_dir), dtype="bfloat16", deterministic=deterministic, max_num_batched_tokens=32
    )
    rng = random.Random(0)
    prompts = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(N_CLIENTS)
    ]
    app = create_app(llm, ServeConfig())
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)

        def complete(prompt: str) -> str:
            out = client.completions.create(
                model=None,
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return out.choices[0].text

        with ThreadPoolExecutor(N_CLIENTS) as pool:
            concurrent = list(pool.map(complete, prompts))
        sequential = [complete(p) for p in prompts]
    differ = [i for i, (a, b) in enumerate(zip(concurrent, sequential, strict=True)) if a != b]
    if deterministic:
        assert differ == []
    elif not differ:  # the setup should show the variance the mode removes
        # (some CPUs' bf16 kernels round alike at every batch size: tests/engine's twin says)
        pytest.skip("the default mode gives the same answers on this CPU: no variance to remove")
