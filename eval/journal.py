"""An evaluation's journal on disk, so a long run survives interruption.

    DIR/run_config.json     the run's settings (checked by ``--resume``) and model facts
    DIR/per_example.jsonl   one record per (example, method), appended one example at a time

A run killed mid-way loses at most the example in flight; ``blendkv eval --resume`` reads the
journal, skips the examples it holds and appends the rest. A resumed run must have the same
settings (``--limit`` may grow): records made under other settings are not comparable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from blendkv.errors import ConfigError

__all__ = ["RESUME_KEYS", "Journal", "JournalError"]

# EvalConfig fields a resumed run must share with the journal's run.
RESUME_KEYS = (
    "data",
    "methods",
    "model",
    "dtype",
    "max_tokens",
    "seed",
    "answer_tokens",
    "max_model_len",
    "anchor",
    "anchor_boundary",
    "chunk_order",
    "calibrate",
    "calibrate_on",
)
# What a journal written before a key existed ran with.
_OLD_DEFAULTS = {
    "anchor": "prompt",
    "anchor_boundary": 0,
    "chunk_order": "source",
    "calibrate": 0,
    "calibrate_on": "passages",
}


class JournalError(ConfigError):
    """``--resume`` found a journal it cannot continue (other settings, or damaged)."""


class Journal:
    """The records of finished examples, kept in ``out_dir``.

    ``resume=False`` starts an empty journal (an earlier one in ``out_dir`` is replaced);
    ``resume=True`` continues the one there (or starts one if there is none).
    """

    def __init__(
        self, out_dir: str | Path, settings: dict[str, Any], methods: list[str], resume: bool
    ) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.dir / "run_config.json"
        self.records_path = self.dir / "per_example.jsonl"
        self.settings = {k: settings[k] for k in RESUME_KEYS}
        self.methods = list(methods)  # every finished example has one record per method
        self.records: list[dict[str, Any]] = []
        self.run_config: dict[str, Any] | None = None  # the full config of the journal's run
        if resume and self.config_path.exists():
            self._load()
        else:
            self.records_path.write_text("")
            self.config_path.unlink(missing_ok=True)

    @property
    def done_ids(self) -> set[str]:
        return {r["id"] for r in self.records}

    def start(self, run_config: dict[str, Any]) -> None:
        """Record the full config of the run (settings plus model facts)."""
        self.run_config = run_config
        doc = {"settings": self.settings, "config": run_config}
        _write_atomic(self.config_path, json.dumps(doc, indent=2) + "\n")

    def append(self, records: list[dict[str, Any]]) -> None:
        """One finished example's records, on disk before this returns."""
        with self.records_path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
        self.records.extend(records)

    def _load(self) -> None:
        doc = json.loads(self.config_path.read_text())
        theirs = doc.get("settings", {})
        theirs = {**_OLD_DEFAULTS, **theirs}
        differ = [k for k in RESUME_KEYS if theirs.get(k) != self.settings[k]]
        if differ:
            detail = ", ".join(
                f"{k}: {theirs.get(k)!r} there, {self.settings[k]!r} now" for k in differ
            )
            raise JournalError(
                f"{self.dir} holds a run with other settings ({detail}); resume with the same "
                "settings or use another --out"
            )
        self.run_config = doc.get("config")
        lines = self.records_path.read_text().splitlines() if self.records_path.exists() else []
        records = []
        for n, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if n < len(lines):  # only the last line can be cut short by a kill
                    raise JournalError(f"{self.records_path}:{n} is not valid JSON") from None
        methods = set(self.methods)
        by_id: dict[str, list[dict[str, Any]]] = {}
        for r in records:
            by_id.setdefault(r["id"], []).append(r)
        # An example counts only with a record for every method (a kill can cut one short).
        self.records = [
            r for rs in by_id.values() if {r["method"] for r in rs} == methods for r in rs
        ]
        _write_atomic(self.records_path, "".join(json.dumps(r) + "\n" for r in self.records))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
