"""``SamplingParams.prompt_logprobs``: per prompt token, its logprob and the k most likely.

The engine asks the model runner for the logits of every prompt position (``logits_from=0``,
which also stops prefix-cache matching: a cached prompt is recomputed, so its values are those
of a fresh forward). Row j's logits predict token j + 1, so the first prompt token has no
logprob (None, as in vLLM) and the last row, which predicts the first output token, is unused.
Blended prompts refuse it: their reused chunks' rows are not computed through every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def prompt_logprobs(
    logits: torch.Tensor, token_ids: list[int], k: int
) -> list[dict[int, float] | None]:
    """``[None, {token_1: lp, top...}, ...]`` from ``logits`` ``[len(token_ids), vocab]``.

    Entry i > 0 maps the prompt's token i to its logprob first, then the k most likely tokens
    at that position (the prompt token is not repeated when it is among them).
    """
    assert logits.shape[0] == len(token_ids), (tuple(logits.shape), len(token_ids))
    out: list[dict[int, float] | None] = [None]
    if len(token_ids) < 2:
        return out
    import torch

    lp = logits[:-1].float().log_softmax(dim=-1)
    targets = torch.tensor(token_ids[1:], dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    if k > 0:
        top_values, top_ids = lp.topk(k, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for i, t in enumerate(token_ids[1:]):
        entry = {t: chosen[i]}
        if k > 0:
            entry.update((tid, v) for tid, v in zip(top_ids[i], top_values[i], strict=True))
            entry[t] = chosen[i]
        out.append(entry)
    return out
