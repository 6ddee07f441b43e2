"""How each prompt token's K/V was computed in one blended prefill: the per-token map.

Asked for per request (``LLM.generate(..., token_map=True)``, the server's ``"token_map": true``);
a request that does not ask records nothing. While the fused prefill runs, the row plan fills a
:class:`TokenTrace` (which rows left the recompute set at which selection layer, their selection
scores, which kept rows the K/V correction moved); after the forward :func:`build_token_map`
turns it, the prompt's chunk spans and ProphetKV's query scores into a :class:`TokenMap`.

Every prompt token gets one kind (its one-letter code in :attr:`TokenMap.kinds`)::

    p  prefix_cached  K/V from the engine's prefix cache (no fused prefill computed it)
    s  reused         a chunk token whose stored K/V was used as stored
    c  corrected      a chunk token whose stored K/V was used, moved by the K/V correction
    r  recomputed     a chunk token selected and recomputed through every layer
    n  computed       no stored K/V: template, instruction, query, template suffix

The counts match :class:`~blendkv.blend.stats.BlendStats`: ``p`` = ``prefix_cached_tokens``,
``r`` = ``reused_tokens_recomputed``, ``s + c`` = ``reused_tokens_kept``, ``n`` =
``other_tokens_computed``; all five add up to the prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = {
    "p": "prefix_cached",
    "s": "reused",
    "c": "corrected",
    "r": "recomputed",
    "n": "computed",
}
CODES = {name: code for code, name in KINDS.items()}


@dataclass
class TokenTrace:
    """What the fused prefill did to each of one sequence's rows in the step (``num_rows``, row
    ``i`` at absolute position ``start + i``), filled by the row plan. CPU tensors.

    dropped_at: the selection layer where the row left the recompute set (-1: it never did).
    scores: the selection score of its last selection as a candidate (NaN: never scored).
    forced: it was picked without a score (``chunk_head_tokens``, ``chunk_samples``).
    corrected: the K/V correction moved its stored K/V at some layer.
    chunk_tiers: per chunk of the prompt, where its K/V came from (``device``, ``memory``, the
        store's tier, ``computed`` for a miss computed now; None: not loaded in this step).
    selections: (layer, score name) of every selection that scored rows, in layer order.
    """

    num_rows: int
    chunk_tiers: list[str | None] = field(default_factory=list)
    dropped_at: torch.Tensor = field(init=False)
    scores: torch.Tensor = field(init=False)
    forced: torch.Tensor = field(init=False)
    corrected: torch.Tensor = field(init=False)
    selections: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.num_rows
        self.dropped_at = torch.full((n,), -1, dtype=torch.long)
        self.scores = torch.full((n,), float("nan"), dtype=torch.float32)
        self.forced = torch.zeros(n, dtype=torch.bool)
        self.corrected = torch.zeros(n, dtype=torch.bool)

    def record_scores(
        self, layer: int, name: str, rows: torch.Tensor, scores: torch.Tensor, forced
    ) -> None:
        """``rows`` (the sequence's row indices) were scored ``scores`` by ``name``."""
        if not self.selections or self.selections[-1][0] != layer:
            self.selections.append((layer, name))
        scores = scores.detach().float().cpu()
        self.scores[rows] = torch.where(torch.isfinite(scores), scores, float("nan"))
        if forced is not None:
            self.forced[rows] |= forced.cpu()

    def record_dropped(self, layer: int, rows: torch.Tensor) -> None:
        self.dropped_at[rows] = layer

    def record_corrected(self, rows: torch.Tensor) -> None:
        self.corrected[rows] = True


@dataclass
class TokenMap:
    """How each prompt token's K/V was computed (module docstring). Lists are per prompt token.

    kinds: one code letter per token (:data:`KINDS`).
    chunks / offsets: the token's chunk (its index in the prompt) and its offset in it; -1
        outside chunks.
    chunk_spans: ``[start, end)`` positions of every chunk; chunk_tiers: where each chunk's K/V
        came from (:class:`TokenTrace`), None where nothing was loaded; chunk_exact: its stored
        K/V is already full prefill's (stored behind exactly the prompt's tokens before it,
        losslessly), so it is never worth recomputing (``BlendConfig.skip_exact``).
    dropped_at: the selection layer where a chunk token left the recompute set (-1: never, or
        not a chunk token); its stored K/V is used from there on.
    scores: a chunk token's selection score at its last selection (None: not scored), by the
        score of that layer in ``selections`` (``[(layer, score name)]``); forced: picked
        without a score.
    query_mass: ProphetKV's query pass: the share of the question's attention (summed over
        layers, heads and query rows; the shares add up to 1) each token received; None
        without a query pass.
    """

    kinds: str
    chunks: list[int]
    offsets: list[int]
    chunk_spans: list[tuple[int, int]]
    num_layers: int
    chunk_tiers: list[str | None] = field(default_factory=list)
    chunk_exact: list[bool] = field(default_factory=list)
    dropped_at: list[int] | None = None
    scores: list[float | None] | None = None
    forced: list[bool] | None = None
    selections: list[tuple[int, str]] = field(default_factory=list)
    query_mass: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.kinds)

    def counts(self) -> dict[str, int]:
        """Tokens of each kind, by name (every kind present, 0 where none)."""
        return {name: self.kinds.count(code) for code, name in KINDS.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the server's ``blendkv.token_map`` (floats to 4 significant digits)."""
        return {
            "num_tokens": self.num_tokens,
            "kinds": self.kinds,
            "legend": dict(KINDS),
            "counts": self.counts(),
            "chunks": self.chunks,
            "offsets": self.offsets,
            "chunk_spans": [list(s) for s in self.chunk_spans],
            "chunk_tiers": self.chunk_tiers,
            "chunk_exact": self.chunk_exact,
            "num_layers": self.num_layers,
            "dropped_at": self.dropped_at,
            "scores": _rounded(self.scores),
            "forced": self.forced,
            "selections": [{"layer": layer, "score": name} for layer, name in self.selections],
            "query_mass": _rounded(self.query_mass),
        }


def _rounded(values: list[float | None] | None) -> list[float | None] | None:
    if values is None:
        return None
    return [None if v is None else float(f"{v:.4g}") for v in values]


def _chunk_positions(num_tokens: int, chunk_spans: list[tuple[int, int]]):
    chunks, offsets = [-1] * num_tokens, [-1] * num_tokens
    for i, (s, e) in enumerate(chunk_spans):
        chunks[s:e] = [i] * (e - s)
        offsets[s:e] = range(e - s)
    return chunks, offsets


def plain_token_map(
    num_tokens: int, chunk_spans: list[tuple[int, int]], num_cached: int, num_layers: int
) -> TokenMap:
    """The map of a prompt no fused prefill ran for (full prefill of its tokens, or every
    chunk token served by the prefix cache): ``num_cached`` prefix tokens, the rest computed."""
    chunks, offsets = _chunk_positions(num_tokens, chunk_spans)
    kinds = "p" * num_cached + "n" * (num_tokens - num_cached)
    return TokenMap(kinds, chunks, offsets, list(chunk_spans), num_layers)


def build_token_map(
    num_tokens: int,
    chunk_spans: list[tuple[int, int]],
    start: int,
    num_layers: int,
    reused: torch.Tensor,
    trace: TokenTrace,
    query_scores: torch.Tensor | None = None,
    exact: torch.Tensor | None = None,
) -> TokenMap:
    """The map of a fused prefill of the rows from position ``start`` on (``trace.num_rows``
    of them; positions before ``start`` came from the prefix cache, any after the rows are
    computed by plain prefill). ``reused``: bool per row, its stored K/V was loaded;
    ``query_scores``: ProphetKV's query mass by absolute position, or None; ``exact``: bool
    per row, its stored K/V is full prefill's (or None: no such row)."""
    end = start + trace.num_rows
    assert len(reused) == trace.num_rows and end <= num_tokens
    chunks, offsets = _chunk_positions(num_tokens, chunk_spans)
    is_reused = reused.tolist()
    dropped = trace.dropped_at.tolist()
    corrected = trace.corrected.tolist()
    kinds = ["p"] * start
    for i, r in enumerate(is_reused):
        if not r:
            kinds.append("n")
        elif dropped[i] < 0:
            kinds.append("r")
        else:
            kinds.append("c" if corrected[i] else "s")
    kinds += ["n"] * (num_tokens - end)
    before, after = [-1] * start, [-1] * (num_tokens - end)
    scores = [None if s != s else s for s in trace.scores.tolist()]  # NaN: not scored
    chunk_exact = [False] * len(chunk_spans)
    if exact is not None:
        for i, (_, e) in enumerate(chunk_spans):
            chunk_exact[i] = e > start and bool(exact[e - 1 - start])
    mass = None
    if query_scores is not None:
        q = query_scores.detach().float().cpu()[:num_tokens]
        total = float(q.sum())
        mass = (q / total if total > 0 else q).tolist() + [0.0] * (num_tokens - len(q))
    return TokenMap(
        kinds="".join(kinds),
        chunks=chunks,
        offsets=offsets,
        chunk_spans=list(chunk_spans),
        num_layers=num_layers,
        chunk_tiers=list(trace.chunk_tiers),
        chunk_exact=chunk_exact,
        dropped_at=before
        + [d if r else -1 for d, r in zip(dropped, is_reused, strict=True)]
        + after,
        scores=[None] * start + scores + [None] * (num_tokens - end),
        forced=[False] * start + trace.forced.tolist() + [False] * (num_tokens - end),
        selections=list(trace.selections),
        query_mass=mass,
    )
