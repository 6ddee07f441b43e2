"""The engine settings ``blendkv bench gpu`` compares with the default engine (``--variants``).

Each variant is an engine of its own, built from the same saved weights with one setting
changed, so a benchmark configures what it compares and never flips a switch on a live engine.
Per variant (one at a time beside the default engine, whose numbers are already in the row), at
every blended prompt size: its chunks precomputed into its own store, then its requests timed,
interleaved, median of ``--repeats``:

- ``serial-load``: blend with every layer loaded before the forward (``pipeline_kv_load=False``);
- ``device-tier``: blend and reuse with the chunks kept in device memory
  (``kv_device_cache_bytes`` = ``--device-tier-gb``; the warm-up run fills it);
- ``unsplit`` (Triton): blend and reuse without the prefill kernel's key splits
  (``prefill_split_keys=False``);
- ``untuned`` (Triton): blend and reuse with the prefill kernel's default tiles instead of this
  GPU's tuned table (``prefill_tiles="default"``);
- ``eager`` (CUDA graphs): full, blend and reuse with every dense piece run eagerly
  (``enforce_eager=True``), and the greedy check against the default engine's graphs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.errors import ConfigError
from blendkv.eval.bench.gpu_blend import PROPHET


@dataclass(frozen=True)
class Variant:
    """One engine setting compared: the engine options it changes, and the requests it times
    (``full``, ``blend``, ``reuse``), each reported as ``<key>`` with ``{request}`` filled in."""

    name: str
    options: dict
    requests: tuple[str, ...]
    key: str  # the row key of a request's median seconds, e.g. "{request}_device_s"


VARIANTS = ("serial-load", "device-tier", "unsplit", "untuned", "eager")


def parse_variants(text: str) -> list[str]:
    """``"eager,unsplit"`` -> the names, in the bench's order; an unknown name is refused."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise ConfigError(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    return [n for n in VARIANTS if n in names]


def make_variant(name: str, device_tier_gb: int) -> Variant:
    """The variant ``name`` (one of :data:`VARIANTS`)."""
    blend_reuse = ("blend", "reuse")
    if name == "serial-load":
        return Variant(name, {"pipeline_kv_load": False}, ("blend",), "serial_load_s")
    if name == "device-tier":
        options = {"kv_device_cache_bytes": device_tier_gb << 30}
        return Variant(name, options, blend_reuse, "{request}_device_s")
    if name == "unsplit":
        return Variant(name, {"prefill_split_keys": False}, blend_reuse, "{request}_unsplit_s")
    if name == "untuned":
        return Variant(name, {"prefill_tiles": "default"}, blend_reuse, "{request}_untuned_s")
    assert name == "eager", name
    return Variant(name, {"enforce_eager": True}, ("full", *blend_reuse), "{request}_eager_s")


def applies(name: str, llm, device_tier_gb: int) -> bool:
    """Whether the variant ``name`` changes anything on the default engine ``llm``: the
    Triton ones on the Triton backend, ``eager`` where steps replay CUDA graphs,
    ``device-tier`` with ``--device-tier-gb`` > 0."""
    if name in ("unsplit", "untuned"):
        return llm.engine.attn_backend.name == "triton"
    if name == "eager":
        return llm.engine.runner.piece_graphs is not None
    if name == "device-tier":
        return device_tier_gb > 0
    return True


def time_variant(variant: Variant, llm, prompt: dict, repeats: int) -> dict:
    """``variant``'s requests on its engine ``llm`` for one prompt: the row keys it adds."""
    one = SamplingParams(temperature=0.0, max_tokens=1)
    state = llm.blend_manager().prepare(prompt, BlendConfig())
    llm.precompute_chunks(state.prompt.chunks)
    configs = {"blend": PROPHET, "reuse": BlendConfig(recompute_ratio=0.0)}

    def run(request: str):
        if request == "full":
            return llm.generate([state.prompt.token_ids], one)[0]
        return llm.generate([prompt], one, blend=configs[request])[0]

    for request in variant.requests:  # warm: kernels, the device tier, the cost check
        run(request)
    times: dict[str, list[float]] = {r: [] for r in variant.requests}
    last = {}
    for _ in range(repeats):
        for request in variant.requests:
            last[request] = run(request)
            times[request].append(last[request].metrics.ttft)
    row = {variant.key.format(request=r): statistics.median(values) for r, values in times.items()}
    if variant.name == "eager":  # where the time goes without graphs
        from blendkv.eval.bench.profile_gpu import profile_once

        row["profile_blend_eager"] = profile_once(lambda: run("blend"))
    if variant.name == "device-tier":  # chunks the device tier served (all, once it holds them)
        stats = last["blend"].blend_stats
        row["device_tier_chunks"] = f"{stats.chunks_on_device}/{stats.num_chunks}"
    return row
