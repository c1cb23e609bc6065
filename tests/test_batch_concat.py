"""``batch.concat_rows`` (every mixed batch and merged tail is built by it) against a row-by-row
reading of the pieces it takes rows of: dense, labels, every sparse key's ids and scores,
passthrough, row weights and padding."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from remoteloader.client.batch import Batch, concat_rows
from tests.test_pinning import make_batch


def rows_of(batch: Batch) -> list[tuple]:
    """Each row of ``batch`` as plain Python values, read one row at a time."""
    kjt = batch.sparse_features
    per_key = [kjt[key] for key in kjt.keys()]
    ids = [jt.to_dense() for jt in per_key]
    scores = [list(torch.split(jt.weights(), jt.lengths().tolist())) for jt in per_key]
    return [(batch.dense_features[r].tolist(), float(batch.labels[r]),
             [ids[k][r].tolist() for k in range(len(per_key))], [scores[k][r].tolist() for k in range(len(per_key))],
             {name: t[r].item() for name, t in batch.passthrough.items()},
             float(batch.weights[r]), bool(batch.padding[r]) if batch.padding is not None else False)
            for r in range(len(batch))]


@pytest.mark.parametrize("seed", range(6))
def test_rows_of_several_pieces_are_those_pieces_rows_in_order(seed):
    rng = np.random.default_rng(seed)
    pieces = [make_batch(rows=int(rng.integers(1, 40)), seed=seed * 10 + i) for i in range(int(rng.integers(2, 9)))]
    for piece in pieces[::2]:
        piece.padding = None  # pieces with and without padding in one batch
    pieces[-1].padding = torch.from_numpy(rng.random(len(pieces[-1])) < 0.5)
    # As a mixed batch does: each piece cut in consecutive ranges, one per batch.
    cuts = [sorted({0, len(p), *rng.integers(0, len(p) + 1, 2).tolist()}) for p in pieces]
    for b in range(max(len(c) for c in cuts) - 1):
        parts = [(p, c[b], c[b + 1]) for p, c in zip(pieces, cuts) if b + 1 < len(c)]
        got = concat_rows(parts)
        assert rows_of(got) == [row for p, start, stop in parts for row in rows_of(p)[start:stop]]
        assert got.sparse_features.stride() == len(got) == sum(stop - start for _, start, stop in parts)
        assert got.sparse_features.scored_keys() == pieces[0].sparse_features.scored_keys()
        assert (got.padding is None) == all(p.padding is None for p, _, _ in parts)


def test_a_merge_writes_new_tensors_and_leaves_its_pieces_as_they_were():
    a, b = make_batch(rows=8, seed=1), make_batch(rows=8, seed=2)
    before = [rows_of(a), rows_of(b)]
    got = concat_rows([(a, 2, 8), (b, 0, 3)])
    got.dense_features.fill_(-1.0)
    got.sparse_features.values().fill_(-1)
    assert [rows_of(a), rows_of(b)] == before
