"""Full prefill's answers kept on disk, so repeated evaluations of the same prompts run only the
methods under test (``blendkv eval --reference-cache DIR``).

Full prefill is the reference of every fidelity metric and the slowest method by far; a sweep
of blend options on the same examples would recompute the same reference each time.
This cache keeps, per prompt, what the evaluation takes from full prefill: its greedy tokens
and text, its TTFT and its teacher-forced next-token logits along its answer.

    DIR/<sha256>.pt   {"version", "key", "token_ids", "text", "ttft", "num_cached_tokens", "rows"}

The key hashes everything the reference depends on: the model (architecture, weights hash,
tokenizer hash, dtype: the chunk store's fingerprint), the device and attention backend, the
greedy length, the teacher-forced length and the prompt's token ids. A file that cannot be
read, or whose stored key differs, is a miss (warned once) and is written again. A hit's TTFT
is the one measured when the entry was written: speedups over full prefill then compare runs
made at different times (the report says so).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from blendkv.eval.methods import MethodRun

__all__ = ["ReferenceCache", "reference_identity", "reference_notice"]

logger = logging.getLogger(__name__)
_VERSION = 1


def reference_notice(records: list[dict[str, Any]]) -> str | None:
    """A line for the report when some examples' full prefill came from the cache."""
    hits = sum(r["method"] == "full" and r.get("reference_cached", False) for r in records)
    if not hits:
        return None
    return (
        f"full prefill of {hits} example(s) came from --reference-cache: its TTFT (and every "
        "speedup over it) was measured in the run that stored it"
    )


def reference_identity(llm, max_tokens: int, answer_tokens: int) -> dict[str, Any]:
    """What, besides the prompt, full prefill's reference depends on, for ``llm``."""
    fp = llm.blend_manager().fingerprint
    engine = llm.engine
    return {
        "version": _VERSION,
        "architecture": fp.architecture,
        "weights_hash": fp.weights_hash,
        "tokenizer_hash": fp.tokenizer_hash,
        "dtype": str(fp.dtype),
        "device": str(engine.info.device),
        "attention_backend": type(engine.attn_backend).__name__,
        "max_tokens": max_tokens,
        "answer_tokens": answer_tokens,
    }


class ReferenceCache:
    """Full prefill's run and teacher-forced rows per prompt, in ``directory``."""

    def __init__(self, directory: str | Path, identity: dict[str, Any]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.hits = 0
        self.misses = 0

    def _key(self, token_ids: list[int]) -> str:
        text = json.dumps({**self.identity, "token_ids": list(token_ids)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, token_ids: list[int]) -> tuple[MethodRun, torch.Tensor] | None:
        """The stored run and rows of full prefill on ``token_ids``, or None."""
        key = self._key(token_ids)
        path = self.dir / f"{key}.pt"
        if not path.exists():
            self.misses += 1
            return None
        try:
            entry = torch.load(path, map_location="cpu", weights_only=True)
            if entry.get("key") != key or entry.get("version") != _VERSION:
                raise ValueError("its stored key is another prompt's")
            run = MethodRun(
                [int(t) for t in entry["token_ids"]],
                str(entry["text"]),
                float(entry["ttft"]),
                int(entry["num_cached_tokens"]),
                None,
            )
            rows = entry["rows"]
            if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
                raise ValueError("its logits are not a 2-D tensor")
        except Exception as exc:  # a torn or foreign file: recompute, never trust it
            logger.warning("reference cache: %s is unreadable (%s); recomputing it", path, exc)
            self.misses += 1
            return None
        self.hits += 1
        return run, rows

    def put(self, token_ids: list[int], run: MethodRun, rows: torch.Tensor) -> None:
        """Store full prefill's ``run`` and ``rows`` on ``token_ids`` (atomically)."""
        key = self._key(token_ids)
        entry = {
            "version": _VERSION,
            "key": key,
            "token_ids": list(run.token_ids),
            "text": run.text,
            "ttft": run.ttft,
            "num_cached_tokens": run.num_cached_tokens,
            "rows": rows.detach().to("cpu", torch.float32).contiguous(),
        }
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        os.close(fd)
        try:
            torch.save(entry, tmp)
            os.replace(tmp, self.dir / f"{key}.pt")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
