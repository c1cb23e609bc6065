"""Row-locality of every transform operator: run(take(x, i)) == take(run(x), i), byte for byte.

The feature-block cache stores transformed blocks in the table's stored row order and
turns an epoch's shuffle into a gather on read; that is only correct if every operator's
output row depends on the same input row alone. This checks it for every op in the
registry (a newly registered op without a parameter generator below fails, naming it),
at two levels: the op's own ``apply`` on raw columns (values, offsets, weights and valid,
with their dtypes), and a compiled pipeline's ``FeatureOutput`` (dense matrix and sparse
columns) for one-op features, random chains and multi-feature DAGs. Comparisons are on
bytes, so NaN payloads and -0.0 count. Ops declaring ``row_local = False`` are skipped by
the property and must be listed in ``KNOWN_NOT_ROW_LOCAL``.
"""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from remoteloader.columns import DenseColumn, SparseColumn
from remoteloader.transforms import (KindError, Op, ParamError, compile_features, get_op, known_ops,
                                     register_op, unregister_op)
from remoteloader.transforms.base import DENSE_FLOAT, DENSE_INT, SCORED, SPARSE
from remoteloader.transforms.registry import BUILTINS

from tests.transforms_reference import spec
from tests.test_transforms_properties import _no_triples
from tests.conftest import examples

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
# ROWLOCAL_EXAMPLES=2000 for a long soak; the default keeps the file at a few seconds.
EXAMPLES = int(os.environ.get("ROWLOCAL_EXAMPLES", examples(25)))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))

# Built-in ops that deliberately declare row_local = False (none today). Adding one here
# is a decision: the cache will never hold features using it.
KNOWN_NOT_ROW_LOCAL: set[str] = set()

# Casting a signalling NaN (or a float64 beyond float32) warns; the bytes are still compared.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

SCHEMA = {"ids": "id_list", "sc": "float_list", "ids2": "id_list", "sc2": "float_list", "x": "float", "x32": "float",
          "k": "int", "tz": "int"}


def row_local(op) -> bool:
    return bool(getattr(op, "row_local", True))


# -- values --------------------------------------------------------------------------------------
i64 = st.one_of(st.integers(I64_MIN, I64_MAX), st.integers(-8, 8),
                st.sampled_from([0, -1, I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1, 2**53 + 1, -(2**53) - 1]))
ids = st.one_of(st.integers(-4, 12), i64)  # small ids collide, so set operations find overlaps


def _bits64(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def _bits32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


_SPECIAL = [0.0, -0.0, 1e-7, 0.5, 1.0, -1.0, 1e-300, 3.4e38, 1e39, float("inf"), float("-inf"), float("nan")]
# Floats as bit patterns: NaNs with payloads (quiet and signalling, either sign) included.
f64_bits = st.one_of(st.floats().map(_bits64), st.floats(-5, 5).map(_bits64), st.sampled_from(_SPECIAL).map(_bits64),
                     st.builds(lambda s, m: (s << 63) | 0x7FF0000000000000 | m, st.integers(0, 1),
                               st.integers(1, 2**52 - 1)))
f32_bits = st.one_of(st.floats(width=32).map(_bits32), st.sampled_from(_SPECIAL[:8] + _SPECIAL[9:]).map(_bits32),
                     st.builds(lambda s, m: (s << 31) | 0x7F800000 | m, st.integers(0, 1), st.integers(1, 2**23 - 1)))


@st.composite
def tables(draw):
    """{column: Column} for SCHEMA: nulls via valid (garbage or 0 under a null dense row), empty rows,
    scores aligned with their id lists, sometimes long rows (the pair kernels' hash path)."""
    n = draw(st.integers(0, 10)) if draw(st.integers(0, 5)) else draw(st.integers(11, 40))
    long_rows = draw(st.integers(0, 5)) == 0
    out = {}
    for name, score in (("ids", "sc"), ("ids2", "sc2")):
        rows = [draw(st.none() | st.lists(ids, max_size=7)) for _ in range(n)]
        if long_rows:
            rows = [None if r is None else (r * 6)[:40] for r in rows]
        lengths = [0 if r is None else len(r) for r in rows]
        offsets = np.zeros(n + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(lengths, dtype=np.int64)
        values = np.array([x for r in rows if r for x in r], dtype=np.int64)
        valid = None if all(r is not None for r in rows) else np.array([r is not None for r in rows])
        out[name] = SparseColumn(values, offsets, None, valid)
        scores = np.array([draw(f32_bits) for _ in range(int(offsets[-1]))], dtype=np.uint32).view(np.float32)
        out[score] = SparseColumn(scores, offsets.copy(), None, valid)
    for name, vals, dtype in (("x", f64_bits, np.uint64), ("x32", f32_bits, np.uint32), ("k", i64, np.int64),
                              ("tz", st.integers(-50000, 50000), np.int64)):
        nulls = [draw(st.integers(0, 3)) == 0 for _ in range(n)]
        garbage = draw(st.booleans())  # the reader stores 0 under a null; ops must not care either way
        raw = [draw(vals) if not null or garbage else 0 for null in nulls]
        arr = np.array(raw, dtype=dtype)
        if name == "x":
            arr = arr.view(np.float64)
        elif name == "x32":
            arr = arr.view(np.float32)
        out[name] = DenseColumn(arr, np.array([not x for x in nulls]) if any(nulls) else None)
    return n, out


@st.composite
def indices(draw, n):
    """A gather index: a permutation, a subset (either order), any rows with repeats, or empty."""
    how = draw(st.sampled_from(["perm", "subset", "repeats", "empty"]) if n else st.just("empty"))
    if how == "perm":
        rows = draw(st.permutations(range(n)))
    elif how == "subset":
        rows = sorted(draw(st.sets(st.integers(0, n - 1))))
        if draw(st.booleans()):
            rows = draw(st.permutations(rows))
    elif how == "repeats":
        rows = draw(st.lists(st.integers(0, n - 1), max_size=2 * n + 3))
    else:
        rows = []
    return np.array(rows, dtype=np.int64)


# -- parameters of every op -------------------------------------------------------------------------
border_values = st.one_of(i64, st.floats(allow_nan=False), st.integers(-(2**70), 2**70), st.integers(-5, 5),
                          st.sampled_from([0.0, -0.0, 0.5, float("inf"), float("-inf")]))
borders = st.lists(border_values, min_size=1, max_size=6).map(_no_triples)
max_values = st.one_of(st.sampled_from([1, 2, 3, 100]), st.integers(1, I64_MAX))
bounds = st.one_of(st.lists(i64, min_size=2, max_size=2),
                   st.lists(st.floats(allow_nan=False) | st.sampled_from([0.0, -0.0]), min_size=2, max_size=2),
                   st.lists(i64 | st.floats(allow_nan=False), min_size=2, max_size=2)).map(sorted)


def _opt(key, strategy):
    """{key: value} or {} (the default)."""
    return st.none() | strategy.map(lambda v: {key: v})


def _merge(*parts):
    return st.tuples(*parts).map(lambda ds: {k: v for d in ds if d for k, v in d.items()})


# op name -> strategy of valid parameters (without "op"). A registered op missing here
# fails test_every_op_is_row_local with its name: add a generator for it.
PARAMS = {
    "sigrid_hash": _merge(_opt("salt", i64), max_values.map(lambda m: {"max_value": m})),
    "positive_modulus": max_values.map(lambda m: {"modulus": m}),
    "map_id": _merge(st.dictionaries(ids, i64, max_size=6).map(
        lambda m: {"mapping": {str(k) if i % 2 else k: v for i, (k, v) in enumerate(m.items())}}),
        _opt("default", i64)),
    "bucketize": _merge(borders.map(lambda b: {"borders": b}), _opt("as_sparse", st.booleans())),
    "clamp": bounds.map(lambda b: {"min": b[0], "max": b[1]}),
    "boxcox": _merge((st.sampled_from([0.0, 1.0, -1.0, 0.5]) | st.floats(-3, 3)).map(lambda a: {"lambda1": a}),
                     _opt("lambda2", st.floats(-10, 10) | st.sampled_from([0, -0.0]))),
    "logit": _opt("eps", st.floats(1e-9, 0.4999)).map(lambda d: d or {}),
    "onehot": borders.map(lambda b: {"borders": b}),
    "get_local_hour": st.one_of(st.just({}), i64.map(lambda o: {"tz_offset_seconds": o}),
                                st.just({"tz_offset_column": "tz"})),
    "fill_null": st.one_of(st.just({}), (st.integers(-5, 5) | i64 | st.floats(allow_nan=False)).map(
        lambda v: {"value": v})),
    "firstx": st.integers(0, 9).map(lambda x: {"x": x}),
    "enumerate": _opt("start", i64).map(lambda d: d or {}),
    "ngram": _merge(st.integers(1, 4).map(lambda n: {"n": n}), _opt("max_value", max_values)),
    "id_list_intersect": st.just({}),
    "compute_score": st.sampled_from(["has_overlap", "overlap_count", "max_count", "jaccard", "score_sum", "score_min",
                                      "score_max", "cosine"]).map(lambda k: {"kind": k}),
    "cartesian": _opt("max_value", max_values).map(lambda d: d or {}),
}
PARAMS = {k: v.map(lambda d: d or {}) for k, v in PARAMS.items()}


# -- inputs: (table column, scores column, feature default, kind the first step sees) ---------------
SOURCES = [("ids", None, None, SPARSE), ("ids", "sc", None, SCORED), ("k", None, None, DENSE_INT),
           ("k", None, -3.0, DENSE_INT), ("k", None, 0.5, DENSE_FLOAT), ("x", None, None, DENSE_FLOAT),
           ("x", None, 2.5, DENSE_FLOAT), ("x32", None, None, DENSE_FLOAT)]
PAIR_SOURCES = [(False, False), (True, False), (False, True), (True, True)]  # (a scored, b scored)


def _raw_input(cols, source):
    """The column an op sees as the first step of a feature reading ``source`` (nulls not yet filled:
    an op must be row-local on any column, garbage under a null row included)."""
    column, scores, default, kind = source
    col = cols[column]
    if scores is not None:
        return SparseColumn(col.values, col.offsets, cols[scores].values, col.valid)
    if kind == DENSE_FLOAT and col.values.dtype.kind == "i":  # a fractional default made it float
        return DenseColumn(col.values.astype(np.float64), col.valid)
    return col


def _accepts(op, norm, kinds):
    try:
        out = op.output_kind(norm, kinds)
    except (KindError, ParamError):
        return None
    return out


# -- byte-for-byte comparison ------------------------------------------------------------------------
def _same_array(got, exp, what):
    if got is None or exp is None:
        assert got is None and exp is None, f"{what}: {got!r} vs {exp!r}"
        return
    got, exp = np.asarray(got), np.asarray(exp)
    assert got.dtype == exp.dtype, f"{what}: dtype {got.dtype} vs {exp.dtype}"
    assert got.shape == exp.shape, f"{what}: shape {got.shape} vs {exp.shape}"
    if got.tobytes() != exp.tobytes():
        g, e = got.reshape(got.shape[0], -1) if got.ndim else got, exp.reshape(exp.shape[0], -1) if exp.ndim else exp
        bad = [r for r in range(got.shape[0]) if g[r].tobytes() != e[r].tobytes()][:5] if got.ndim else []
        raise AssertionError(f"{what}: bytes differ (first entries {bad}): taken-then-run {got[bad]!r} "
                             f"vs run-then-taken {exp[bad]!r}")


def same_column(got, exp, what):
    assert type(got) is type(exp), f"{what}: {type(got).__name__} vs {type(exp).__name__}"
    _same_array(got.values, exp.values, f"{what}.values")
    _same_array(got.valid, exp.valid, f"{what}.valid")
    if isinstance(got, SparseColumn):
        _same_array(got.offsets, exp.offsets, f"{what}.offsets")
        _same_array(got.weights, exp.weights, f"{what}.weights")


def check_op(op, state, inputs, extra, idx, what):
    """apply on the taken columns == the taken output of apply on the whole columns."""
    full = op.apply(state, list(inputs), dict(extra))
    taken = op.apply(state, [c.take(idx) for c in inputs], {k: c.take(idx) for k, c in extra.items()})
    same_column(taken, full.take(idx), what)


def check_pipeline(dense, sparse, cols, idx):
    pipe = compile_features(dense, sparse, SCHEMA)
    full = pipe.run(cols)
    taken = pipe.run({k: c.take(idx) for k, c in cols.items()})
    _same_array(taken.dense, full.dense[idx], "FeatureOutput.dense")
    assert len(taken.sparse) == len(full.sparse) == len(sparse)
    for f, got, whole in zip(sparse, taken.sparse, full.sparse):
        same_column(got, whole.take(idx), f"FeatureOutput.sparse[{f.name!r}]")


def _prepare(op, norm, kinds):
    prepare = getattr(op, "prepare", None)
    return prepare(norm, kinds) if prepare is not None else norm


def _extra(op, norm, cols):
    return {c: cols[c] for c in getattr(op, "extra_columns", lambda p: {})(norm)}


# -- 1. every registered op on its own -------------------------------------------------------------
def _check_one_op(name, data):
    op = get_op(name)
    n, cols = data.draw(tables(), label="table")
    params = data.draw(PARAMS[name], label="params")
    try:
        norm = op.validate(dict(params))
    except ParamError as e:
        raise AssertionError(f"PARAMS[{name!r}] generated invalid parameters {params!r}: {e}") from None
    arity = getattr(op, "arity", 1)
    if arity == 1:
        options = [s for s in SOURCES if _accepts(op, norm, (s[3],)) is not None
                   and not (name == "fill_null" and s[2] is not None)]  # default or fill_null, not both
    else:
        options = [s for s in PAIR_SOURCES if _accepts(op, norm, tuple(SCORED if x else SPARSE for x in s)) is not None]
    if not options:
        reject()
    source = data.draw(st.sampled_from(options), label="input")
    idx = data.draw(indices(n), label="rows")
    step = {"op": name, **params}

    if arity == 1:
        kinds = (source[3],)
        inputs = [_raw_input(cols, source)]
        column, scores, default, _ = source
        out = op.output_kind(norm, kinds)
        feats = [spec("f", out.kind, column=column, scores=scores, default=default, transforms=[step])]
    else:
        kinds = tuple(SCORED if x else SPARSE for x in source)
        inputs = [_raw_input(cols, ("ids", "sc" if source[0] else None, None, kinds[0])),
                  _raw_input(cols, ("ids2", "sc2" if source[1] else None, None, kinds[1]))]
        out = op.output_kind(norm, kinds)
        feats = [spec("A", "sparse", column="ids", scores="sc"), spec("B", "sparse", column="ids2", scores="sc2"),
                 spec("f", out.kind, inputs=["A" if source[0] else "ids", "B" if source[1] else "ids2"],
                      transforms=[step])]
    check_op(op, _prepare(op, norm, kinds), inputs, _extra(op, norm, cols), idx, f"{name}.apply")
    check_pipeline([f for f in feats if f.kind == "dense"], [f for f in feats if f.kind == "sparse"], cols, idx)


@pytest.mark.parametrize("name", known_ops())
def test_every_op_is_row_local(name):
    op = get_op(name)
    if not row_local(op):
        assert name in KNOWN_NOT_ROW_LOCAL, f"op {name!r} declares row_local = False; list it in KNOWN_NOT_ROW_LOCAL"
        pytest.skip(f"{name} declares row_local = False")
    if name not in PARAMS:
        pytest.fail(f"op {name!r} has no parameter generator: add one to PARAMS in {__name__} "
                    f"(or declare row_local = False on it if its rows depend on each other)")

    @SETTINGS
    @given(data=st.data())
    def prop(data):
        _check_one_op(name, data)

    prop()


# -- 2. chains of steps and multi-feature DAGs -------------------------------------------------------
def _chain_ops(arity):
    return [n for n in sorted(PARAMS) if n in known_ops() and row_local(get_op(n))
            and getattr(get_op(n), "arity", 1) == arity]


def _draw_steps(data, kinds, max_steps, fill_null_ok):
    """Up to ``max_steps`` valid steps for a feature whose inputs have ``kinds``; (steps, out kind)."""
    steps, current = [], kinds
    if len(kinds) == 2:  # a pair op must come first
        for _ in range(8):
            name = data.draw(st.sampled_from(_chain_ops(2)))
            params = data.draw(PARAMS[name])
            out = _accepts(get_op(name), get_op(name).validate(dict(params)), kinds)
            if out is not None:
                steps, current = [{"op": name, **params}], (out,)
                break
        else:
            return None, None
    for i in range(data.draw(st.integers(0, max_steps))):
        names = [n for n in _chain_ops(1) if n != "fill_null" or (not steps and fill_null_ok)]
        name = data.draw(st.sampled_from(names))
        params = data.draw(PARAMS[name])
        out = _accepts(get_op(name), get_op(name).validate(dict(params)), current)
        if out is not None:
            steps.append({"op": name, **params})
            current = (out,)
    return steps, current[0]


@SETTINGS
@given(data=st.data())
def test_random_chains_are_row_local(data):
    # One feature per source kind, each a random chain; the raw ops composed by hand too.
    n, cols = data.draw(tables(), label="table")
    idx = data.draw(indices(n), label="rows")
    feats = []
    for j, source in enumerate(SOURCES):
        column, scores, default, kind = source
        steps, out = _draw_steps(data, (kind,), 4, fill_null_ok=default is None)  # default or fill_null
        if not steps:
            out = kind
        feats.append(spec(f"c{j}", out.kind, column=column, scores=scores, default=default, transforms=steps))
        # The same chain on the raw column, one apply after another (per-step outputs checked).
        col = _raw_input(cols, source)
        kinds = (kind,)
        for i, t in enumerate(steps):
            op = get_op(t["op"])
            norm = op.validate({k: v for k, v in t.items() if k != "op"})
            state, extra = _prepare(op, norm, kinds), _extra(op, norm, cols)
            check_op(op, state, [col], extra, idx, f"c{j} step {i} ({t['op']}).apply")
            col, kinds = op.apply(state, [col], extra), (op.output_kind(norm, kinds),)
    check_pipeline([f for f in feats if f.kind == "dense"], [f for f in feats if f.kind == "sparse"], cols, idx)


@SETTINGS
@given(data=st.data())
def test_random_feature_dags_are_row_local(data):
    # Features reading columns, other features (one input), or two sparse inputs [a, b]
    # (columns or features, scored or not); every feature is an output.
    n, cols = data.draw(tables(), label="table")
    idx = data.draw(indices(n), label="rows")
    feats, outs = [], {}
    for j in range(data.draw(st.integers(1, 6))):
        name = f"f{j}"
        singles = [s for s, k in outs.items() if k.width == 1]
        sparse_in = ["ids", "ids2"] + [s for s, k in outs.items() if k.kind == "sparse"]
        how = data.draw(st.sampled_from(["column", "pair"] + (["feature"] if singles else [])))
        where = {}
        if how == "column":
            column, scores, default, kind = data.draw(st.sampled_from(SOURCES))
            steps, out = _draw_steps(data, (kind,), 3, fill_null_ok=default is None)
            where = {"column": column, "scores": scores, "default": default}
        elif how == "feature":
            src = data.draw(st.sampled_from(singles))
            kind = outs[src]
            steps, out = _draw_steps(data, (kind,), 3, fill_null_ok=True)
            where = {"inputs": [src]}
        else:
            a, b = data.draw(st.sampled_from(sparse_in)), data.draw(st.sampled_from(sparse_in))
            steps, out = _draw_steps(data, tuple(outs.get(s, SPARSE) for s in (a, b)), 2, fill_null_ok=False)
            if steps is None:
                continue
            where = {"inputs": [a, b]}
        out = out if steps else kind
        feats.append(spec(name, out.kind, transforms=steps, **where))
        outs[name] = out
    if not feats:
        reject()
    check_pipeline([f for f in feats if f.kind == "dense"], [f for f in feats if f.kind == "sparse"], cols, idx)


# -- 3. the declarations ------------------------------------------------------------------------------
def test_non_row_local_ops_are_deliberate():
    assert Op.row_local is True  # the default: a user op is row-local unless it says otherwise
    declared = {name for name in BUILTINS if not row_local(BUILTINS[name])}
    assert declared == KNOWN_NOT_ROW_LOCAL, (
        f"built-in ops declaring row_local = False: {sorted(declared)}; expected {sorted(KNOWN_NOT_ROW_LOCAL)} "
        "(update KNOWN_NOT_ROW_LOCAL only if the op's rows really depend on each other)")
    for name in known_ops():
        assert name in PARAMS or not row_local(get_op(name)), f"op {name!r} has no parameter generator in PARAMS"


class _MinusBatchMean(Op):
    """Not row-local (subtracts the batch mean) yet does not say so: the property must catch it."""

    name = "test_minus_batch_mean"

    def output_kind(self, params, inputs):
        return DENSE_FLOAT

    def apply(self, state, inputs, extra):
        v = inputs[0].values.astype(np.float64)
        return DenseColumn(v - (v.mean() if v.size else 0.0))


def test_property_catches_a_batch_statistic():
    register_op(_MinusBatchMean.name, _MinusBatchMean, replace=True)
    try:
        x = DenseColumn(np.array([1.0, 2.0, 6.0]))
        idx = np.array([2, 0], dtype=np.int64)
        with pytest.raises(AssertionError, match="bytes differ"):
            check_op(get_op(_MinusBatchMean.name), {}, [x], {}, idx, "minus_mean.apply")
        feats = [spec("m", "dense", column="x", transforms=[{"op": _MinusBatchMean.name}])]
        cols = {"x": x}
        with pytest.raises(AssertionError, match="bytes differ"):
            check_pipeline(feats, [], cols, idx)
    finally:
        unregister_op(_MinusBatchMean.name)


def test_comparison_sees_nan_payloads_and_signed_zeros():
    nan1 = np.array([0x7FF8000000000001], dtype=np.uint64).view(np.float64)
    nan2 = np.array([0x7FF8000000000002], dtype=np.uint64).view(np.float64)
    with pytest.raises(AssertionError):
        _same_array(nan1, nan2, "nan")
    with pytest.raises(AssertionError):
        _same_array(np.array([0.0]), np.array([-0.0]), "zero")
    with pytest.raises(AssertionError):
        _same_array(np.array([1], dtype=np.int32), np.array([1], dtype=np.int64), "dtype")
    _same_array(nan1, nan1.copy(), "nan")
