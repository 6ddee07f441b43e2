"""Chunking on token ids: boundaries, decode-exactness, size bounds, reproducibility."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from blendkv.rag.chunking import chunk_token_ids
from blendkv.rag.embedding import minilm_model_dir

PARA = "The river runs north. It floods every spring! Why does it? Rain.\n\n"
TEXT = PARA * 12 + "one two three four five six seven eight nine ten " * 20


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE (GPT-2/SmolLM style: newlines and spaces survive decoding)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def wordpiece():
    return AutoTokenizer.from_pretrained(str(minilm_model_dir()))


def _check_cover(chunks, ids, tok, limit):
    assert [t for c in chunks for t in c.token_ids] == ids
    assert all(c.text == tok.decode(list(c.token_ids)) for c in chunks)
    assert all(len(c.token_ids) <= limit for c in chunks)
    assert [c.start for c in chunks[1:]] == [c.end for c in chunks[:-1]]


def test_paragraph_boundaries_preferred(bpe):
    ids = bpe.encode(TEXT)
    para_len = len(bpe.encode(PARA))
    chunks = chunk_token_ids(ids, bpe, target_tokens=3 * para_len + 2, max_overshoot=2)
    _check_cover(chunks, ids, bpe, 3 * para_len + 4)
    for c in chunks[:4]:  # the paragraph part: cut after whole paragraphs
        assert c.text.endswith(".\n\n") and c.text.startswith("The river")
    assert chunk_token_ids(ids, bpe, target_tokens=3 * para_len + 2, max_overshoot=2) == chunks


def test_sentence_then_hard_boundaries(bpe):
    ids = bpe.encode(TEXT)
    chunks = chunk_token_ids(ids, bpe, target_tokens=12, max_overshoot=1)
    _check_cover(chunks, ids, bpe, 13)
    inside = [c.text for c in chunks if "river" in c.text and "\n\n" not in c.text]
    assert inside and all(t.rstrip().endswith((".", "!", "?")) for t in inside)
    tail = [c for c in chunks if "river" not in c.text and "one" in c.text]
    assert tail and all(len(c.token_ids) == 12 for c in tail[:-1])  # no boundary: hard split


def test_wordpiece_sentences_and_decode_exact(wordpiece):
    ids = wordpiece.encode(TEXT, add_special_tokens=False)
    chunks = chunk_token_ids(ids, wordpiece, target_tokens=20)
    _check_cover(chunks, ids, wordpiece, 22)
    assert sum(c.text.endswith(("?", ".", "!")) for c in chunks) >= len(chunks) // 2


def test_short_and_invalid_inputs(bpe):
    assert chunk_token_ids([], bpe) == []
    ids = bpe.encode("tiny.")
    assert [c.token_ids for c in chunk_token_ids(ids, bpe)] == [tuple(ids)]
    with pytest.raises(ValueError):
        chunk_token_ids(ids, bpe, target_tokens=0)
