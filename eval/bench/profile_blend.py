"""Where a blended prefill's time goes (``blendkv bench blend --profile``).

Wraps the step's pieces for one request with wall-clock timers (each layer's norm, attention
and MLP; the row plan's selection and correction; final norm, logits, sampling); loading comes
from the request's :class:`~blendkv.connector.request_state.BlendStats`. Prints the row-weighted and
key-weighted compute floors (defined in docs/benchmarks.md): what the recompute would cost at
full prefill's speed, pricing rows alike or attention by (row, key) pairs. With
``prune_last_layer`` both sides count the last layer's extra rows at the Q/K/V share of a row.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

from blendkv.blend.row_plan import BlendRowPlan


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth = 0  # timed calls in progress: a call inside another counts in the outer one

    def wrap(self, obj, name: str, key, restore: list) -> None:
        """Time ``obj.name`` into ``key(args)`` (instance attribute; restored afterwards)."""
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            if self.depth:
                return original(*args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key(args)] += time.perf_counter() - t0
                self.depth -= 1

        setattr(obj, name, timed)
        restore.append((obj, name))

    def wrap_class(self, cls, name: str, key: str, patched: list, on_call=None) -> None:
        """Time the method ``cls.name`` (patched on the class) into ``key``; ``on_call(self)``
        sees each instance it runs on. ``patched`` gets what restores it."""
        original = getattr(cls, name)

        def timed(obj, *args, **kwargs):
            if on_call is not None:
                on_call(obj)
            t0 = time.perf_counter()
            try:
                return original(obj, *args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t0

        setattr(cls, name, timed)
        patched.append((cls, name, original))


@contextmanager
def profiled(llm, check_layer: int):
    """Yields a dict filled, after the block, with seconds per part of the step (the layers of
    ProphetKV's first pass apart)."""
    from blendkv.blend import prophet
    from blendkv.engine.model_runner import ModelRunner

    engine = llm.engine
    model = engine.model
    timer = _Timer()
    restore: list = []
    rows_plan: list = []
    layers = model.model.layers

    in_query_pass = [False]

    def phase(i: int) -> str:
        if in_query_pass[0]:
            return "ProphetKV pass 1"
        if i < check_layer:
            return "full layers"
        return "check layer" if i == check_layer else "recomputed layers"

    for i, layer in enumerate(layers):
        # (the pruned last layer writes its rows' K/V apart, then attends for the rows read)
        for name in ("attend_heads", "rotate_and_write"):
            timer.wrap(layer.self_attn, name, lambda a, i=i: f"{phase(i)}: attention", restore)
        timer.wrap(layer, "leave", lambda a, i=i: f"{phase(i)}: MLP", restore)  # o_proj too
        timer.wrap(layer, "enter", lambda a, i=i: f"{phase(i)}: norms+QKV", restore)
    timer.wrap(model.model.norm, "forward", lambda a: "final norm + logits", restore)
    timer.wrap(model, "compute_logits", lambda a: "final norm + logits", restore)
    timer.wrap(engine.runner, "sample", lambda a: "sampling", restore)
    patched: list = []  # (class or module, name, original)
    timer.wrap_class(BlendRowPlan, "select", "selection", patched, on_call=rows_plan.append)
    timer.wrap_class(BlendRowPlan, "before_attention", "K/V correction", patched)
    # Backends that score before attention (Triton); the torch one scores inside attention,
    # so on the CPU the scoring is part of "ProphetKV pass 1: attention".
    timer.wrap_class(prophet.QueryPassRowPlan, "select", "ProphetKV pass 1: scoring", patched)
    original_query_pass = ModelRunner._run_query_pass

    def run_query_pass(self, query_pass):
        in_query_pass[0] = True
        try:
            return original_query_pass(self, query_pass)
        finally:
            in_query_pass[0] = False

    ModelRunner._run_query_pass = run_query_pass  # where the runner runs it
    patched.append((ModelRunner, "_run_query_pass", original_query_pass))
    out: dict = {}
    try:
        yield out
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
        for obj, name in restore:
            delattr(obj, name)
        out.update(timer.seconds)
        if rows_plan:
            plan = rows_plan[-1]
            out["_row_layers"] = plan.row_layers(len(layers))
            out["_key_row_layers"] = plan.key_row_layers(len(layers))
            # rows (and their keys) computed at the last layer, and the Q/K/V share of a row
            out["_last_rows"] = plan._row_counts[-1][1]
            out["_last_keys"] = plan._key_counts[-1][1]
            out["_qkv_share"] = plan.qkv_share


def attention_share(llm, token_ids, params) -> float:
    """Attention's share of the layers' time in a full prefill of ``token_ids``, timed."""
    num_layers = len(llm.engine.model.model.layers)
    with profiled(llm, num_layers) as parts:  # every layer is a full layer
        llm.generate([token_ids], params)
    layers = {k: v for k, v in parts.items() if k.startswith("full layers:")}
    return sum(v for k, v in layers.items() if k.endswith(": attention")) / sum(layers.values())


def profile_request(llm, prompt, blend, params, full_ttft: float, attn_share: float) -> dict:
    """Run one blended request under the timers; returns seconds per part, the floors and
    the fractions of them reached. ``attn_share``: :func:`attention_share` of the prompt."""
    # The first layer that drops rows is "check layer" (layer 0 for ProphetKV).
    with profiled(llm, blend.first_selection_layer) as parts:
        out = llm.generate([prompt], params, blend=blend)[0]
    stats = out.blend_stats
    num_tokens = stats.num_prompt_tokens - stats.prefix_cached_tokens
    num_layers = len(llm.engine.model.model.layers)
    row_layers = parts.pop("_row_layers", num_tokens * num_layers)
    all_keys = num_tokens * (num_tokens + 1) // 2 + num_tokens * stats.prefix_cached_tokens
    key_row_layers = parts.pop("_key_row_layers", all_keys * num_layers)
    all_row_layers, all_key_row_layers = num_tokens * num_layers, all_keys * num_layers
    last_rows, last_keys = parts.pop("_last_rows", None), parts.pop("_last_keys", None)
    qkv_share = parts.pop("_qkv_share", 0.0)
    if llm.engine.config.prune_last_layer and last_rows is not None:
        # The last layer runs only Q/K/V for all rows but the sampled one, in the blend and
        # in full prefill alike: count what each computes there.
        skipped = 1 - qkv_share
        prompt_len = stats.num_prompt_tokens  # keys of the sampled (last) row
        row_layers -= (last_rows - 1) * skipped
        all_row_layers -= (num_tokens - 1) * skipped
        key_row_layers -= last_keys - prompt_len
        all_key_row_layers -= all_keys - prompt_len
    writes_hidden = stats.load_hidden_seconds - stats.read_hidden_seconds
    exposed_writes = stats.write_seconds - writes_hidden
    parts["store reads"] = stats.read_seconds - stats.read_hidden_seconds  # not hidden
    parts["RoPE + block writes (not hidden)"] = exposed_writes
    parts["selection"] = parts.get("selection", 0.0)  # between projection and attention
    parts["K/V correction"] = parts.get("K/V correction", 0.0)  # before attention
    covered = sum(v for k, v in parts.items())
    ttft = out.metrics.ttft
    parts["python + scheduling"] = max(0.0, ttft - covered)
    rows_share = row_layers / all_row_layers
    floor = full_ttft * rows_share
    a = attn_share
    keys_share = key_row_layers / all_key_row_layers
    key_floor = full_ttft * (a * keys_share + (1 - a) * rows_share)
    return {
        "ttft": ttft,
        "full_ttft": full_ttft,
        "floor": floor,
        "floor_fraction": floor / ttft,
        "row_layers": row_layers,
        "all_row_layers": all_row_layers,
        "attention_share": a,
        "key_row_layers_fraction": keys_share,
        "key_floor": key_floor,
        "key_floor_fraction": key_floor / ttft,
        "writes_hidden_s": writes_hidden,
        "reads_hidden_s": stats.read_hidden_seconds,
        "parts": dict(sorted(parts.items())),
    }


def print_profile(p: dict) -> None:
    print(
        f"  TTFT {p['ttft']:.3f} s; full prefill {p['full_ttft']:.3f} s; compute floor "
        f"{p['floor']:.3f} s ({p['row_layers']:,.0f} of {p['all_row_layers']:,.0f} row-layers) -> "
        f"blend reaches {100 * p['floor_fraction']:.0f}% of its floor"
    )
    if "key_floor" in p:
        print(
            f"  key-weighted floor {p['key_floor']:.3f} s (attention "
            f"{100 * p['attention_share']:.0f}% of full prefill's layer time; the computed rows "
            f"attend to "
            f"{100 * p['key_row_layers_fraction']:.1f}% of full prefill's (row, key) pairs, in "
            f"{100 * p['row_layers'] / p['all_row_layers']:.1f}% of its rows) -> blend reaches "
            f"{100 * p['key_floor_fraction']:.0f}% of it"
        )
    for name, seconds in p["parts"].items():
        print(f"    {name:40} {seconds:8.3f} s  {100 * seconds / p['ttft']:5.1f}%")
    print(f"    {'(writes hidden behind compute)':40} {p['writes_hidden_s']:8.3f} s")
    print(f"    {'(store reads hidden behind compute)':40} {p.get('reads_hidden_s', 0.0):8.3f} s")
