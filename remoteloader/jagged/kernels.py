"""The jagged layout's compiled loops (see the package's docstring), apart so that only
processes that make runs of pieces (workers) import numba."""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def places(sizes):  # pragma: no cover (compiled)
    """Where block ``b`` of source ``s`` goes (``[sources, blocks]``, in (block, source) order),
    and where each block starts, then the end. Compiled: numpy's reductions over a few dozen
    entries cost more than this loop."""
    sources, blocks = sizes.shape
    at = np.empty((sources, blocks), np.int64)
    block_starts = np.empty(blocks + 1, np.int64)
    pos = 0
    for b in range(blocks):
        block_starts[b] = pos
        for s in range(sources):
            at[s, b] = pos
            pos += sizes[s, b]
    block_starts[blocks] = pos
    return at, block_starts


@njit(cache=True, nogil=True)
def copy_blocks(src, src_starts, dest_starts, sizes, out):  # pragma: no cover (compiled)
    for i in range(src_starts.shape[0]):
        n, s, d = sizes[i], src_starts[i], dest_starts[i]
        out[d:d + n] = src[s:s + n]


@njit(cache=True, nogil=True)
def piece_major_key(offsets, values, key, keys, piece_rows, value_at, lengths_out, values_out):  # pragma: no cover
    """Feature ``key`` of ``keys`` into a run of pieces of ``piece_rows`` rows (the last may be
    short): each piece's lengths of the key (from the column's offsets: no array of lengths
    made first) at ``keys * first_row + key * piece's rows``, and its values at ``value_at[piece]``."""
    rows = offsets.shape[0] - 1
    for p in range(value_at.shape[0]):
        r0 = p * piece_rows
        n = min(piece_rows, rows - r0)
        base = keys * r0 + key * n
        for i in range(n):
            lengths_out[base + i] = offsets[r0 + i + 1] - offsets[r0 + i]
        s, e, d = offsets[r0], offsets[r0 + n], value_at[p]
        values_out[d:d + e - s] = values[s:e]
