"""``dtype="auto"`` opens a store in the dtype it was built with; an explicit other dtype is
refused with the fix in the message.

The store is built in the dtype ``auto`` does *not* pick on this machine, so following the
store is what makes the second open work.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import QUIET_FLAGS, QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.cli import main
from blendkv.config import resolve_dtype
from blendkv.engine_args import follow_store_dtype
from blendkv.rag import RAGPipeline
from blendkv.store import FingerprintMismatchError, KVStore
from blendkv.store.backends import stored_fingerprint
from blendkv.store.fingerprint import mismatch_message

AUTO = resolve_dtype("auto", "cpu")
OTHER = "float32" if AUTO == "bfloat16" else "bfloat16"
DOC = "Paris is the capital of France. The Seine flows through Paris. " * 3
GREEDY = SamplingParams(max_tokens=2, temperature=0)


@pytest.fixture(scope="module")
def other_dtype_store(tiny_llama_dir, tmp_path_factory):
    """A store built by the tiny model in ``OTHER`` (not what auto picks here)."""
    store = tmp_path_factory.mktemp("dtype") / "store"
    with RAGPipeline(store, model=str(tiny_llama_dir), dtype=OTHER, chunk_tokens=16) as rag:
        rag.ingest([DOC], progress=False)
    return store


def test_stored_fingerprint_reads_the_dtype_without_a_model(other_dtype_store, tmp_path):
    assert stored_fingerprint(other_dtype_store).dtype == OTHER
    assert stored_fingerprint(tmp_path / "missing") is None
    assert follow_store_dtype({"dtype": "auto"}, other_dtype_store) == {"dtype": OTHER}
    assert follow_store_dtype({}, other_dtype_store) == {"dtype": OTHER}
    assert follow_store_dtype({"dtype": AUTO}, other_dtype_store) == {"dtype": AUTO}
    assert follow_store_dtype({}, tmp_path / "missing") == {}


def test_auto_follows_the_store_and_serves_its_chunks(other_dtype_store, tiny_llama_dir):
    with RAGPipeline(other_dtype_store, model=str(tiny_llama_dir), create=False) as rag:
        assert rag.llm.engine.dtype == OTHER
        answer = rag.query("What is the capital of France?", k=2, sampling_params=GREEDY)
        assert answer.blend_stats.chunks_hit == len(answer.sources) > 0
        assert answer.blend_stats.chunks_missed == 0


def test_llm_with_kv_store_dir_follows_the_store(other_dtype_store, tiny_llama_dir):
    with QuietLLM(str(tiny_llama_dir), kv_store_dir=str(other_dtype_store)) as llm:
        assert llm.engine.dtype == OTHER
        prompt = {"documents": [DOC], "query": "Capital?"}
        assert llm.generate([prompt], GREEDY, blend=BlendConfig())[0].outputs[0].token_ids


def test_explicit_other_dtype_is_refused_with_the_fix(other_dtype_store, tiny_llama_dir):
    with pytest.raises(FingerprintMismatchError) as err:
        RAGPipeline(other_dtype_store, model=str(tiny_llama_dir), dtype=AUTO, create=False)
    message = str(err.value)
    assert err.value.fields == ("dtype",)
    assert f"built with dtype {OTHER}; this model is {AUTO}" in message
    assert f"pass dtype='{OTHER}' (or dtype='auto' to follow the store)" in message


def test_cli_ask_follows_the_store_and_names_the_flag(other_dtype_store, tiny_llama_dir, capsys):
    args = ["--store", str(other_dtype_store), "--model", str(tiny_llama_dir), *QUIET_FLAGS]
    assert main(["ask", "Capital of France?", "--top-k", "1", "--max-tokens", "1", *args]) == 0
    capsys.readouterr()
    assert main(["ask", "Capital?", "--max-tokens", "1", "--dtype", AUTO, *args]) == 2
    assert f"pass dtype='{OTHER}'" in (err := capsys.readouterr().err)
    assert f"--dtype {OTHER} or auto" in err


def test_other_differences_still_name_the_fields(other_dtype_store, tmp_path):
    fp = stored_fingerprint(other_dtype_store)
    KVStore(tmp_path / "s", fp).close()
    other = dataclasses.replace(fp, dtype=AUTO, head_dim=fp.head_dim * 2)
    with pytest.raises(FingerprintMismatchError) as err:
        KVStore(tmp_path / "s", other)
    assert "differing fields: dtype" in str(err.value) and "head_dim" in str(err.value)
    assert "with the model it was built with" in str(err.value)
    only_dtype = mismatch_message("S", dataclasses.replace(fp, dtype=AUTO), fp)
    assert only_dtype.startswith(f"store S was built with dtype {OTHER}; this model is {AUTO}")
