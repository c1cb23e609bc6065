"""The public test vectors of transforms.md and hand-checked edge cases of every operator."""
from __future__ import annotations

import math

import numpy as np
import pytest

from remoteloader.columns import DenseColumn, SparseColumn
from remoteloader.transforms import compile_features

from tests import transforms_reference as ref
from tests.transforms_reference import dense_col, sparse_col, sparse_rows, spec

I64_MIN, I64_MAX = ref.INT64_MIN, ref.INT64_MAX


def run_sparse(rows, *transforms, schema_type="id_list", dtype=np.int64):
    f = spec("f", "sparse", column="c", transforms=transforms)
    col = sparse_col(rows) if schema_type == "id_list" else dense_col(rows, dtype)
    out = compile_features([], [f], {"c": schema_type}).run({"c": col})
    return sparse_rows(out.sparse[0])


def run_dense(values, *transforms, schema_type="float", dtype=np.float64, default=None):
    f = spec("f", "dense", column="c", transforms=transforms, default=default)
    p = compile_features([f], [], {"c": schema_type})
    return p.run({"c": dense_col(values, dtype)}).dense


# -- public vectors ---------------------------------------------------------------------------
def test_sigrid_hash_public_vector():
    assert run_sparse([list(range(1, 17))], {"op": "sigrid_hash", "salt": 0, "max_value": 100}) == [
        [60, 54, 54, 9, 4, 91, 11, 67, 79, 2, 25, 92, 98, 83, 66, 2]]


def test_sigrid_hash_public_vector_dense_int():
    out = run_dense(list(range(1, 17)), {"op": "sigrid_hash", "max_value": 100}, schema_type="int", dtype=np.int64)
    assert out[:, 0].tolist() == [60, 54, 54, 9, 4, 91, 11, 67, 79, 2, 25, 92, 98, 83, 66, 2]


def test_bucketize_public_vectors():
    out = run_dense([1, 2, 3, 5, 8, 10, 11], {"op": "bucketize", "borders": [2, 5, 10]})
    assert out[:, 0].tolist() == [0, 0, 1, 1, 2, 2, 3]
    out = run_dense([1.5, 2, 3, 3.5], {"op": "bucketize", "borders": [1, 2, 2, 3, 3]})
    assert out[:, 0].tolist() == [1, 2, 4, 5]
    assert run_sparse([[1, 2, 150]], {"op": "bucketize", "borders": [1, 10, 100]}) == [[0, 1, 3]]


def test_firstx_public_vector():
    assert run_sparse([[1, 2, 3], [4], []], {"op": "firstx", "x": 2}) == [[1, 2], [4], []]


# -- edge cases --------------------------------------------------------------------------------
EXTREMES = [0, -1, 1, I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1, 2**53 + 1]


@pytest.mark.parametrize("max_value", [1, 2, 7, 100, I64_MAX])
@pytest.mark.parametrize("salt", [0, -1, I64_MIN, 12345])
def test_sigrid_hash_extremes(salt, max_value):
    got = run_sparse([EXTREMES, [], None], {"op": "sigrid_hash", "salt": salt, "max_value": max_value})
    assert got == [[ref.sigrid_hash(x, salt, max_value) for x in EXTREMES], [], []]
    assert all(0 <= v < max_value for v in got[0])


def test_bucketize_int_ids_exact_beyond_float64():
    # 2**53 + 1 is not a float64; an int border must still split it from 2**53.
    borders = [2**53, 2**53 + 1, 2**62]
    ids = [2**53 - 1, 2**53, 2**53 + 1, 2**53 + 2, I64_MAX, I64_MIN]
    assert run_sparse([ids], {"op": "bucketize", "borders": borders}) == [[ref.bucketize(x, borders) for x in ids]]
    assert run_sparse([ids], {"op": "bucketize", "borders": borders})[0] == [0, 0, 1, 2, 3, 0]


def test_bucketize_borders_outside_int64_and_fractional():
    borders = [-1e300, -(2**63), -0.5, 0.5, 1e19, math.inf]
    ids = [I64_MIN, I64_MIN + 1, -1, 0, 1, I64_MAX]
    assert run_sparse([ids], {"op": "bucketize", "borders": borders}) == [[ref.bucketize(x, borders) for x in ids]]


def test_bucketize_dense_nan_inf_and_as_sparse():
    vals = [math.nan, -math.inf, math.inf, 2.0, None]
    out = run_dense(vals, {"op": "bucketize", "borders": [2, 5, 10]})
    assert out[:, 0].tolist() == [0, 0, 3, 0, 0]
    f = spec("f", "sparse", column="c", transforms=[{"op": "bucketize", "borders": [2, 5], "as_sparse": True}])
    out = compile_features([], [f], {"c": "float"}).run({"c": dense_col([1.0, 3.0, None, 9.0], np.float64)})
    assert sparse_rows(out.sparse[0]) == [[0], [1], [0], [2]]


def test_clamp_dense_and_sparse():
    out = run_dense([math.nan, -math.inf, math.inf, 0.5, -3.0, None], {"op": "clamp", "min": -1, "max": 1})
    assert np.isnan(out[0, 0]) and out[1:, 0].tolist() == [-1, 1, 0.5, -1, 0]
    assert run_sparse([[I64_MIN, 5, I64_MAX]], {"op": "clamp", "min": 0, "max": 10}) == [[0, 5, 10]]


def test_boxcox_and_logit_edges():
    vals = [0.0, -5.0, 1.0, 2.5, math.inf, math.nan, 1e300]
    for l1, l2 in [(0.0, 0.0), (0.5, 1.0), (-1.0, 0.0), (2.0, 0.0)]:
        out = run_dense(vals, {"op": "boxcox", "lambda1": l1, "lambda2": l2})
        np.testing.assert_array_equal(out[:, 0], np.array([ref.boxcox(v, l1, l2) for v in vals], np.float32))
    out = run_dense(vals + [0.5], {"op": "logit"})
    np.testing.assert_array_equal(out[:, 0], np.array([ref.logit(v) for v in vals + [0.5]], np.float32))
    assert out[-1, 0] == 0.0 and out[0, 0] == pytest.approx(math.log(1e-6 / (1 - 1e-6)), rel=1e-6)


def test_onehot_width_and_nulls():
    f = spec("o", "dense", column="c", transforms=[{"op": "onehot", "borders": [2, 5, 10]}])
    g = spec("g", "dense", column="c")
    p = compile_features([g, f], [], {"c": "float"})
    assert p.dense_widths == [1, 4] and p.dense_width == 5
    out = p.run({"c": dense_col([1.0, 6.0, None, 11.0], np.float32)}).dense
    assert out.dtype == np.float32 and out.shape == (4, 5)
    assert out.tolist() == [[1, 1, 0, 0, 0], [6, 0, 0, 1, 0], [0, 1, 0, 0, 0], [11, 0, 0, 0, 1]]


def test_map_id_and_positive_modulus():
    mapping = {1: 10, I64_MIN: 3, "7": 70}  # string keys: JSON turns int keys into strings
    got = run_sparse([[1, 2, I64_MIN, 7], None], {"op": "map_id", "mapping": mapping, "default": -9})
    assert got == [[10, -9, 3, 70], []]
    got = run_sparse([[I64_MIN, -1, 0, I64_MAX]], {"op": "positive_modulus", "modulus": 10})
    assert got == [[x % 10 for x in [I64_MIN, -1, 0, I64_MAX]]]


def test_enumerate_wraps():
    got = run_sparse([[5, 5, 5], [], [1]], {"op": "enumerate", "start": I64_MAX - 1})
    assert got == [[I64_MAX - 1, I64_MAX, I64_MIN], [], [I64_MAX - 1]]


def test_ngram():
    rows = [[1, 2, 3, 4], [1], [], [I64_MIN, I64_MAX]]
    assert run_sparse(rows, {"op": "ngram", "n": 1}) == rows
    got = run_sparse(rows, {"op": "ngram", "n": 2, "max_value": 1000})
    assert got == [ref.ngram(r, 2, 1000) for r in rows]
    assert [len(r) for r in got] == [3, 0, 0, 1]
    assert got[0][0] == ref.signed(ref.combine(1, 2)) % 1000


def test_get_local_hour():
    ts = [0, 3599, 3600, -1, 86399, I64_MAX, I64_MIN, None]
    out = run_dense(ts, {"op": "get_local_hour", "tz_offset_seconds": -7200}, schema_type="int", dtype=np.int64)
    assert out[:, 0].tolist() == [ref.local_hour(t or 0, -7200) for t in ts]
    f = spec("h", "dense", column="ts", transforms=[{"op": "get_local_hour", "tz_offset_column": "tz"}])
    p = compile_features([f], [], {"ts": "int", "tz": "int"})
    assert p.input_columns == ["ts", "tz"]
    out = p.run({"ts": dense_col([0, 0, 100000], np.int64), "tz": dense_col([3600, None, -3600], np.int64)}).dense
    assert out[:, 0].tolist() == [1, 0, 2]  # 100000 s - 1 h = 26 h 46 min, hour 2


def test_fill_null_and_default():
    out = run_dense([None, 2.0], {"op": "fill_null", "value": -1.5})
    assert out[:, 0].tolist() == [-1.5, 2.0]
    assert run_dense([None, 2.0], default=7.0)[:, 0].tolist() == [7.0, 2.0]
    assert run_dense([None, 2.0])[:, 0].tolist() == [0.0, 2.0]
    # The null becomes the default *before* the first transform.
    out = run_dense([None, 0.5], {"op": "logit"}, default=0.5)
    assert out[:, 0].tolist() == [0.0, 0.0]
    # An int column stays int (hashable) with a whole default.
    out = run_dense([None, 3], {"op": "positive_modulus", "modulus": 5}, schema_type="int", dtype=np.int64, default=12.0)
    assert out[:, 0].tolist() == [2, 3]
    assert run_sparse([None, [1]], {"op": "fill_null"}) == [[], [1]]


def test_int_dense_without_transform_is_float32():
    out = run_dense([1, None, 2**40], schema_type="int", dtype=np.int64)
    assert out.dtype == np.float32 and out[:, 0].tolist() == [1.0, 0.0, float(2**40)]


def test_pair_ops_hand_checked():
    a = [[1, 2, 2, 3], [], [5], [7, 7]]
    b = [[2, 3, 3, 9], [1], [], [7]]
    fs = [spec("ix", "sparse", inputs=["a", "b"], transforms=[{"op": "id_list_intersect"}]),
          spec("ca", "sparse", inputs=["a", "b"], transforms=[{"op": "cartesian"}])]
    ds = [spec(k, "dense", inputs=["a", "b"], transforms=[{"op": "compute_score", "kind": k}])
          for k in ("has_overlap", "overlap_count", "max_count", "jaccard")]
    p = compile_features(ds, fs, {"a": "id_list", "b": "id_list"})
    out = p.run({"a": sparse_col(a), "b": sparse_col(b)})
    assert sparse_rows(out.sparse[0]) == [[2, 2, 3], [], [], [7, 7]]
    assert [len(r) for r in sparse_rows(out.sparse[1])] == [16, 0, 0, 2]
    # overlap_count: min counts {2:min(2,1), 3:min(1,2)} = 2; max_count: 2 + 2 = 4; jaccard 2 / (4 + 4 - 2)
    assert out.dense.tolist() == [[1, 2, 4, np.float32(2 / 6)], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 2, 0.5]]


def test_scores_hand_checked():
    a, aw = [[1, 2, 2, 4]], [[1.0, 2.0, 0.5, 9.0]]
    b, bw = [[2, 1, 2, 3]], [[1.0, 3.0, 2.0, 4.0]]
    schema = {"a": "id_list", "as": "float_list", "b": "id_list", "bs": "float_list"}
    sp = [spec("A", "sparse", column="a", scores="as"), spec("B", "sparse", column="b", scores="bs")]
    kinds = ("score_sum", "score_min", "score_max", "cosine")
    ds = [spec(k, "dense", inputs=["A", "B"], transforms=[{"op": "compute_score", "kind": k}]) for k in kinds]
    p = compile_features(ds, sp, schema)
    cols = {"a": sparse_col(a), "as": sparse_col(aw, np.float32), "b": sparse_col(b), "bs": sparse_col(bw, np.float32)}
    out = p.run(cols).dense[0]
    # b's summed scores: {2: 3.0, 1: 3.0, 3: 4.0}; a's: {1: 1.0, 2: 2.5, 4: 9.0}
    cos = (1.0 * 3.0 + 2.5 * 3.0) / (math.sqrt(1 + 2.5**2 + 81) * math.sqrt(9 + 9 + 16))
    assert out.tolist() == [6.0, 3.0, 3.0, pytest.approx(cos, rel=1e-6)]


def test_sampling_vector_against_reference():
    from remoteloader.transforms import sampling_keep

    pos = np.arange(0, 5000, dtype=np.int64)
    keep, weight = sampling_keep(pos, 0.25, 42)
    expect = [ref.sampling_u(42, int(r)) < 0.25 for r in pos]
    assert keep.tolist() == expect
    assert 0.2 < keep.mean() < 0.3
    assert set(weight[keep].tolist()) == {4.0} and weight.dtype == np.float32
    labels = (pos % 2).astype(np.float32)
    keep, weight = sampling_keep(pos, 0.5, 7, labels=labels, label_value=0.0)
    assert keep[labels == 1].all()
    assert keep[labels == 0].tolist() == [ref.sampling_u(7, int(r)) < 0.5 for r in pos[labels == 0]]
    assert (weight[labels == 1] == 1.0).all() and (weight[(labels == 0) & keep] == 2.0).all()


def test_columns_not_mutated_and_float32_input():
    col = dense_col([1.0, None, 3.0], np.float32)
    before = col.values.copy()
    run = compile_features([spec("f", "dense", column="c", transforms=[{"op": "clamp", "min": 0, "max": 2}])], [],
                           {"c": "float"}).run
    assert run({"c": col}).dense[:, 0].tolist() == [1.0, 0.0, 2.0]
    np.testing.assert_array_equal(col.values, before)
    ids = SparseColumn(np.array([3, 1], np.int64), np.array([0, 2], np.int64))
    p = compile_features([], [spec("s", "sparse", column="i", transforms=[{"op": "sigrid_hash", "max_value": 5}])],
                         {"i": "id_list"})
    p.run({"i": ids})
    assert ids.values.tolist() == [3, 1]
    assert isinstance(DenseColumn(np.zeros(1)), DenseColumn)
