"""Compile-time checks, the feature DAG, scored features, the extension point, the builder."""
from __future__ import annotations

import importlib.metadata
from typing import Any, Mapping, Sequence

import numpy as np
import pytest

from remoteloader.columns import Column, SparseColumn
from remoteloader.transforms import (Feature, Kind, Op, ParamError, TransformError, compile_features, get_op,
                                     register_op, unregister_op, validate_sampling)
from remoteloader.transforms import registry as registry_mod

from tests.transforms_reference import dense_col, sparse_col, sparse_rows, spec

SCHEMA = {"ids": "id_list", "ids2": "id_list", "sc": "float_list", "x": "float", "k": "int", "ts": "int"}


def compile_one(f, schema=SCHEMA):
    return compile_features([f] if f.kind == "dense" else [], [f] if f.kind == "sparse" else [], schema)


def error_of(f, schema=SCHEMA) -> TransformError:
    with pytest.raises(TransformError) as e:
        compile_one(f, schema)
    return e.value


# -- each kind of bad spec names feature, step and parameter ------------------------------------------
BAD_PARAMS = [
    ({"op": "sigrid_hash"}, "max_value"),
    ({"op": "sigrid_hash", "max_value": 0}, "max_value"),
    ({"op": "sigrid_hash", "max_value": True}, "max_value"),
    ({"op": "sigrid_hash", "max_value": 10, "salt": 1.5}, "salt"),
    ({"op": "sigrid_hash", "max_value": 10, "sault": 1}, "sault"),
    ({"op": "bucketize", "borders": []}, "borders"),
    ({"op": "bucketize", "borders": [3, 2]}, "borders"),
    ({"op": "bucketize", "borders": [1, 1, 1]}, "borders"),
    ({"op": "bucketize", "borders": [1, float("nan")]}, "borders"),
    ({"op": "firstx", "x": -1}, "x"),
    ({"op": "firstx"}, "x"),
    ({"op": "clamp", "min": 5, "max": 1}, "min"),
    ({"op": "clamp", "min": 0.5, "max": 1}, "min"),  # sparse ids need int bounds
    ({"op": "map_id", "mapping": {"a": 1}}, "mapping"),
    ({"op": "map_id", "mapping": [1, 2]}, "mapping"),
    ({"op": "map_id", "mapping": {1: 2}, "default": "x"}, "default"),
    ({"op": "positive_modulus", "modulus": 0}, "modulus"),
    ({"op": "enumerate", "start": "0"}, "start"),
    ({"op": "ngram", "n": 0}, "n"),
    ({"op": "ngram", "n": 2, "max_value": -3}, "max_value"),
    ({"op": "bucketize", "borders": [1], "as_sparse": True}, "as_sparse"),
    ({"op": "no_such_op"}, "op"),
]


@pytest.mark.parametrize("step,param", BAD_PARAMS)
def test_bad_sparse_params_name_feature_step_param(step, param):
    f = spec("pages", "sparse", column="ids", transforms=[{"op": "firstx", "x": 3}, step])
    e = error_of(f)
    assert (e.feature, e.step, e.param) == ("pages", 1, param)
    assert "'pages'" in str(e) and "step 1" in str(e) and repr(param) in str(e)


BAD_DENSE = [
    ({"op": "logit", "eps": 0.5}, "eps"),
    ({"op": "logit", "eps": 0}, "eps"),
    ({"op": "boxcox"}, "lambda1"),
    ({"op": "boxcox", "lambda1": "1"}, "lambda1"),
    ({"op": "onehot", "borders": "1,2"}, "borders"),
    ({"op": "get_local_hour", "tz_offset_seconds": 1, "tz_offset_column": "ts"}, "tz_offset_column"),
    ({"op": "get_local_hour", "tz_offset_column": "nope"}, "tz_offset_column"),
    ({"op": "get_local_hour", "tz_offset_column": "x"}, "tz_offset_column"),  # a float column
    ({"op": "compute_score", "kind": "jaccard"}, None),  # needs two inputs
]


@pytest.mark.parametrize("step,param", BAD_DENSE)
def test_bad_dense_params(step, param):
    e = error_of(spec("age", "dense", column="ts", transforms=[step]))
    assert (e.feature, e.step, e.param) == ("age", 0, param)


@pytest.mark.parametrize("f,step,needle", [
    (spec("s", "sparse", column="ids", transforms=[{"op": "logit"}]), 0, "dense"),
    (spec("s", "sparse", column="ids", transforms=[{"op": "boxcox", "lambda1": 1}]), 0, "dense"),
    (spec("d", "dense", column="x", transforms=[{"op": "firstx", "x": 1}]), 0, "sparse"),
    (spec("d", "dense", column="x", transforms=[{"op": "sigrid_hash", "max_value": 5}]), 0, "integer"),
    (spec("d", "dense", column="x", transforms=[{"op": "positive_modulus", "modulus": 5}]), 0, "integer"),
    (spec("d", "dense", column="x", transforms=[{"op": "get_local_hour"}]), 0, "integer"),
    (spec("d", "dense", column="k", transforms=[{"op": "boxcox", "lambda1": 1}, {"op": "map_id", "mapping": {}}]),
     1, "integer"),
    (spec("d", "dense", column="x", transforms=[{"op": "onehot", "borders": [1]}, {"op": "logit"}]), 1, "last step"),
    (spec("d", "dense", column="x", transforms=[{"op": "logit"}, {"op": "fill_null", "value": 1}]), 1, "first step"),
    (spec("s", "sparse", column="ids", transforms=[{"op": "firstx", "x": 1}, {"op": "cartesian"}]), 1, "first step"),
])
def test_kind_errors(f, step, needle):
    e = error_of(f)
    assert e.feature == f.name and e.step == step and needle in str(e)


@pytest.mark.parametrize("f,needle,param", [
    (spec("d", "dense", column="ids"), "declared dense", None),  # a dense feature on an id_list
    (spec("s", "sparse", column="x"), "declared sparse", None),
    (spec("d", "dense", column="missing"), "not in the table", None),
    (spec("s", "sparse", column="sc"), "float_list", None),
    (spec("s", "sparse", column="ids", scores="x"), "float_list", "scores"),
    (spec("s", "sparse", column="ids", scores="zz"), "not in the table", "scores"),
    (spec("d", "dense", column="x", scores="sc"), "sparse feature", "scores"),
    (spec("s", "sparse", column="ids", default=1.0), "dense inputs", "default"),
    (spec("d", "dense", column="x", default=1.0, transforms=[{"op": "fill_null", "value": 2}]), "not both", "default"),
    (spec("s", "sparse", inputs=["ids", "ids2"]), "first step must be", None),
    (spec("s", "sparse", inputs=["ids", "ids2"], transforms=[{"op": "firstx", "x": 1}]), "first step must be", None),
    (spec("s", "sparse", inputs=["ids", "x"], transforms=[{"op": "cartesian"}]), "input b", None),
])
def test_feature_level_errors(f, needle, param):
    e = error_of(f)
    assert e.feature == f.name and needle in str(e) and e.param == param


def test_sparse_fill_null_takes_no_value():
    e = error_of(spec("s", "sparse", column="ids", transforms=[{"op": "fill_null", "value": 1}]))
    assert (e.step, e.param) == (0, "value")


def test_duplicate_feature_names():
    with pytest.raises(TransformError, match="'a'.*twice"):
        compile_features([spec("a", "dense", column="x")], [spec("a", "sparse", column="ids")], SCHEMA)


# -- the DAG ----------------------------------------------------------------------------------------------
def test_missing_input_names_feature_and_input():
    with pytest.raises(TransformError) as e:
        compile_features([], [spec("b", "sparse", inputs=["nope"])], SCHEMA)
    assert e.value.feature == "b" and "'nope'" in str(e.value)


def test_cycle_names_features():
    fs = [spec("a", "sparse", inputs=["c"]), spec("b", "sparse", inputs=["a"]), spec("c", "sparse", inputs=["b"]),
          spec("ok", "sparse", column="ids")]
    with pytest.raises(TransformError, match="cycle") as e:
        compile_features([], fs, SCHEMA)
    msg = str(e.value)
    assert all(f"{x}" in msg for x in ("a", "b", "c")) and "a -> c -> b -> a" in msg
    with pytest.raises(TransformError, match="cycle: self -> self"):
        compile_features([], [spec("self", "sparse", inputs=["self"])], SCHEMA)


class Counting(Op):
    """A user op that counts its kernel calls (identity on sparse lists)."""

    name = "count_calls"
    calls = 0

    def validate(self, params: Mapping[str, Any]) -> dict:
        if set(params) - {"tag"}:
            raise ParamError(sorted(set(params) - {"tag"})[0], "unknown parameter")
        return dict(params)

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        return inputs[0]

    def apply(self, state: Any, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        type(self).calls += 1
        return inputs[0]


@pytest.fixture
def counting():
    Counting.calls = 0
    register_op("count_calls", Counting, replace=True)
    yield Counting
    unregister_op("count_calls")


def test_shared_intermediate_computed_once_and_order(counting):
    # "base" is used by three features, declared after them; it must run first and once.
    sparse = [spec("h", "sparse", inputs=["base"], transforms=[{"op": "sigrid_hash", "max_value": 100}]),
              spec("pair", "sparse", inputs=["base", "h"], transforms=[{"op": "cartesian", "max_value": 7}]),
              spec("base", "sparse", column="ids", scores="sc",
                   transforms=[{"op": "count_calls"}, {"op": "firstx", "x": 2}])]
    dense = [spec("ov", "dense", inputs=["base", "ids2"], transforms=[{"op": "compute_score", "kind": "overlap_count"}]),
             spec("hr", "dense", column="ts", transforms=[{"op": "get_local_hour"}]),
             spec("hr1h", "dense", inputs=["hr"], transforms=[{"op": "onehot", "borders": [5, 11, 17]}])]
    p = compile_features(dense, sparse, SCHEMA)
    assert p.sparse_names == ["h", "pair", "base"] and p.dense_names == ["ov", "hr", "hr1h"]
    assert p.sparse_scored == [True, False, True] and p.dense_widths == [1, 1, 4]
    assert p.input_columns == ["ids", "ids2", "sc", "ts"]
    cols = {"ids": sparse_col([[1, 2, 3], [4]]), "sc": sparse_col([[0.5, 1.5, 2.5], [3.0]], np.float32),
            "ids2": sparse_col([[2, 9], [4]]), "ts": dense_col([3600 * 6, None], np.int64)}
    out = p.run(cols)
    assert counting.calls == 1
    assert sparse_rows(out.sparse[2]) == [[(1, 0.5), (2, 1.5)], [(4, 3.0)]]
    assert out.dense.tolist() == [[1, 6, 0, 1, 0, 0], [1, 0, 1, 0, 0, 0]]
    assert [len(r) for r in sparse_rows(out.sparse[1])] == [4, 1]


def test_feature_names_shadow_columns():
    # A derived feature naming "ids" gets the feature "ids" (after its transforms), not the column.
    sparse = [spec("ids", "sparse", column="ids", transforms=[{"op": "firstx", "x": 1}]),
              spec("d", "sparse", inputs=["ids"])]
    out = compile_features([], sparse, SCHEMA).run({"ids": sparse_col([[5, 6, 7]])})
    assert sparse_rows(out.sparse[1]) == [[5]]


# -- scored features -----------------------------------------------------------------------------------
def test_scores_stay_aligned_through_list_ops():
    steps = [{"op": "bucketize", "borders": [0, 10, 100]}, {"op": "firstx", "x": 3}, {"op": "clamp", "min": 0, "max": 2},
             {"op": "enumerate", "start": 10}]
    p = compile_features([], [spec("s", "sparse", column="ids", scores="sc", transforms=steps),
                              spec("n", "sparse", inputs=["s"], transforms=[{"op": "ngram", "n": 2}])], SCHEMA)
    assert p.sparse_scored == [True, False]
    out = p.run({"ids": sparse_col([[5, 50, 500, 5000], [], None]),
                 "sc": sparse_col([[0.1, 0.2, 0.3, 0.4], [], None], np.float32)})
    s = out.sparse[0]
    assert s.weights.dtype == np.float32 and s.values.tolist() == [10, 11, 12]
    assert s.weights.tolist() == np.array([0.1, 0.2, 0.3], np.float32).tolist()
    assert out.sparse[1].weights is None


def test_mismatched_scores_name_both_columns():
    p = compile_one(spec("s", "sparse", column="ids", scores="sc"))
    with pytest.raises(TransformError, match=r"row 1: column 'ids' has 2 ids but scores column 'sc' has 1"):
        p.run({"ids": sparse_col([[1], [2, 3]]), "sc": sparse_col([[1.0], [2.0]], np.float32)})


def test_run_errors_name_the_column():
    p = compile_one(spec("d", "dense", column="x"))
    with pytest.raises(TransformError, match="'x' is missing"):
        p.run({})
    with pytest.raises(TransformError, match="expected a DenseColumn"):
        p.run({"x": sparse_col([[1]])})


def test_empty_batch_and_no_features():
    p = compile_features([spec("d", "dense", column="x")], [spec("s", "sparse", column="ids", scores="sc")], SCHEMA)
    out = p.run({"x": dense_col([], np.float64), "ids": sparse_col([]), "sc": sparse_col([], np.float32)})
    assert out.dense.shape == (0, 1) and out.sparse[0].offsets.tolist() == [0]
    assert compile_features([], [], SCHEMA).run({"x": dense_col([1.0, 2.0], np.float64)}).dense.shape == (2, 0)


# -- the extension point ---------------------------------------------------------------------------------
class Negate(Op):
    name = "negate"

    def validate(self, params):
        if params:
            raise ParamError(next(iter(params)), "negate takes no parameters")
        return {}

    def output_kind(self, params, inputs):
        if inputs[0].kind != "sparse":
            from remoteloader.transforms import KindError
            raise KindError("needs a sparse list")
        return inputs[0]

    def apply(self, state, inputs, extra):
        col = inputs[0]
        return SparseColumn(np.negative(col.values), col.offsets, col.weights)


def test_register_op_and_builtin_protection(counting):
    register_op("negate", Negate())
    try:
        out = compile_one(spec("s", "sparse", column="ids", transforms=[{"op": "negate"}])).run(
            {"ids": sparse_col([[1, -2]])})
        assert sparse_rows(out.sparse[0]) == [[-1, 2]]
        e = error_of(spec("s", "sparse", column="ids", transforms=[{"op": "negate", "k": 1}]))
        assert (e.step, e.param) == (0, "k")
        e = error_of(spec("d", "dense", column="x", transforms=[{"op": "negate"}]))
        assert e.step == 0 and "sparse list" in str(e)
        with pytest.raises(ValueError, match="already registered"):
            register_op("negate", Negate())
        with pytest.raises(ValueError, match="built in"):
            register_op("firstx", Negate(), replace=True)
    finally:
        unregister_op("negate")


class FakeEntryPoint:
    def __init__(self, name, obj, value="fake_pkg.ops:Thing"):
        self.name, self._obj, self.value = name, obj, value

    def load(self):
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


def test_entry_point_loading(monkeypatch):
    seen = []

    def entry_points(group=None):
        seen.append(group)
        return [FakeEntryPoint("negate_ep", Negate), FakeEntryPoint("broken", ImportError("no module fake_pkg"))]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    try:
        op = get_op("negate_ep")
        assert isinstance(op, Negate) and seen == ["remoteloader.transforms"]
        out = compile_one(spec("s", "sparse", column="ids", transforms=[{"op": "negate_ep"}])).run(
            {"ids": sparse_col([[3]])})
        assert sparse_rows(out.sparse[0]) == [[-3]]
        with pytest.raises(TransformError, match="broken.*fake_pkg"):
            get_op("broken")
        e = error_of(spec("s", "sparse", column="ids", transforms=[{"op": "nothing_here"}]))
        assert e.param == "op" and "unknown op 'nothing_here'" in str(e)
    finally:
        unregister_op("negate_ep")
    assert "negate_ep" not in registry_mod.known_ops()


# -- the builder -----------------------------------------------------------------------------------------
def test_builder_produces_the_declarative_form():
    f = Feature.sparse("pages", column="idlist_3").firstx(20).sigrid_hash(max_value=1000)
    assert f.to_dict() == {"name": "pages", "column": "idlist_3",
                           "transforms": [{"op": "firstx", "x": 20}, {"op": "sigrid_hash", "max_value": 1000}]}
    g = Feature.dense("age", column="age", default=0.5).clamp(min=0, max=100).boxcox(lambda1=0.5)
    assert g.to_dict() == {"name": "age", "column": "age", "default": 0.5, "transforms": [
        {"op": "clamp", "min": 0, "max": 100}, {"op": "boxcox", "lambda1": 0.5}]}
    h = Feature.dense("j", inputs=["a", "b"]).compute_score("jaccard")
    assert h.to_dict() == {"name": "j", "inputs": ["a", "b"], "transforms": [{"op": "compute_score", "kind": "jaccard"}]}
    s = Feature.sparse("s", column="ids", scores="sc").map_id({1: 2}, default=0).ngram(2).op("positive_modulus", modulus=9)
    assert s.to_dict()["scores"] == "sc" and [t["op"] for t in s.to_dict()["transforms"]] == [
        "map_id", "ngram", "positive_modulus"]
    # Immutable: a shared prefix is not changed by extending it.
    base = Feature.sparse("b", column="ids").firstx(3)
    base.sigrid_hash(max_value=5)
    assert len(base.transforms) == 1


def test_builder_checks_params_and_round_trips_through_the_spec():
    with pytest.raises(TransformError) as e:
        Feature.sparse("pages", column="ids").firstx(2).sigrid_hash(max_value=0)
    assert (e.value.feature, e.value.step, e.value.param) == ("pages", 1, "max_value")
    with pytest.raises(TransformError, match="column= or inputs="):
        Feature.sparse("x")
    from remoteloader.spec import DatasetSpec
    from remoteloader.transforms import features_to_dict

    feats = [Feature.sparse("pages", column="ids").firstx(2).sigrid_hash(max_value=10, salt=3),
             Feature.dense("hour", column="ts").get_local_hour(tz_offset_seconds=3600).onehot([6, 12, 18]),
             Feature.dense("ov", inputs=["pages", "ids2"]).compute_score("has_overlap")]
    ds = DatasetSpec.from_dict({"table": "/tmp/t", "features": features_to_dict(feats)})
    assert list(ds.sparse) == [feats[0].to_spec()] and list(ds.dense) == [f.to_spec() for f in feats[1:]]
    p = compile_features(ds.dense, ds.sparse, SCHEMA)
    assert p.dense_widths == [4, 1]


def test_validate_sampling():
    assert validate_sampling({"rate": 0.5, "seed": 3}) == {"rate": 0.5, "seed": 3, "label_value": None, "weight": False}
    for bad, key in [({"rate": 0, "seed": 1}, "rate"), ({"rate": 1.5, "seed": 1}, "rate"), ({"seed": 1}, "rate"),
                     ({"rate": 0.5}, "seed"), ({"rate": 0.5, "seed": 1.0}, "seed"),
                     ({"rate": 0.5, "seed": 1, "weight": "yes"}, "weight"),
                     ({"rate": 0.5, "seed": 1, "label_value": "a"}, "label_value"),
                     ({"rate": 0.5, "seed": 1, "other": 1}, "other")]:
        with pytest.raises(ValueError, match=f"sampling.{key}"):
            validate_sampling(bad)
