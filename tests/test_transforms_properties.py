"""Property tests: every operator (and random chains of them) against the scalar reference.

Random tables include empty and null rows, int64 extremes, NaN/inf/-0.0 dense values, and
borders or bounds outside the int64 range. The pipeline and ``transforms_reference``
must agree exactly (float results after their float32 rounding).
"""
from __future__ import annotations

import math
import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remoteloader.transforms import compile_features

from tests import transforms_reference as ref
from tests.transforms_reference import dense_col, sparse_col, sparse_rows, spec
from tests.conftest import examples

I64_MIN, I64_MAX = ref.INT64_MIN, ref.INT64_MAX
# TRANSFORMS_EXAMPLES=2000 for a long soak; the default keeps the suite fast.
SETTINGS = settings(max_examples=int(os.environ.get("TRANSFORMS_EXAMPLES", examples(60))), deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

i64 = st.one_of(st.integers(I64_MIN, I64_MAX), st.integers(-8, 8),
                st.sampled_from([0, -1, I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1, 2**53 + 1, -(2**53) - 1]))
small_ids = st.integers(-4, 12)  # collide often, so set operations find overlaps
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(-5, 5), st.sampled_from([0.0, -0.0, 1e-7, 0.5, 1.0, 1e-300, 3.4e38]))
scores = st.floats(-100, 100, width=32) | st.sampled_from([0.0, 1.0, math.nan])
SCHEMA = {"ids": "id_list", "sc": "float_list", "ids2": "id_list", "sc2": "float_list", "x": "float", "x32": "float",
          "k": "int", "tz": "int"}


@st.composite
def tables(draw, ids=i64):
    n = draw(st.integers(0, 9))
    cols = {}
    for name, score in (("ids", "sc"), ("ids2", "sc2")):
        rows = [draw(st.none() | st.lists(ids, max_size=7)) for _ in range(n)]
        cols[name] = rows
        cols[score] = [None if r is None else [draw(scores) for _ in r] for r in rows]
    cols["x"] = [draw(st.none() | floats) for _ in range(n)]
    cols["x32"] = [draw(st.none() | st.floats(width=32)) for _ in range(n)]
    cols["k"] = [draw(st.none() | i64) for _ in range(n)]
    cols["tz"] = [draw(st.none() | st.integers(-50000, 50000)) for _ in range(n)]
    return n, cols


def columns(cols):
    out = {}
    for name, t in SCHEMA.items():
        if t == "id_list":
            out[name] = sparse_col(cols[name])
        elif t == "float_list":
            out[name] = sparse_col(cols[name], np.float32)
        else:
            out[name] = dense_col(cols[name], {"float": np.float64, "int": np.int64}[t] if name != "x32" else np.float32)
    return out


def check(dense, sparse, table):
    n, cols = table
    got = compile_features(dense, sparse, SCHEMA).run(columns(cols))
    exp_dense, exp_sparse = ref.run_features(dense, sparse, SCHEMA, cols, n)
    expected = np.array(exp_dense, dtype=np.float32).reshape(n, got.dense.shape[1])
    assert got.dense.dtype == np.float32
    np.testing.assert_array_equal(got.dense, expected)
    for f, col, rows in zip(sparse, got.sparse, exp_sparse):
        assert col.values.dtype == np.int64 and col.offsets.dtype == np.int64, f.name
        assert _nan_safe(sparse_rows(col)) == _nan_safe(rows), f.name


def _nan_safe(rows):
    """Scores compared as float32 values, NaN equal to NaN."""
    return [[(i, "nan" if math.isnan(s) else ref.f32(s)) if isinstance(x, tuple) else x
             for x in r for i, s in [x if isinstance(x, tuple) else (0, 0.0)]] for r in rows]


# -- parameter strategies -------------------------------------------------------------------------
def _no_triples(xs):
    out = []
    for x in sorted(xs):
        if len(out) >= 2 and out[-1] == out[-2] == x:
            continue
        out.append(x)
    return out


border_values = st.one_of(i64, st.floats(allow_nan=False), st.integers(-(2**70), 2**70), st.integers(-5, 5))
borders = st.lists(border_values, min_size=1, max_size=6).map(_no_triples)
max_values = st.one_of(st.sampled_from([1, 2, 3, 100]), st.integers(1, I64_MAX))


def op_strategies(kind):
    """Single steps valid on `kind` ("sparse", "int" or "float") -> same kind (except noted)."""
    int_bounds = st.lists(i64, min_size=2, max_size=2).map(sorted)
    float_bounds = st.lists(st.floats(allow_nan=False), min_size=2, max_size=2).map(sorted)
    common = [
        borders.map(lambda b: {"op": "bucketize", "borders": b}),
        (int_bounds if kind != "float" else float_bounds).map(lambda b: {"op": "clamp", "min": b[0], "max": b[1]}),
    ]
    if kind == "float":
        return common[1:] + [
            st.builds(lambda a, b: {"op": "boxcox", "lambda1": a, "lambda2": b},
                      st.sampled_from([0.0, 1.0, -1.0]) | st.floats(-3, 3), st.floats(-10, 10)),
            st.floats(1e-9, 0.4999).map(lambda e: {"op": "logit", "eps": e}),
            borders.map(lambda b: {"op": "bucketize", "borders": b}),
        ]
    ints = [
        st.builds(lambda s, m: {"op": "sigrid_hash", "salt": s, "max_value": m}, i64, max_values),
        max_values.map(lambda m: {"op": "positive_modulus", "modulus": m}),
        st.builds(lambda m, d: {"op": "map_id", "mapping": m, "default": d},
                  st.dictionaries(small_ids | i64, i64, max_size=6), i64),
        int_bounds.map(lambda b: {"op": "clamp", "min": b[0], "max": b[1]}),
    ]
    if kind == "int":
        return ints + [st.integers(-10**6, 10**6).map(lambda o: {"op": "get_local_hour", "tz_offset_seconds": o})]
    return ints + [
        borders.map(lambda b: {"op": "bucketize", "borders": b}),
        st.integers(0, 8).map(lambda x: {"op": "firstx", "x": x}),
        i64.map(lambda s: {"op": "enumerate", "start": s}),
        st.builds(lambda n, m: {"op": "ngram", "n": n, **({} if m is None else {"max_value": m})},
                  st.integers(1, 4), st.none() | max_values),
    ]


# -- one test per operator family ------------------------------------------------------------------
@SETTINGS
@given(table=tables(), step=st.one_of(op_strategies("sparse")))
def test_sparse_ops_match_reference(table, step):
    # The same step on a plain list, a scored list (weights must stay aligned) and a derived input.
    sparse = [spec("plain", "sparse", column="ids", transforms=[step]),
              spec("scored", "sparse", column="ids", scores="sc", transforms=[step]),
              spec("derived", "sparse", inputs=["scored"], transforms=[step])]
    check([], sparse, table)


@SETTINGS
@given(table=tables(), step=st.one_of(op_strategies("int")), default=st.none() | st.sampled_from([3.0, -1.0, 0.5]))
def test_int_dense_ops_match_reference(table, step, default):
    if default == 0.5 and step["op"] != "clamp":
        default = 2.0  # a fractional default makes the column float; only clamp accepts both
    if default == 0.5:
        step = {**step, "min": float(step["min"]), "max": float(step["max"])}
    check([spec("k", "dense", column="k", transforms=[step], default=default)], [], table)


@SETTINGS
@given(table=tables(), step=st.one_of(op_strategies("float")), default=st.none() | floats)
def test_float_dense_ops_match_reference(table, step, default):
    if default is not None and math.isnan(default):
        default = None
    dense = [spec("x", "dense", column="x", transforms=[step], default=default),
             spec("x32", "dense", column="x32", transforms=[step])]
    check(dense, [], table)


@SETTINGS
@given(table=tables(), b=borders, as_sparse=st.booleans())
def test_onehot_and_dense_bucketize(table, b, as_sparse):
    dense = [spec("oh_x", "dense", column="x", transforms=[{"op": "onehot", "borders": b}]),
             spec("oh_k", "dense", column="k", transforms=[{"op": "onehot", "borders": b}])]
    sparse = [spec("bs", "sparse", column="k", transforms=[{"op": "bucketize", "borders": b, "as_sparse": True}])]
    check(dense, sparse if as_sparse else [], table)


@SETTINGS
@given(table=tables(ids=small_ids), kind=st.sampled_from(
    ["has_overlap", "overlap_count", "max_count", "jaccard", "score_sum", "score_min", "score_max", "cosine"]),
    mv=st.none() | max_values)
def test_pair_ops_match_reference(table, kind, mv):
    sparse = [spec("A", "sparse", column="ids", scores="sc"), spec("B", "sparse", column="ids2", scores="sc2"),
              spec("ix", "sparse", inputs=["A", "B"], transforms=[{"op": "id_list_intersect"}]),
              spec("ix_plain", "sparse", inputs=["ids", "ids2"], transforms=[{"op": "id_list_intersect"}]),
              spec("ca", "sparse", inputs=["A", "ids2"], transforms=[{"op": "cartesian", **({} if mv is None else
                                                                                        {"max_value": mv})}])]
    dense = [spec("score", "dense", inputs=["A", "B"], transforms=[{"op": "compute_score", "kind": kind}])]
    if kind in ("has_overlap", "overlap_count", "max_count", "jaccard"):
        dense.append(spec("score_plain", "dense", inputs=["ids", "ids2"], transforms=[{"op": "compute_score",
                                                                                       "kind": kind}]))
    check(dense, sparse, table)


@SETTINGS
@given(table=tables(ids=i64), kind=st.sampled_from(["overlap_count", "jaccard", "cosine"]))
def test_pair_ops_long_rows_use_hash_path(table, kind):
    # Rows longer than the direct-compare threshold take the hash-table path of the kernels.
    n, cols = table
    for name, sc in (("ids", "sc"), ("ids2", "sc2")):
        cols[name] = [None if r is None else (r * 6)[:40] for r in cols[name]]
        cols[sc] = [None if r is None else (r * 6)[:40] for r in cols[sc]]
    sparse = [spec("A", "sparse", column="ids", scores="sc"), spec("B", "sparse", column="ids2", scores="sc2"),
              spec("ix", "sparse", inputs=["A", "B"], transforms=[{"op": "id_list_intersect"}])]
    dense = [spec("s", "dense", inputs=["A", "B"], transforms=[{"op": "compute_score", "kind": kind}])]
    check(dense, sparse, (n, cols))


@SETTINGS
@given(table=tables(), use_column=st.booleans(), off=st.integers(-10**6, 10**6))
def test_local_hour_with_offset_column(table, use_column, off):
    step = {"op": "get_local_hour", **({"tz_offset_column": "tz"} if use_column else {"tz_offset_seconds": off})}
    check([spec("h", "dense", column="k", transforms=[step])], [], table)


# -- random chains ---------------------------------------------------------------------------------
@SETTINGS
@given(table=tables(), steps=st.lists(st.one_of(op_strategies("sparse")), max_size=4))
def test_random_sparse_chains(table, steps):
    check([], [spec("c", "sparse", column="ids", scores="sc", transforms=steps),
               spec("d", "sparse", inputs=["c", "ids2"], transforms=[{"op": "id_list_intersect"}] + steps[:1])], table)


@SETTINGS
@given(table=tables(), ints=st.lists(st.one_of(op_strategies("int")), max_size=3),
       tail=st.lists(st.one_of(op_strategies("float")), max_size=3), fill=st.none() | st.integers(-5, 5))
def test_random_dense_chains(table, ints, tail, fill):
    # An int chain, then float steps on its output; optionally a fill_null first step.
    steps = ([{"op": "fill_null", "value": fill}] if fill is not None else []) + ints + tail
    check([spec("c", "dense", column="k", transforms=steps)], [], table)
