"""The split's wire layout: any run of consecutive pieces is a view whose per-piece
slices equal the piece built on its own (key-major, as torchrec's KeyedJaggedTensor)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from remoteloader.columns import SparseColumn
from remoteloader.core.processor import TransformedSplit
from tests.conftest import examples


def _column(rng: np.random.Generator, rows: int, weighted: bool, skew: int) -> SparseColumn:
    lengths = rng.integers(0, 5, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]) + skew  # offsets need not start at 0
    values = rng.integers(-1000, 1000, int(offsets[-1]))
    weights = rng.random(values.shape[0]).astype(np.float32) if weighted else None
    return SparseColumn(values, offsets, weights)


def _piece_reference(sparse: list[SparseColumn], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, list]:
    """One piece on its own: all its rows of feature 0, then of feature 1, ..."""
    values = [c.values[c.offsets[lo]:c.offsets[hi]] for c in sparse]
    weights = [c.weights[c.offsets[lo]:c.offsets[hi]] if c.weights is not None
               else np.ones(c.offsets[hi] - c.offsets[lo], np.float32) for c in sparse]
    lengths = [np.diff(c.offsets[lo:hi + 1]) for c in sparse]
    cat = (lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt))
    return cat(values, np.int64), cat(lengths, np.int32), cat(weights, np.float32)


@settings(max_examples=examples(60), deadline=None)
@given(rows=st.integers(1, 300), batch=st.integers(1, 70), keys=st.integers(0, 4),
       weighted=st.lists(st.booleans(), min_size=4, max_size=4), seed=st.integers(0, 2**31))
def test_consecutive_pieces_are_views_of_their_own_layout(rows, batch, keys, weighted, seed):
    rng = np.random.default_rng(seed)
    sparse = [_column(rng, rows, weighted[k], skew=k) for k in range(keys)]
    dense = rng.random((rows, 3)).astype(np.float32)
    labels = rng.random(rows).astype(np.float32)
    split = TransformedSplit.build(dense, labels, sparse, {"row_id": np.arange(rows)}, None, batch)
    bounds = list(range(0, rows, batch)) + [rows]
    for p, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        got = split.arrays(lo, hi)
        values, lengths, weights = _piece_reference(sparse, lo, hi)
        assert np.array_equal(got["sparse.values"], values), p
        assert np.array_equal(got["sparse.lengths"], lengths), p
        if any(weighted[:keys]):
            assert np.array_equal(got["sparse.weights"], weights), p
        else:
            assert "sparse.weights" not in got
        assert np.array_equal(got["dense"], dense[lo:hi]) and np.array_equal(got["pt.row_id"], np.arange(lo, hi))
    # A run of pieces is the pieces one after the other, without a copy.
    first, last = 0, min(3, len(bounds) - 1)
    run = split.arrays(bounds[first], bounds[last])
    parts = [split.arrays(lo, hi) for lo, hi in zip(bounds[first:last], bounds[first + 1:last + 1])]
    for name in run:
        assert np.array_equal(run[name], np.concatenate([p[name] for p in parts]))
        assert np.shares_memory(run[name], split.tensors["sparse.values"]) or name != "sparse.values" or run[name].size == 0
