"""Packing chunk precompute: many chunks in one forward, each its own sequence.

Stored K/V is addressed by content, so a chunk's bits must not depend on which chunks were
computed beside it. Whether they do is the platform's: a GEMM library that picks its kernel
and reduction order by the row count rounds a row differently in a wider forward; one whose
kernel does not depend on it (oneDNN's prepacked float32 matmul on the CPU, for one) gives the
same bits. So packing is on where it is known to be exact:

- with ``deterministic=True`` the GEMMs are row-tiled (:mod:`blendkv.layers.batch_invariant`):
  up to :data:`PACK_ROWS` rows per forward;
- otherwise :func:`packing_is_exact` probes the engine's own forward once (in the warm-up at
  load, or at its first precompute of several chunks), and packing runs up to
  :data:`PROBED_PACK_ROWS` rows (the rows the probe covered) if every probe chunk came out
  bit-identical, or not at all.

Why it matters: a tiny document's forward on the CPU reads the model's weights for a dozen
rows; a step of 75 of them read them 75 times.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rows of one packed forward with row-tiled GEMMs: a step's worth of small chunks in one
# forward, its activations a few MLP widths of that many rows.
PACK_ROWS = 2048
# Rows of one packed forward that the probe vouched for (a few hundred rows already read the
# weights once for dozens of small chunks).
PROBED_PACK_ROWS = 512
# The probe's chunk lengths: a row alone, a few rows, around a 16-row tile, a longer chunk.
_PROBE_LENGTHS = (1, 5, 16, 17, 40)
_PROBE_CONTEXT = 6

ChunkForward = Callable[[list[tuple[list[int], list[int]]]], list[torch.Tensor]]


def pack(sizes: list[int], max_rows: int) -> list[list[int]]:
    """Indices of items of ``sizes`` rows, in order, in groups of at most ``max_rows`` rows
    (a longer item alone; ``max_rows`` 0: every item alone)."""
    if max_rows <= 0:
        return [[i] for i in range(len(sizes))]
    groups: list[list[int]] = []
    rows = max_rows
    for i, n in enumerate(sizes):
        if rows + n > max_rows:
            groups.append([])
            rows = 0
        groups[-1].append(i)
        rows += n
    return groups


def packing_is_exact(
    forward: ChunkForward, vocab_size: int, rows: int = PROBED_PACK_ROWS, longest: int = 256
) -> bool:
    """Whether ``forward`` (one forward of ``(context, chunk)`` sequences, each chunk's K/V)
    gives each chunk the same bits packed as alone. Probe chunks of a few lengths run alone,
    then packed twice: among themselves, and at both ends of a forward filled to ``rows`` rows
    (so they sit at other row offsets and in a wider GEMM), by sequences of at most
    ``longest`` rows. Costs about two forwards of ``rows`` rows."""
    pairs = [_probe_pair(n, vocab_size) for n in _PROBE_LENGTHS]
    alone = [forward([pair])[0] for pair in pairs]
    n = len(pairs)
    filler = _filler(rows - 2 * sum(len(c) + len(k) for c, k in pairs), vocab_size, longest)
    wide = forward(pairs + filler + pairs)
    packings = (forward(pairs), wide[:n], wide[-n:])
    return all(torch.equal(p, a) for outs in packings for p, a in zip(outs, alone, strict=True))


def _probe_pair(length: int, vocab_size: int) -> tuple[list[int], list[int]]:
    ids = [(7 + 131 * i * (length + 3)) % vocab_size for i in range(_PROBE_CONTEXT + length)]
    return ids[:_PROBE_CONTEXT], ids[_PROBE_CONTEXT:]


def _filler(rows: int, vocab_size: int, longest: int) -> list[tuple[list[int], list[int]]]:
    """Sequences of at most ``longest`` rows, ``rows`` in all (none if ``rows`` <= 1)."""
    out = []
    while rows > 1:
        n = min(rows, longest)
        ids = [(11 + 97 * i) % vocab_size for i in range(n)]
        out.append((ids[:1], ids[1:]))
        rows -= n
    return out
