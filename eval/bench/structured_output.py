"""Per-step cost of a structured-output token mask: xgrammar, outlines-core and llguidance.

Each library compiles the same JSON schema for the same tokenizer, then a matcher is walked
along a valid answer's tokens; each step fills the vocabulary bitmask and applies it to a
``[1, vocab]`` float32 logits row (what the sampler does). Prints one line per library: the
compile time and the per-step mask time (median and p90 over steps and repeats).

    python -m eval.bench.structured_output [--tokenizer DIR] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "city": "Paris", "tags": ["math", "engines"]}'


def _stats(samples: list[float]) -> str:
    s = sorted(samples)
    p90 = s[int(0.9 * (len(s) - 1))]
    return f"median {statistics.median(s) * 1e6:8.1f} us  p90 {p90 * 1e6:8.1f} us"


def bench_llguidance(tok, ids, repeats):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": True}
    )
    steps = []
    compile_s = None
    for _ in range(repeats):
        c0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grammar)
        compile_s = compile_s or time.perf_counter() - c0
        mask = lt.allocate_token_bitmask(1, lltok.vocab_size)
        logits = torch.zeros(1, len(tok))
        for t in ids:
            s0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask, 0)
            lt.apply_token_bitmask_inplace(logits, mask)
            steps.append(time.perf_counter() - s0)
            assert m.consume_token(t), m.get_error()
    return t1 - t0, compile_s, steps


def bench_xgrammar(tok, ids, repeats):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t1 = time.perf_counter()
    c0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    compile_s = time.perf_counter() - c0
    steps = []
    for _ in range(repeats):
        m = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        logits = torch.zeros(1, len(tok))
        for t in ids:
            s0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
            steps.append(time.perf_counter() - s0)
            assert m.accept_token(t)
    return t1 - t0, compile_s, steps


def bench_outlines_core(tok, ids, repeats):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    # Token strings as text (outlines' own adapter does the same for byte-level BPE).
    vocab: dict[str, list[int]] = {}
    eos = tok.eos_token_id
    for token, i in tok.get_vocab().items():
        if i == eos:
            continue
        vocab.setdefault(tok.convert_tokens_to_string([token]), []).append(i)
    vocabulary = Vocabulary(eos, vocab)
    t1 = time.perf_counter()
    c0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    compile_s = time.perf_counter() - c0
    steps = []
    words = (len(tok) + 31) // 32
    for _ in range(repeats):
        g = Guide(index)
        mask = torch.zeros(1, words, dtype=torch.int32)
        logits = torch.zeros(1, len(tok))
        for t in ids:
            s0 = time.perf_counter()
            g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            allowed = torch.tensor(g.get_tokens())
            logits.fill_(float("-inf"))
            logits[0, allowed] = 0.0
            steps.append(time.perf_counter() - s0)
            g.advance(t)
    return t1 - t0, compile_s, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="HF tokenizer directory")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--only", nargs="*", default=["llguidance", "xgrammar", "outlines_core"])
    args = ap.parse_args()
    tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    ids = tok.encode(ANSWER, add_special_tokens=False)
    print(f"vocab {len(tok)}, answer {len(ids)} tokens, {args.repeats} repeats")
    benches = {
        "llguidance": bench_llguidance,
        "xgrammar": bench_xgrammar,
        "outlines_core": bench_outlines_core,
    }
    for name in args.only:
        tok_s, compile_s, steps = benches[name](tok, ids, args.repeats)
        print(
            f"{name:14s} tokenizer {tok_s:7.3f} s  schema {compile_s * 1e3:9.1f} ms  "
            f"mask+apply {_stats(steps)}"
        )


if __name__ == "__main__":
    main()
