"""Operators on dense (one value per row) features.

Float values travel as float64 between steps (so a float64 table column is not rounded
early) and become float32 only in the batch; ``boxcox`` and ``logit`` compute in float64
and round their result to float32, as their Caffe2 originals store float.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
from numba import njit

from ..columns import Column, DenseColumn, SparseColumn
from .base import (DENSE_FLOAT, DENSE_INT, INT64_MAX, INT64_MIN, Kind, Op, ParamError, check_keys, float_param,
                   float_values, int_param, int_values, is_int, need)
from .elementwise_ops import BucketPlan, check_borders


@njit(cache=True, nogil=True)
def boxcox_kernel(values, lambda1, lambda2):
    out = np.empty(values.shape[0], dtype=np.float64)
    for i in range(values.shape[0]):
        t = values[i] + lambda2
        if t < 1e-6:  # max(t, 1e-6), keeping NaN as NaN like Python's max(nan, x)
            t = 1e-6
        if lambda1 == 0.0:
            r = math.log(t)
        else:
            r = (t ** lambda1 - 1.0) / lambda1
        out[i] = np.float32(r)
    return out


@njit(cache=True, nogil=True)
def logit_kernel(values, eps):
    out = np.empty(values.shape[0], dtype=np.float64)
    hi = 1.0 - eps
    for i in range(values.shape[0]):
        p = values[i]
        if p < eps:
            p = eps
        if p > hi:
            p = hi
        out[i] = np.float32(math.log(p / (1.0 - p)))
    return out


@njit(cache=True, nogil=True)
def local_hour_kernel(ts, offsets, offset):
    """floormod(floordiv(ts + offset, 3600), 24); ``offsets`` (per row) wins when non-empty."""
    out = np.empty(ts.shape[0], dtype=np.int64)
    per_row = offsets.shape[0] > 0
    for i in range(ts.shape[0]):
        t = ts[i] + (offsets[i] if per_row else offset)  # wraps modulo 2**64
        out[i] = (t // 3600) % 24
    return out


@njit(cache=True, nogil=True)
def onehot_kernel(idx, width):
    out = np.zeros((idx.shape[0], width), dtype=np.float32)
    for i in range(idx.shape[0]):
        out[i, idx[i]] = 1.0
    return out


def fill_dense_nulls(col: DenseColumn, value: Any) -> DenseColumn:
    """Replace null rows by ``value``; an int column stays int when the value is a whole number."""
    values = col.values
    if values.dtype.kind in "iu" and whole(value):
        values = int_values(col)
        value = int(value)
    else:
        values = float_values(col)
        value = float(value)
    if col.valid is not None:
        values = np.where(np.asarray(col.valid, dtype=bool), values, values.dtype.type(value))
    return DenseColumn(values)


def whole(value: Any) -> bool:
    if is_int(value):
        return INT64_MIN <= int(value) <= INT64_MAX
    return isinstance(value, float) and value.is_integer() and INT64_MIN <= value <= INT64_MAX


class BoxCox(Op):
    name = "boxcox"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("lambda1", "lambda2"), required=("lambda1",))
        return {"lambda1": float(float_param(params, "lambda1")), "lambda2": float(float_param(params, "lambda2", 0.0))}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        need(inputs, dense_int=True, dense_float=True)
        return DENSE_FLOAT

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        return DenseColumn(boxcox_kernel(float_values(inputs[0]), state["lambda1"], state["lambda2"]))


class Logit(Op):
    name = "logit"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("eps",))
        eps = float(float_param(params, "eps", 1e-6))
        if not 0.0 < eps < 0.5:
            raise ParamError("eps", f"must be in (0, 0.5), got {eps!r}")
        return {"eps": eps}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        need(inputs, dense_int=True, dense_float=True)
        return DENSE_FLOAT

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        return DenseColumn(logit_kernel(float_values(inputs[0]), state["eps"]))


class OneHot(Op):
    name = "onehot"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("borders",), required=("borders",))
        return {"borders": check_borders(params)}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        need(inputs, dense_int=True, dense_float=True)
        return Kind("dense", "float", width=len(params["borders"]) + 1)

    def prepare(self, params: dict, inputs: tuple[Kind, ...]) -> Any:
        return BucketPlan(params["borders"])

    def apply(self, state: BucketPlan, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        return DenseColumn(onehot_kernel(state.buckets(inputs[0].values), state.n + 1))


class GetLocalHour(Op):
    name = "get_local_hour"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("tz_offset_seconds", "tz_offset_column"))
        if "tz_offset_seconds" in params and "tz_offset_column" in params:
            raise ParamError("tz_offset_column", "give either tz_offset_seconds or tz_offset_column, not both")
        col = params.get("tz_offset_column")
        if col is not None and (not isinstance(col, str) or not col):
            raise ParamError("tz_offset_column", f"must be a column name, got {col!r}")
        return {"tz_offset_seconds": int_param(params, "tz_offset_seconds", 0), "tz_offset_column": col}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        need(inputs, dense_int=True, what="an integer dense column (UTC seconds)")
        return DENSE_INT

    def extra_columns(self, params: dict) -> dict[str, tuple[str, ...]]:
        col = params["tz_offset_column"]
        return {} if col is None else {col: ("int",)}

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        col = state["tz_offset_column"]
        # A null offset holds 0 (the reader's null convention): UTC.
        offsets = int_values(extra[col]) if col is not None else np.empty(0, dtype=np.int64)
        return DenseColumn(local_hour_kernel(int_values(inputs[0]), offsets, state["tz_offset_seconds"]))


class FillNull(Op):
    """Only meaningful as a feature's first step: it replaces the default null handling."""

    name = "fill_null"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("value",))
        return {"value": None if "value" not in params else float_param(params, "value")}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        k = need(inputs, sparse=True, dense_int=True, dense_float=True)
        if k.kind == "sparse":
            if params["value"] is not None:
                raise ParamError("value", "applies to dense features only (a null list becomes an empty list)")
            return k
        if params["value"] is None:
            raise ParamError("value", "required parameter is missing (for a dense feature)")
        return DENSE_INT if k.dtype == "int" and whole(params["value"]) else DENSE_FLOAT

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        col = inputs[0]
        if isinstance(col, SparseColumn):  # null rows already have length 0
            return SparseColumn(col.values, col.offsets, col.weights)
        return fill_dense_nulls(col, state["value"])


OPS = (BoxCox(), Logit(), OneHot(), GetLocalHour(), FillNull())
