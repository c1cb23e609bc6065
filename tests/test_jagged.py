"""The one jagged layout: cutting a run, taking rows, merging tails and indexing a key equal
a naive reference built row by row from Python lists."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from remoteloader import jagged
from remoteloader.columns import SparseColumn
from tests.conftest import examples

Rows = list[list[list[int]]]  # [key][row] -> the row's ids


def _rows(rng: np.random.Generator, keys: int, rows: int) -> Rows:
    return [[rng.integers(-99, 99, rng.integers(0, 4)).tolist() for _ in range(rows)] for _ in range(keys)]


def _piece(rows: Rows, n: int, weighted: bool) -> jagged.Jagged:
    """A key-major piece of ``n`` rows, naively: key by key, row by row (weights are -id)."""
    lengths = [len(row) for key in rows for row in key]
    values = [v for key in rows for row in key for v in row]
    return jagged.Jagged(len(rows), n, np.array(lengths, np.int32), np.array(values, np.int64),
                         -np.array(values, np.float32) if weighted else None)


def _tensors(piece: jagged.Jagged, first_row: int) -> dict[str, np.ndarray]:
    out = {jagged.LENGTHS: piece.lengths, jagged.VALUES: piece.values,
           "labels": np.arange(first_row, first_row + piece.rows, dtype=np.float32)}
    if piece.weights is not None:
        out[jagged.WEIGHTS] = piece.weights
    return out


@settings(max_examples=examples(80), deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6), keys=st.integers(0, 4), weighted=st.booleans(),
       seed=st.integers(0, 2**31))
def test_a_run_cuts_back_into_its_pieces_and_any_range_of_them(sizes, keys, weighted, seed):
    rng = np.random.default_rng(seed)
    bounds = np.cumsum([0, *sizes])
    pieces = [_tensors(_piece(_rows(rng, keys, n), n, weighted), int(lo)) for n, lo in zip(sizes, bounds)]
    run = {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}
    value_bounds = jagged.offsets(run[jagged.LENGTHS])[keys * bounds]

    for want, have in zip(pieces, jagged.cut(run, keys, bounds, value_bounds), strict=True):
        assert set(have) == set(want)
        for name in want:
            assert np.array_equal(have[name], want[name])
            assert np.shares_memory(have[name], run[name]) or not want[name].size  # a view, not a copy
    lo, hi = sorted(rng.integers(0, len(sizes) + 1, 2))
    taken = jagged.take_rows(run, keys, (bounds[lo], bounds[hi]), (value_bounds[lo], value_bounds[hi]))
    for name, a in taken.items():
        want = [p[name] for p in pieces[lo:hi]]
        assert np.array_equal(a, np.concatenate(want) if want else run[name][:0])


@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(0, 20), piece_rows=st.integers(1, 8), keys=st.integers(0, 4), weighted=st.integers(0, 2),
       seed=st.integers(0, 2**31))
def test_features_as_a_run_of_pieces_are_each_piece_key_major(n, piece_rows, keys, weighted, seed):
    """``piece_major`` (the worker's layout of a split's features) equals its pieces built
    naively, one after the other; columns whose offsets start past 0 (views of a larger
    buffer), weights on some columns only (``weighted``: 0 none, 1 the first, 2 all)."""
    rng = np.random.default_rng(seed)
    rows = _rows(rng, keys, n)
    columns = []
    for k, key in enumerate(rows):
        pad = int(rng.integers(0, 3))  # values before the column's first row: its offsets start there
        values = np.array([7] * pad + [v for row in key for v in row], np.int64)
        offsets = pad + np.concatenate([[0], np.cumsum([len(row) for row in key])]).astype(np.int64)
        has_weights = weighted == 2 or (weighted == 1 and k == 0)
        columns.append(SparseColumn(values, offsets, -values.astype(np.float32) if has_weights else None))
    run, value_starts = jagged.piece_major(columns, n, piece_rows)
    pieces = [_piece([key[lo:lo + piece_rows] for key in rows], min(piece_rows, n - lo), weighted=True)
              for lo in range(0, n, piece_rows)]
    assert (run.keys, run.rows) == (keys, n)
    assert run.lengths.dtype == np.int32 and run.values.dtype == np.int64
    assert run.lengths.tolist() == [x for p in pieces for x in p.lengths.tolist()]
    assert run.values.tolist() == [x for p in pieces for x in p.values.tolist()]
    assert value_starts.tolist() == np.cumsum([0] + [p.values.shape[0] for p in pieces]).tolist()
    assert (run.weights is None) == (weighted == 0 or keys == 0)
    if run.weights is not None:  # 1.0 where a column has none
        ones = [np.ones(sum(len(r) for r in key[lo:lo + piece_rows]), np.float32) if columns[k].weights is None
                else -np.array([v for r in key[lo:lo + piece_rows] for v in r], np.float32)
                for lo in range(0, n, piece_rows) for k, key in enumerate(rows)]
        assert np.array_equal(run.weights, np.concatenate(ones) if ones else np.zeros(0, np.float32))


@settings(max_examples=examples(80), deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=5), keys=st.integers(0, 4), weighted=st.booleans(),
       seed=st.integers(0, 2**31))
def test_merging_row_ranges_of_pieces_is_key_major_over_their_rows(sizes, keys, weighted, seed):
    rng = np.random.default_rng(seed)
    rows = [_rows(rng, keys, n) for n in sizes]
    ranges = [sorted(rng.integers(0, n + 1, 2)) for n in sizes]
    parts = [(_piece(r, n, weighted), int(a), int(b)) for r, n, (a, b) in zip(rows, sizes, ranges)]

    merged = [[row for r, (a, b) in zip(rows, ranges) for row in r[k][a:b]] for k in range(keys)]
    want = _piece(merged, sum(b - a for a, b in ranges), weighted)
    have = jagged.concat_rows(parts)
    assert (have.keys, have.rows) == (want.keys, want.rows)
    assert np.array_equal(have.lengths, want.lengths) and have.lengths.dtype == np.int32
    assert np.array_equal(have.values, want.values) and have.values.dtype == np.int64
    assert (have.weights is None) == (not weighted)
    assert have.weights is None or np.array_equal(have.weights, want.weights)


@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(0, 9), keys=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_one_key_of_a_piece(n, keys, seed):
    rows = _rows(np.random.default_rng(seed), keys, n)
    piece = _piece(rows, n, weighted=False)
    offset_per_key = np.concatenate([[0], np.cumsum(piece.lengths.reshape(keys, n).sum(axis=1))])
    for k in range(keys):
        lengths, values = jagged.key_ranges(k, n, offset_per_key)
        assert piece.lengths[lengths].tolist() == [len(row) for row in rows[k]]
        assert piece.values[values].tolist() == [v for row in rows[k] for v in row]
