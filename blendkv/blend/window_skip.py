"""Which stored chunk tokens a sliding-window layer can read, so the loader skips the others.

At a layer with window ``w`` a row at position ``p`` reads keys ``p - w < j <= p``. A stored
(loaded) token at ``j`` is therefore read only if a row of the request sits in
``[j, j + w - 1]``, or if a later decode step does: the first decode row, at the prompt length
``n``, reads keys ``> n - w`` (later ones read later keys). Rows are given as position ranges:
the tokens the blend computes at that layer. When no reused token is ever recomputed (ratio 0,
``BlendConfig.full_reuse``) those are the prompt's non-reused tokens only; with recomputation
any reused token may become a row, and nothing is skipped.

Per layer: a global layer (no window) reads every stored token; on models that interleave the
two (Gemma 2 / 3) the loader writes each layer its own range (:func:`layer_skips`). Why nothing is
skipped with recomputation: selection may keep any reused row, and a kept row at ``p`` reads the
stored keys of ``p - w < j < p``, so every stored token but a chunk's last has a possible reader
one position later (and the last one a computed row or the next chunk's first); at a deviation-
scored selection layer every candidate's stored K/V is read as well. (At ratio 1.0 no row is
dropped: every stored value is overwritten by a fresh one before it is read, yet still loaded.)

Pure functions of positions; :mod:`blendkv.loading.chunk_loader` applies them. The prefix cache
stays safe: a blended prompt's blocks are salted with its chunk set and blend config, so a
request that hits them has the same chunk layout and query start, hence the same readable set.
"""

from __future__ import annotations

from collections.abc import Sequence

Span = tuple[int, int]  # [lo, hi) positions


def readable_ranges(rows: Sequence[Span], seq_len: int, window: int) -> list[Span]:
    """Positions a layer with ``window`` may read, as sorted disjoint ranges: ``[a - w + 1,
    b)`` for each row range ``[a, b)``, and ``[n - w + 1, n)`` for the decode steps after a
    prompt of ``seq_len`` tokens."""
    assert window >= 1, window
    pieces = [(max(0, a - window + 1), b) for a, b in rows if b > a]
    pieces.append((max(0, seq_len - window + 1), seq_len))
    merged: list[Span] = []
    for lo, hi in sorted(pieces):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        elif hi > lo:
            merged.append((lo, hi))
    return merged


def first_needed(span: Span, readable: Sequence[Span]) -> int:
    """The first position of ``span`` that ``readable`` covers (``span``'s end if none): the
    loader keeps ``[first_needed, hi)`` of a span (one contiguous write; what lies between two
    readable pieces inside it is loaded though unread, never the other way round)."""
    lo, hi = span
    for a, b in readable:
        if b > lo and a < hi:
            return max(lo, a)
    return hi


def skipped_prefixes(
    spans: Sequence[Span], rows: Sequence[Span], seq_len: int, window: int | None
) -> list[int]:
    """Per loaded span ``[lo, hi)``, how many leading tokens a layer with ``window`` never
    reads (0 for a layer without a window)."""
    if window is None:
        return [0] * len(spans)
    readable = readable_ranges(rows, seq_len, window)
    return [first_needed(span, readable) - span[0] for span in spans]


def computed_rows(loaded: Sequence[Span], start: int, seq_len: int) -> list[Span]:
    """The rows a full-reuse blend computes: the positions of ``[start, seq_len)`` outside the
    ``loaded`` spans (sorted, disjoint, inside ``[start, seq_len)``)."""
    rows, at = [], start
    for lo, hi in sorted(loaded):
        if lo > at:
            rows.append((at, lo))
        at = max(at, hi)
    if at < seq_len:
        rows.append((at, seq_len))
    return rows


def uniform_window(windows: Sequence[int | None], first_layer: int) -> int | None:
    """The window shared by every layer from ``first_layer`` on (what one chunk write covers),
    None if any of them has none or they differ (the loader then skips nothing)."""
    loaded = list(windows[first_layer:])
    if not loaded or loaded[0] is None or any(w != loaded[0] for w in loaded):
        return None
    return loaded[0]


def layer_skips(
    spans: Sequence[Span], rows: Sequence[Span], seq_len: int, windows: Sequence[int | None]
) -> list[list[int]]:
    """Per loaded span, per layer of ``windows`` (the loaded layers' windows, None for a global
    layer), how many leading tokens that layer never reads."""
    by_window = {w: skipped_prefixes(spans, rows, seq_len, w) for w in set(windows)}
    return [[by_window[w][i] for w in windows] for i in range(len(spans))]
