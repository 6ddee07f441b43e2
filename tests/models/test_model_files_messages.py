"""What a user sees when a model folder is incomplete, and while models load:
one typed error line for a folder without tokenizer files, no transformers progress bar in
the middle of an ingest's."""

from __future__ import annotations

import shutil

import pytest

from blendkv.cli import main
from blendkv.errors import ModelLoadError
from blendkv.models.model_files import TOKENIZER_FILES, load_tokenizer, resolve_model


@pytest.fixture
def no_tokenizer_dir(tiny_llama_dir, tmp_path):
    """The tiny model's folder with config and weights but no tokenizer files at all."""
    target = tmp_path / "model"
    target.mkdir()
    for f in tiny_llama_dir.iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            shutil.copy(f, target / f.name)
    return target


def test_folder_without_tokenizer_is_one_typed_line(no_tokenizer_dir, capsys):
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(resolve_model(no_tokenizer_dir))
    message = str(err.value)
    assert str(no_tokenizer_dir) in message and "no tokenizer files" in message
    assert all(name in message for name in TOKENIZER_FILES)
    argv = ["generate", "hi", "--max-tokens", "1", "--model", str(no_tokenizer_dir)]
    assert main(argv) == 2
    err_text = capsys.readouterr().err
    assert err_text.startswith("blendkv: error:") and "no tokenizer files" in err_text
    assert "Traceback" not in err_text and len(err_text.strip().splitlines()) == 1


def test_unreadable_tokenizer_file_is_a_typed_error(no_tokenizer_dir):
    (no_tokenizer_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer in"):
        load_tokenizer(resolve_model(no_tokenizer_dir))


def test_embedder_load_prints_no_progress_bar(capfd):
    from transformers.utils import logging as hf_logging

    from blendkv.rag.embedding import MiniLMEmbedder

    assert hf_logging.is_progress_bar_enabled()
    capfd.readouterr()
    assert MiniLMEmbedder().embed(["a first embed loads the model"]).shape == (1, 384)
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err + captured.out
    assert hf_logging.is_progress_bar_enabled()  # switched off only around the load
