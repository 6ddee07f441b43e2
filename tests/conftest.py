from __future__ import annotations

import ctypes
import gc
import os
import sys
from pathlib import Path

import blendkv  # noqa: F401  # isort: skip  (first: it sets OpenMP's wait before torch loads)
import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter. Set before anything imports
# triton (transformers does, through torch._dynamo): TRITON_INTERPRET is read at @triton.jit.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


sys.path.insert(0, str(Path(__file__).parent))
# rag_helpers (shared by rag/ and integrations/) and store_helpers (by store/ and rag/)
sys.path.insert(0, str(Path(__file__).parent / "rag"))
sys.path.insert(0, str(Path(__file__).parent / "store"))

from helpers import QuietLLM, make_tiny_model_dir  # noqa: E402


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--ui-screenshots",
        metavar="DIR",
        default=None,
        help="tests/entrypoints/test_ui.py: serve the embedded model over the demo documents "
        "and save the /ui page's screenshots into DIR (docs/images holds the docs' ones)",
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_2l_dir(tmp_path_factory) -> Path:
    """The tiny Llama with two layers (still two loading stages): for the tests that interpret
    the Triton kernels, a third less to interpret."""
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-llama-2l"), "llama", num_hidden_layers=2
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def rag():
    """The session's RAG pipeline over the bundled demo documents (tests/rag/rag_helpers.py)."""
    from rag_helpers import shared_pipeline

    return shared_pipeline()[0]


@pytest.fixture(scope="session")
def demo_report():
    from rag_helpers import shared_pipeline

    return shared_pipeline()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server for the session (flush it between tests that need it empty)."""
    from redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A real 3-master Redis Cluster with a replica each, for the session (flush between
    tests; a test that kills a node builds its own: tests/redis_cluster.py)."""
    from redis_cluster import RedisCluster

    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


def _rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def pytest_configure(config):
    """Under pytest-xdist (``-n 2``: each worker a process) torch runs one intra-op thread per
    worker, so the workers do not queue for the same cores."""
    if hasattr(config, "workerinput"):
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _keep_num_threads():
    """An engine made with ``num_threads`` sets torch's for the process: the next test gets the
    worker's own back (the goldens run at 2 threads, as they were recorded)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


# The files that take longest (``--durations``), run first: ``make test`` hands xdist's two
# workers whole files in collection order (``--no-loadscope-reorder``), so a long file started
# last would leave one worker alone at the end.
LONG_FILES = (
    "distributed/test_ray_ingest.py",
    "eval/test_bench_compile.py",
    "engine/test_query_pass_graphs.py",
    "kernels/test_triton_engine.py",
    "blend/test_blend_quality.py",
    "kernels/test_piecewise_graphs.py",
    "kernels/test_batch_invariant_attention.py",
    "blend/test_blend_syncs.py",
    "rag/test_interrupted_ingest.py",
    "rag/test_shared_store.py",
    "entrypoints/test_openai_server_embedded.py",
)


def pytest_collection_modifyitems(session, config, items):
    """The long files first, the rest in collection order (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    tests = Path(__file__).parent

    def key(item) -> int:
        path = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
        return rank.get(path, len(rank))

    items.sort(key=key)


def pytest_collection_finish(session):
    """What importing torch, transformers and the test modules made (hundreds of thousands of
    objects) lives for the session: frozen, the collections below walk only what tests made,
    not all of it again once per module and after every test over the RSS mark."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session):
    gc.unfreeze()


_RSS_COLLECT_BYTES = 3 << 30
_RSS_GROWTH_BYTES = 512 << 20
_rss_at_last_collect = 0


@pytest.fixture(autouse=True)
def _collect_when_large():
    """Collect after a test once the process holds more than 3 GiB and has grown by 512 MiB
    since the last such collection: engines a test left in a reference cycle (a zeroed KV pool
    each) would otherwise wait for the module's end, and a module building many of them ran the
    suite out of memory. (A collection after every test above the mark took ~0.25 s a test: a
    quarter of the suite's time.)"""
    global _rss_at_last_collect
    yield
    rss = _rss_bytes()
    if rss > _RSS_COLLECT_BYTES and rss > _rss_at_last_collect + _RSS_GROWTH_BYTES:
        gc.collect()
        _rss_at_last_collect = _rss_bytes()


def _trim_malloc() -> None:
    """Hand the heap's free pages back to the system (glibc): freed tensors under malloc's mmap
    threshold otherwise stay in the process's RSS, module after module."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(scope="module", autouse=True)
def _collect_after_module():
    """Each module's engines (a KV pool each) are gone before the next module starts, even one
    a test left in a reference cycle (tests/rag/test_pipeline_lifetime.py guards the pipeline)."""
    yield
    gc.collect()
    _trim_malloc()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_dir(request):
    """(architecture, tiny model directory), for each architecture family the blend supports."""
    return request.param, request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def blend_llm(arch_dir):
    """A blending engine on ``arch_dir``'s tiny model (float32, 4-token blocks, no prefix cache)."""

    _, path = arch_dir
    llm = QuietLLM(str(path), dtype="float32", block_size=4, enable_prefix_caching=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def hf_model(arch_dir):
    """transformers' model of ``arch_dir`` (the oracle), float32."""
    import transformers

    _, path = arch_dir
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture
def fp():
    """A model fingerprint for store tests (tests/store/store_helpers.py)."""
    from store_helpers import make_fingerprint

    return make_fingerprint()


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"
