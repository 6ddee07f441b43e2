"""Forward-path goldens: what the engine computes for fixed inputs, captured through its API.

``capture(llm)`` returns named fp32 tensors: the prompt logits of a plain prefill, the logprobs
of eight greedy decode steps, the prompt logits (from the query on) and decode logprobs of a
blended prefill at ratios 0, 0.15 and 1.0, and one chunk precompute's stored K/V. Recorded once
from main before the one-forward-path refactor (``record.py``); ``test_forward_golden.py``
checks that today's engine still computes exactly (bit for bit) the same numbers.
"""

from __future__ import annotations

import torch
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig

DOCS = [
    "Paris is the capital of France. The Seine flows through Paris. " * 2,
    "Berlin is the capital of Germany. It has many museums and parks.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
]
QUERY = "Which city is the capital of France?"
PLAIN = "Continuous batching lets new requests join while others decode. Paged attention"
RATIOS = (0.0, 0.15, 1.0)
DECODE = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)


def _decode_logprobs(out) -> torch.Tensor:
    """[steps, 6]: the sampled token's logprob and the top-5 logprobs of every decode step."""
    rows = []
    for tok, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        top = sorted(entry.values(), reverse=True)[:5]
        rows.append([entry[tok], *top, *[0.0] * (5 - len(top))])
    return torch.tensor(rows, dtype=torch.float64)


def stored_chunk_kv(llm, ids) -> torch.Tensor:
    """The stored K/V of the chunk ``ids`` (after the background writes landed)."""
    manager = llm.blend_manager()
    manager.flush()
    return manager.store.get(manager.chunk_key(ids)).kv.clone()


def blended_query_start(llm, prompt) -> int:
    return llm.blend_manager().prepare(prompt, None).prompt.query_start


def capture(
    llm, chunk_kv=stored_chunk_kv, query_start=blended_query_start
) -> dict[str, torch.Tensor]:
    """``chunk_kv(llm, token_ids)`` -> the stored [L, 2, n, Hkv, D] K/V of one chunk;
    ``query_start(llm, prompt)`` -> the position of a blended prompt's first query token."""
    got: dict[str, torch.Tensor] = {}
    ids = llm.tokenizer.encode(PLAIN, add_special_tokens=False)
    out = llm.generate([ids], DECODE, logits_from=0)[0]
    got["plain.prompt_logits"] = out.extra["prompt_logits"]
    got["plain.decode_logprobs"] = _decode_logprobs(out)
    got["plain.tokens"] = torch.tensor(out.outputs[0].token_ids)
    prompt = {"documents": DOCS, "query": QUERY}
    for r in RATIOS:
        # CacheBlend's V-deviation path as recorded (the default config has a K correction).
        blend = BlendConfig(recompute_ratio=r, selection="v_deviation", correction="none")
        out = llm.generate([prompt], DECODE, blend=blend)[0]
        # The query and template suffix are the rows every blended prefill computes.
        start = query_start(llm, prompt)
        again = llm.generate([prompt], DECODE, blend=blend, logits_from=start)[0]
        got[f"blend{r}.prompt_logits"] = again.extra["prompt_logits"]
        got[f"blend{r}.decode_logprobs"] = _decode_logprobs(out)
        got[f"blend{r}.tokens"] = torch.tensor(out.outputs[0].token_ids)
    doc_ids = llm.tokenizer.encode(DOCS[1], add_special_tokens=False)
    got["chunk.kv"] = chunk_kv(llm, doc_ids)
    return {k: v.contiguous() for k, v in got.items()}


def golden_llm(model: str | None = None):
    """The engine the goldens are captured with: float32, 2 threads, no prefix cache, MKL's
    GEMMs (``cpu_gemm="mkl"``) and the torch reference attention, every row through the last
    layer (as when they were recorded; the pruned last layer is held to this path in
    tests/models/test_prune_last_layer); blocks of 4 tokens for the tiny models, 16 for the
    embedded one (``model=None``)."""
    return QuietLLM(
        model,
        dtype="float32",
        block_size=16 if model is None else 4,
        num_threads=2,
        enable_prefix_caching=False,
        attention_backend="torch",
        prune_last_layer=False,
        cpu_gemm="mkl",
    )


def cpu_kind() -> str:
    """The goldens' key: architecture, CPU vendor and the kernels torch picks for this CPU.

    MKL and oneDNN choose code paths by vendor as well as by instruction set, so the same torch
    build rounds fp32 differently on an Intel and an AMD x86-64 CPU with the same AVX-512."""
    import platform

    from blendkv.layers.linear import cpu_vendor

    return f"{platform.machine()}-{cpu_vendor()}-{torch.backends.cpu.get_cpu_capability()}"
