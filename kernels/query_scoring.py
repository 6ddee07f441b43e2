"""What ProphetKV's query pass asks of attention beside the metadata: the attention its query
rows pay each key, summed over rows, heads and layers.

A backend declares how it scores (:attr:`AttentionBackend.query_scoring
<blendkv.kernels.attention.AttentionBackend.query_scoring>`):

- ``"apart"``: the pass calls ``add_query_mass`` after attention, which computes the rows'
  softmax again (the dense reference);
- ``"in_attention"``: the forward adds each :class:`QueryMassRequest`'s mass itself (q and K
  multiplied once per layer);
- ``"from_lse"``: the forward writes each row's log-sum-exp into :attr:`QueryScoring.lse_out`,
  which ``add_query_mass`` then takes instead of computing it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

ScoringKind = Literal["apart", "in_attention", "from_lse"]


@dataclass(frozen=True)
class QueryMassRequest:
    """A sequence's rows from ``first_row`` (an index into the step's rows) to its last are
    query rows: every layer's attention adds the softmax weight they pay each key, summed over
    rows and heads, to ``scores`` [seq_len] float32. ``visible_prefix``: how many leading keys
    all of them see."""

    first_row: int
    scores: torch.Tensor
    visible_prefix: int


@dataclass
class QueryScoring:
    """The query pass's scoring, passed to ``AttentionBackend.forward`` (``scoring=``) at every
    layer of the pass.

    Attributes:
        requests: per sequence index, a :class:`QueryMassRequest` (a backend scoring
            ``"in_attention"``).
        lse_out: float32 [num_tokens, num_heads] that a backend scoring ``"from_lse"`` fills
            with each (row, head)'s base-2 log-sum-exp of its scaled logits.
    """

    requests: dict[int, QueryMassRequest] = field(default_factory=dict)
    lse_out: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.requests) or self.lse_out is not None
