"""The loader's sliding-window skip rule, against brute force over every position."""

from __future__ import annotations

import itertools

import pytest

from blendkv.blend.window_skip import (
    computed_rows,
    readable_ranges,
    skipped_prefixes,
    uniform_window,
)


def brute_readable(rows, seq_len, window, decode_steps=5):
    """Positions some row (or one of the next decode steps) reads at a window-``window`` layer."""
    readers = [p for a, b in rows for p in range(a, b)]
    readers += range(seq_len, seq_len + decode_steps)
    return {j for p in readers for j in range(seq_len + decode_steps) if p - window < j <= p}


def covered(ranges):
    return {j for a, b in ranges for j in range(a, b)}


@pytest.mark.parametrize("window", [1, 2, 4, 7, 40])
@pytest.mark.parametrize(
    "rows",
    [[], [(30, 34)], [(0, 3), (30, 34)], [(10, 11), (20, 22), (30, 34)], [(0, 34)]],
)
def test_readable_ranges_equal_brute_force(rows, window):
    seq_len = 34
    got = covered(readable_ranges(rows, seq_len, window))
    want = {j for j in brute_readable(rows, seq_len, window) if j < seq_len}
    assert got == want
    # an off-by-one window is a different set (the test can fail)
    if want != set(range(seq_len)):
        assert covered(readable_ranges(rows, seq_len, window + 1)) != want


def test_skipped_prefixes_are_never_read_and_the_rest_is_loaded():
    """Chunks at [2, 12) [12, 22) [22, 30), query rows [30, 34): with window 6 the query rows
    read 25.., the first decode step 29..; every skipped token is unread."""
    spans, seq_len = [(2, 12), (12, 22), (22, 30)], 34
    rows = computed_rows(spans, 0, seq_len)
    assert rows == [(0, 2), (30, 34)]
    skips = skipped_prefixes(spans, rows, seq_len, 6)
    assert skips == [10, 10, 3]
    readable = brute_readable(rows, seq_len, 6)
    for (lo, hi), skip in zip(spans, skips, strict=True):
        assert not readable & set(range(lo, lo + skip))
        assert lo + skip == hi or lo + skip in readable
    assert skipped_prefixes(spans, rows, seq_len, None) == [0, 0, 0]
    # a row between chunks (a separator at 12) keeps what it reads of the chunk before
    rows = computed_rows([(2, 11), (13, 30)], 0, seq_len)
    assert rows == [(0, 2), (11, 13), (30, 34)]
    assert skipped_prefixes([(2, 11), (13, 30)], rows, seq_len, 4) == [6, 14]


def test_prefix_hit_start_and_exhaustive_small_cases():
    for start, window in itertools.product(range(0, 12), range(1, 9)):
        spans = [(max(s, start), e) for s, e in [(1, 5), (5, 9)] if e > start]
        rows = computed_rows(spans, start, 12)
        readable = brute_readable(rows, 12, window)
        for (lo, hi), skip in zip(spans, skipped_prefixes(spans, rows, 12, window), strict=True):
            assert 0 <= skip <= hi - lo
            assert not readable & set(range(lo, lo + skip))
            assert lo + skip == hi or lo + skip in readable


def test_uniform_window():
    assert uniform_window([8, 8, 8], 0) == 8
    assert uniform_window([None, 8, 8], 1) == 8
    assert uniform_window([8, None, 8], 0) is None  # a global layer reads everything
    assert uniform_window([8, 4], 0) is None
    assert uniform_window([None, None], 0) is None
