"""How far blends drift from full prefill on a store's own chunks, per recompute ratio: what
``BlendConfig(fidelity_target=...)`` picks its ratio from.

``blendkv calibrate --store S`` (:func:`calibrate`) builds prompts from the store's chunks
(random sets of chunks, each followed by a question; with ``--questions FILE``, each of the
user's questions over the chunks it retrieves: :func:`calibrate_prompts`), runs full prefill's
greedy answer, then teacher-forces the blend at each ratio of a grid along it. A prompt's
**divergence** at a ratio is the largest next-token KL(full prefill || blend) over the
answer's first tokens, in nats: the measure that catches a flip (one token where the two
answers part), not a mean a flip barely moves. Per ratio the curve keeps the 90th percentile
of the prompts' divergences with a bootstrap interval, made non-increasing in the ratio (a
higher ratio never promises more drift). :meth:`Calibration.ratio_for` is the smallest ratio
whose interval's upper end is within the target; ratio 1.0 is full prefill's answer (the start
gate checks it), so a target no measured ratio meets gets 1.0, which the cost check then runs
as full prefill.

The curve is kept with the store (:func:`save_calibration`): beside an LMDB store
(``calibration.json``), under a key of a Redis store (every engine sharing it reads it), tied
to the model's fingerprint: a store's calibration is refused for another model.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from blendkv.errors import BlendKVError
from blendkv.guards.measure import ANSWER_TOKENS, QUANTILE, quantile

CALIBRATION_FILE = "calibration.json"
CALIBRATION_KEY = "calibration"  # in a Redis store
DEFAULT_RATIOS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
# A target without a calibration: a ratio that keeps most prompts near full prefill on the
# models measured (docs/guide/fidelity.md). A target of 0 runs full prefill instead.
UNCALIBRATED_RATIO = 0.3
# The largest of n prompts' divergences is at least their 90th percentile with chance 1 - 0.9**n:
# 95 % from 29 prompts on. With fewer, a pick can rest on whether one rare hard prompt was drawn.
CONFIDENT_PROMPTS = 29
DEFAULT_PROMPTS = 32
QUESTIONS = (
    "What do these passages say?",
    "Which names and numbers appear above?",
    "Summarize the passages in one sentence.",
    "What is the main fact stated above?",
)


class CalibrationError(BlendKVError):
    """A calibration that cannot be made, read or used (another model's, an empty store)."""


@dataclass(frozen=True)
class Calibration:
    """Per recompute ratio, the ``QUANTILE`` of the prompts' divergence (nats) and its
    bootstrap interval, non-increasing in the ratio.

    Attributes:
        fingerprint: the digest of the model fingerprint it was measured with.
        ratios: the recompute ratios measured, ascending.
        divergence: per ratio, the 90th percentile of the prompts' largest next-token KL.
        low: per ratio, the lower end of that percentile's 90% bootstrap interval.
        high: per ratio, the upper end.
        num_prompts: the prompts measured.
        seconds: how long the calibration ran.
        chunks_per_prompt: the stored chunks each prompt held (0: not recorded). Drift grows
            with a prompt's passages, so a curve holds for prompts about this long.
    """

    fingerprint: str
    ratios: tuple[float, ...]
    divergence: tuple[float, ...]
    low: tuple[float, ...]
    high: tuple[float, ...]
    num_prompts: int
    seconds: float = 0.0
    chunks_per_prompt: int = 0

    def ratio_for(self, target: float) -> float:
        """The smallest ratio whose interval's upper end is within ``target`` nats; 1.0 (full
        prefill's answer) when none is."""
        for ratio, high in zip(self.ratios, self.high, strict=True):
            if high <= target:
                return ratio
        return 1.0

    def save(self, store_dir: str | Path) -> Path:
        """Write it beside the LMDB store in ``store_dir``."""
        path = Path(store_dir) / CALIBRATION_FILE
        path.write_text(self.to_json())
        return path

    @staticmethod
    def stamp(store_dir: str | Path) -> tuple[int, int] | None:
        """The saved file's modification time and size (None: none saved): what tells a
        reader that holds a calibration that a newer one was saved."""
        try:
            st = (Path(store_dir) / CALIBRATION_FILE).stat()
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size

    @classmethod
    def load(cls, store_dir: str | Path, fingerprint: str) -> Calibration | None:
        """The calibration saved beside the store in ``store_dir``; None when there is none.
        Raises :class:`CalibrationError` when it was measured with another model."""
        path = Path(store_dir) / CALIBRATION_FILE
        if not path.exists():
            return None
        return cls.from_json(path.read_text(), fingerprint, str(path))

    @classmethod
    def from_json(cls, text: str | bytes, fingerprint: str, where: str) -> Calibration:
        """A saved calibration (``where``: what a message names). Raises
        :class:`CalibrationError` when it was measured with another model."""
        data = json.loads(text)
        if data.get("fingerprint") != fingerprint:
            raise CalibrationError(
                f"{where} was measured with another model (fingerprint "
                f"{str(data.get('fingerprint'))[:12]}..., this engine's {fingerprint[:12]}...); "
                "run `blendkv calibrate` again with this model"
            )
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    def table(self) -> str:
        """The curve, a line per ratio."""
        lines = [f"ratio  p{QUANTILE * 100:.0f} divergence (nats)  90% interval"]
        for r, d, lo, hi in zip(self.ratios, self.divergence, self.low, self.high, strict=True):
            lines.append(f"{r:5.2f}  {d:21.4f}  [{lo:.4f}, {hi:.4f}]")
        return "\n".join(lines)


def calibrate(
    llm,
    chunk_ids: list[int],
    instruction: str | None,
    *,
    ratios: tuple[float, ...] = DEFAULT_RATIOS,
    num_prompts: int = DEFAULT_PROMPTS,
    chunks_per_prompt: int = 6,
    seconds: float | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Calibration:
    """Measure the divergence of blends at ``ratios`` on ``num_prompts`` prompts of
    ``chunks_per_prompt`` random stored chunks (``chunk_ids``) each, followed by a generic
    question; stop early, with at least two prompts, once ``seconds`` have passed.
    ``progress(1)`` after each prompt."""
    if not chunk_ids:
        raise CalibrationError("the store holds no document chunks to calibrate on: ingest first")
    rng = random.Random(seed)

    def prompts() -> Iterator[dict]:
        for _ in range(num_prompts):
            picked = rng.sample(chunk_ids, min(chunks_per_prompt, len(chunk_ids)))
            prompt = {
                "chunk_ids": picked,
                "query": f"\n\nQuestion: {rng.choice(QUESTIONS)}\nAnswer:",
            }
            if instruction:
                prompt["instruction"] = instruction
            yield prompt

    return calibrate_prompts(
        llm, prompts(), ratios=ratios, seconds=seconds, seed=seed, progress=progress
    )


def calibrate_prompts(
    llm,
    prompts: Iterable[dict],
    *,
    ratios: tuple[float, ...] = DEFAULT_RATIOS,
    seconds: float | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Calibration:
    """Measure the divergence of blends at ``ratios`` on the blended ``prompts`` given (``ask``
    prompts of a query log: each question with the chunks it retrieves); stop early, with at
    least two prompts, once ``seconds`` have passed. ``progress(1)`` after each prompt."""
    if any(not 0.0 <= r < 1.0 for r in ratios) or list(ratios) != sorted(set(ratios)):
        raise CalibrationError(f"ratios must be ascending in [0, 1), got {ratios}")
    t0 = time.perf_counter()
    rows: list[list[float]] = []  # per prompt, per ratio: its divergence
    sizes: list[int] = []
    for prompt in prompts:
        rows.append(prompt_divergence(llm, prompt, ratios))
        sizes.append(len(prompt.get("chunk_ids") or prompt.get("documents") or ()))
        if progress is not None:
            progress(1)
        if seconds is not None and len(rows) >= 2 and time.perf_counter() - t0 > seconds:
            break
    if len(rows) < 2:
        raise CalibrationError(f"a calibration needs at least 2 prompts, got {len(rows)}")
    per_prompt = round(statistics.median(sizes))
    rng = random.Random(seed)
    return _curve(llm, ratios, rows, rng, time.perf_counter() - t0, per_prompt)


def prompt_divergence(llm, prompt: dict, ratios: tuple[float, ...]) -> list[float]:
    """Per ratio, the largest next-token KL(full || blend) along full prefill's greedy answer."""
    from blendkv.blend.config import BlendConfig
    from blendkv.guards.fidelity import answer_divergence, teacher_forced_logits
    from blendkv.sampling_params import SamplingParams

    ids = list(llm.blend_manager().prepare(prompt, None).prompt.token_ids)
    greedy = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    answer = list(llm.generate([ids], greedy)[0].outputs[0].token_ids)
    scored = max(1, len(answer))
    ref = teacher_forced_logits(llm, ids, answer).rows[:scored]
    out = []
    for ratio in ratios:
        config = BlendConfig(recompute_ratio=ratio)
        test = teacher_forced_logits(llm, ids, answer, prompt, config).rows[:scored]
        out.append(answer_divergence(ref, test, scored))
    return out


def _curve(
    llm, ratios, rows: list[list[float]], rng: random.Random, seconds: float, per_prompt: int
):
    """The quantile per ratio with a bootstrap interval, made non-increasing in the ratio."""
    columns = list(zip(*rows, strict=True))
    point = [quantile(list(c)) for c in columns]
    boots = [[quantile(rng.choices(c, k=len(c))) for _ in range(1000)] for c in columns]
    low = [quantile(b, 0.05) for b in boots]
    high = [quantile(b, 0.95) for b in boots]
    # the upper envelope from the high ratios down: a higher ratio never promises more drift
    for values in (point, low, high):
        for i in range(len(values) - 2, -1, -1):
            values[i] = max(values[i], values[i + 1])
    fingerprint = llm.blend_manager().fingerprint.digest()
    return Calibration(
        fingerprint,
        tuple(ratios),
        tuple(point),
        tuple(low),
        tuple(high),
        len(rows),
        seconds,
        per_prompt,
    )


def calibrate_store(
    pipeline,
    *,
    ratios: tuple[float, ...] = DEFAULT_RATIOS,
    prompts: int = DEFAULT_PROMPTS,
    chunks_per_prompt: int = 6,
    questions: Sequence[str] | None = None,
    top_k: int = 6,
    seconds: float | None = None,
    seed: int = 0,
    progress: bool = True,
) -> str:
    """Calibrate a :class:`~blendkv.rag.RAGPipeline`'s LMDB store (a progress bar) and save the
    curve beside it; returns what ``blendkv calibrate`` and ``blendkv ingest --calibrate``
    print: the curve and where it went. The prompts are ``prompts`` random sets of
    ``chunks_per_prompt`` stored chunks with generic questions or, given ``questions`` (a
    sample of the user's traffic), the first ``prompts`` of them, each over the ``top_k``
    chunks it retrieves, as :meth:`~blendkv.rag.RAGPipeline.query` builds it."""
    from tqdm import tqdm

    total = prompts if questions is None else min(prompts, len(questions))
    with tqdm(total=total, desc="calibrating", disable=not progress) as bar:
        if questions is None:
            ids = [m.chunk_id for m in pipeline.store.kv.iter_meta() if m.doc_id]
            calibration = calibrate(
                pipeline.llm,
                ids,
                pipeline.instruction,
                ratios=ratios,
                num_prompts=prompts,
                chunks_per_prompt=chunks_per_prompt,
                seconds=seconds,
                seed=seed,
                progress=bar.update,
            )
        else:
            calibration = calibrate_prompts(
                pipeline.llm,
                _question_prompts(pipeline, questions[:total], top_k),
                ratios=ratios,
                seconds=seconds,
                seed=seed,
                progress=bar.update,
            )
    path = pipeline.manager.save_calibration(calibration)
    kind = "chunks" if questions is None else "retrieved chunks"
    done = (
        f"{calibration.num_prompts} prompts of {calibration.chunks_per_prompt} {kind} in "
        f"{calibration.seconds:.0f} s; saved to {path}"
    )
    lines = [calibration.table(), done, default_pick(calibration)]
    if calibration.num_prompts < CONFIDENT_PROMPTS:
        lines.append(few_prompts_note(calibration.num_prompts))
    return "\n".join(lines)


def max_bound_confidence(num_prompts: int, q: float = QUANTILE) -> float:
    """The chance that the largest of ``num_prompts`` independent divergences is at least their
    ``q``-quantile: how surely a curve's upper end, at most that largest, bounds the quantile."""
    return 1.0 - q**num_prompts


def few_prompts_note(num_prompts: int) -> str:
    """What a calibration on fewer than :data:`CONFIDENT_PROMPTS` prompts should be told."""
    chance = max_bound_confidence(num_prompts)
    return (
        f"note: the largest of {num_prompts} prompts bounds the p{QUANTILE * 100:.0f} with "
        f"{chance:.0%} confidence; {CONFIDENT_PROMPTS} or more give 95% (--prompts; a rare "
        "hard prompt missed can lower the pick)"
    )


def default_pick(calibration: Calibration) -> str:
    """What the calibration means for requests that pass no config: the ratio the default
    target picks on the store."""
    from blendkv.blend.config import DEFAULT_TARGET

    ratio = calibration.ratio_for(DEFAULT_TARGET)
    ran = "full prefill" if ratio >= 1.0 else f"ratio {ratio:g}"
    return f"the default fidelity target ({DEFAULT_TARGET:g} nat) picks {ran} on this store"


def _question_prompts(pipeline, questions: Sequence[str], top_k: int) -> Iterator[dict]:
    """Each question's blended prompt over the chunks it retrieves, in the pipeline's order."""
    if len(questions) < 2:
        raise CalibrationError(f"a calibration needs at least 2 questions, got {len(questions)}")
    for question in questions:
        sources = pipeline.order_sources(pipeline.retrieve(question, top_k))
        yield pipeline.blended_prompt(question, sources)


def save_calibration(calibration: Calibration, store) -> str:
    """Keep ``calibration`` with the chunk store ``store``: beside an LMDB store's file, or
    under a key of a Redis store. Returns where it went."""
    if _in_redis(store):
        store.put_setting(CALIBRATION_KEY, calibration.to_json().encode())
        return f"{store.path} (key {CALIBRATION_KEY})"
    return str(calibration.save(store.path))


def load_calibration(store, fingerprint: str) -> Calibration | None:
    """The calibration kept with ``store`` (None: none). Raises :class:`CalibrationError` when
    it was measured with another model."""
    if not _in_redis(store):
        return Calibration.load(store.path, fingerprint)
    raw = store.get_setting(CALIBRATION_KEY)
    where = f"the calibration in {store.path}"
    return None if raw is None else Calibration.from_json(raw, fingerprint, where)


def _in_redis(store) -> bool:
    return getattr(store, "tier", None) == "redis"


def uncalibrated_note(manager, store: str) -> str | None:
    """What to tell the user of a store with no calibration for this model (None: it has one):
    its requests run the default target at the conservative ratio."""
    if manager.calibration() is not None:
        return None
    return (
        f"store {store} is not calibrated: requests run the default fidelity target at ratio "
        f"{UNCALIBRATED_RATIO:g}; `blendkv calibrate --store {store}` measures it so they run "
        "at the least ratio that meets the target"
    )
