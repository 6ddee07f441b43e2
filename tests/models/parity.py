"""The parity gate for a model family: a tiny random-weight checkpoint, saved by transformers and
loaded through blendkv's loader, against transformers' own model (fp32, tight tolerance).

A family is a transformers config class instance plus its ``*ForCausalLM`` class
(:class:`Family`). :class:`ParityGate` saves it with ``save_pretrained`` and a byte-level BPE
tokenizer, then checks

- ``check_dense``: one pass without a KV pool, every row's logits;
- ``check_engine``: the whole engine (``LLM``) with blocks of 4, a 16-token step budget (chunked
  prefill) and a pool too small for the batch (preemption): greedy tokens and prompt logits;
  the same prompts again (prefix-cache hits); a blended prompt at recompute ratio 1.0 (its query
  rows' logits and greedy tokens equal the full prompt's in transformers);
- ``check_triton``: a short plain request and the blended one on the Triton backend (on a CPU
  under Triton's interpreter, which is slow: keep it small).

Families with a sliding window use :data:`WINDOW` (12 tokens): every prompt crosses it, so a
window off by one changes the logits. Used by ``test_parity_<family>.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from helpers import QuietLLM, hf_greedy, make_tokenizer

from blendkv import LLM, SamplingParams
from blendkv.blend.config import BlendConfig

ATOL = 2e-5  # fp32 logits of O(1-10)
WINDOW = 12  # tokens; the prompts below have 9-33
MAX_TOKENS = 6

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 33 tokens with the tiny tokenizer, the query from position 24 (short: Triton is interpreted).
BLEND_PROMPT = {
    "documents": ["Paris is in France.", "Berlin is in Germany."],
    "query": "Where is Paris?",
}


@dataclass(frozen=True)
class Family:
    """``make_config()``: a tiny transformers config of the family; ``hf_class``: its
    ``*ForCausalLM``. ``rename``: checkpoint key -> blendkv parameter name(s), for families
    that split fused checkpoint tensors at load (None: names are equal)."""

    name: str
    make_config: Callable[[], transformers.PretrainedConfig]
    hf_class: type
    rename: Callable[[str], list[str]] | None = None


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough that logits are O(1-10) and every parameter matters (HF's init
    leaves norms at 1 and biases at 0, which would hide a skipped norm weight or bias)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)


def prompts(seed: int = 0, vocab: int = 320) -> list[list[int]]:
    """Three prompts (30, 9, 21 tokens): each but the second crosses :data:`WINDOW`."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in (30, 9, 21)]


class ParityGate:
    """One family's checkpoint on disk, transformers' model of it, and the checks."""

    def __init__(self, family: Family, path: Path) -> None:
        self.family = family
        self.path = path
        config = family.make_config()
        torch.manual_seed(0)
        hf = family.hf_class(config).eval()
        randomize(hf)
        hf.save_pretrained(path, safe_serialization=True)
        tok = make_tokenizer(config.vocab_size)
        assert len(tok) <= config.vocab_size
        tok.save_pretrained(path)
        self.hf = hf
        self.prompts = prompts()
        self.refs = [hf_greedy(hf, p, MAX_TOKENS) for p in self.prompts]

    @torch.no_grad()
    def hf_logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([token_ids])).logits[0].float()

    def llm(self, **kwargs) -> LLM:
        return QuietLLM(str(self.path), dtype="float32", block_size=4, **kwargs)

    def check_parameters(self, ours: torch.nn.Module) -> None:
        """Every checkpoint tensor loaded (by its name, or the family's split names)."""
        params = dict(ours.named_parameters())
        names = []
        for name in dict(self.hf.named_parameters()):
            names += self.family.rename(name) if self.family.rename else [name]
        assert sorted(names) == sorted(params)
        if self.family.rename is None:
            hf_params = dict(self.hf.named_parameters())
            for name, p in params.items():
                assert torch.equal(p, hf_params[name]), name

    @torch.no_grad()
    def check_dense(self) -> None:
        """A pass without a KV pool (40 tokens) gives transformers' logits on every row; with
        every window one token wider or narrower it does not."""
        from blendkv.kernels.torch_attention import TorchAttentionBackend
        from blendkv.models.model_files import load_model, resolve_model

        ours = load_model(resolve_model(self.path), torch.float32, TorchAttentionBackend())
        self.check_parameters(ours)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(2, self.hf.config.vocab_size, (40,), generator=gen)
        expected = self.hf_logits(ids.tolist())
        logits = ours.compute_logits(ours(ids, torch.arange(len(ids)), None, None))
        assert expected.abs().max() > 1.0  # not vacuous
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        # A window off by one must fail the gate: the prompt crosses it.
        windowed = [layer.self_attn for layer in ours.model.layers]
        windowed = [attn for attn in windowed if attn.sliding_window is not None]
        for delta in (1, -1) if windowed else ():
            for attn in windowed:
                attn.sliding_window += delta
            off = ours.compute_logits(ours(ids, torch.arange(len(ids)), None, None))
            for attn in windowed:
                attn.sliding_window -= delta
            assert (off - expected).abs().max() > 1000 * ATOL, f"window {delta:+d} passes"

    def check_engine(self, attention_backend: str = "torch") -> None:
        """Chunked + preempted, then prefix-cache hits; then blended at ratio 1.0 (a pool
        large enough for the blended prompt)."""
        # 12 blocks of 4: one request fits, the three together (78 tokens) do not.
        llm = self.llm(
            attention_backend=attention_backend,
            max_num_batched_tokens=16,
            num_kv_blocks=12,
            max_model_len=48,
        )
        try:
            outs = llm.generate(self.prompts, GREEDY, logits_from=1)
            for out, prompt, ref in zip(outs, self.prompts, self.refs, strict=True):
                assert out.outputs[0].token_ids == ref
                rows = out.extra["prompt_logits"]
                torch.testing.assert_close(rows, self.hf_logits(prompt)[1:], atol=ATOL, rtol=0)
            assert sum(o.metrics.num_preemptions for o in outs) > 0, "meant to preempt"
            # A prompt alone, then a longer one sharing its first 28 tokens (7 blocks).
            assert llm.generate([self.prompts[0]], GREEDY)[0].outputs[0].token_ids == self.refs[0]
            longer = self.prompts[0] + [5, 6, 7]
            hit = llm.generate([longer], GREEDY)[0]
            assert hit.metrics.num_cached_tokens == 28
            assert hit.outputs[0].token_ids == hf_greedy(self.hf, longer, MAX_TOKENS)
            self.check_blended(llm)
            llm.engine.check_integrity()
        finally:
            llm.close()

    def check_blended(self, llm: LLM, max_tokens: int = MAX_TOKENS) -> None:
        """Ratio 1.0: the query rows' logits and the greedy tokens are transformers' on the
        whole blended prompt."""
        config = BlendConfig(recompute_ratio=1.0)
        state = llm.blend_manager().prepare(BLEND_PROMPT, config)
        ids, start = state.prompt.token_ids, state.prompt.query_start
        assert start > WINDOW  # the query's rows reach past the window into the documents
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([BLEND_PROMPT], params, blend=config, logits_from=start)[0]
        expected = self.hf_logits(ids)[start:]
        rows = out.extra["prompt_logits"].cpu()
        torch.testing.assert_close(rows, expected, atol=ATOL, rtol=0)
        assert out.outputs[0].token_ids == hf_greedy(self.hf, ids, max_tokens)
        assert out.blend_stats.tokens_reused == state.prompt.num_chunk_tokens > 0

    def check_triton(self) -> None:
        """The Triton backend (interpreted on a CPU): a 21-token plain request in two chunks
        plus a decode, and the blended prompt; greedy tokens and prompt logits."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        llm = self.llm(attention_backend="triton", device=device, max_num_batched_tokens=16)
        try:
            self._check_triton(llm)
        except NotImplementedError as e:  # a layer option the Triton kernels do not take yet
            pytest.xfail(f"the Triton backend refuses this family: {e}")
        finally:
            llm.close()

    def _check_triton(self, llm: LLM) -> None:
        prompt = self.prompts[2]
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        out = llm.generate([prompt], params, logits_from=1)[0]
        assert out.outputs[0].token_ids == self.refs[2][:2]
        rows = out.extra["prompt_logits"].cpu()
        torch.testing.assert_close(rows, self.hf_logits(prompt)[1:], atol=ATOL, rtol=0)
        self.check_blended(llm, max_tokens=2)
