"""Operators that map each id (sparse) or each value (dense) on its own.

They accept a sparse list or a dense column, keep the row structure (offsets) and the
scores (weights) untouched, and only rewrite ``values``. ``bucketize`` and ``clamp`` also
take float dense values; the others are integer-only.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numba
import numpy as np
from numba import njit

from ..columns import Column, DenseColumn, SparseColumn
from .base import (DENSE_FLOAT, INT64_MAX, INT64_MIN, Kind, Op, ParamError, bool_param, check_keys,
                   float_values, int_param, int_values, is_int, is_number, need, with_values)
from .hashing import sigrid_hash_kernel

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: cheap, spreads strided keys


# -- kernels ---------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def floormod_kernel(values, m):
    out = np.empty(values.shape[0], dtype=np.int64)
    for i in range(values.shape[0]):
        out[i] = values[i] % m  # numba int % has Python floor semantics
    return out


_LINEAR_MAX = 128  # up to this many borders a SIMD count beats a (mispredicting) binary search


@njit(inline="always")
def _count_less(borders, v):
    """Number of (sorted) borders strictly less than v; NaN compares false: 0."""
    n = borders.shape[0]
    if n <= _LINEAR_MAX:
        c = 0
        for j in range(n):
            c += borders[j] < v
        return c
    a, b = 0, n
    while a < b:
        mid = (a + b) >> 1
        if borders[mid] < v:
            a = mid + 1
        else:
            b = mid
    return a


@njit(cache=True, nogil=True)
def bucketize_float_kernel(values, borders):
    """i = #borders < v; one more if v >= borders[i+1] (a doubled border gets its own bucket)."""
    n = borders.shape[0]
    out = np.empty(values.shape[0], dtype=np.int64)
    for k in range(values.shape[0]):
        v = values[k]
        i = _count_less(borders, v)
        if i < n - 1 and v >= borders[i + 1]:
            i += 1
        out[k] = i
    return out


@njit(cache=True, nogil=True)
def bucketize_int_kernel(values, floors, ceils, first):
    """Exact int64-vs-real-border bucketize (float64 would round ids above 2**53).

    ``first`` borders lie below every int64 and are not passed; ``floors``/``ceils``
    are floor/ceil of the borders inside the int64 range (those above it are left out:
    no int64 reaches them). For those ``b < v <=> floor(b) < v`` and
    ``v >= b <=> v >= ceil(b)`` hold exactly.
    """
    m = floors.shape[0]
    out = np.empty(values.shape[0], dtype=np.int64)
    for k in range(values.shape[0]):
        v = values[k]
        i = _count_less(floors, v)
        if i < m - 1 and v >= ceils[i + 1]:
            i += 1
        out[k] = first + i
    return out


@njit(cache=True, nogil=True)
def build_id_table(keys, vals):
    """Open-addressing table (linear probing, load <= 1/2) for map_id."""
    bits = 3
    while (1 << bits) < 2 * keys.shape[0]:
        bits += 1
    cap = 1 << bits
    tkeys = np.zeros(cap, dtype=np.int64)
    tvals = np.zeros(cap, dtype=np.int64)
    used = np.zeros(cap, dtype=np.bool_)
    shift = np.uint64(64 - bits)
    mask = cap - 1
    for i in range(keys.shape[0]):
        h = numba.int64((numba.uint64(keys[i]) * _GOLDEN) >> shift)
        while used[h] and tkeys[h] != keys[i]:
            h = (h + 1) & mask
        tkeys[h] = keys[i]
        tvals[h] = vals[i]
        used[h] = True
    return tkeys, tvals, used, bits


@njit(cache=True, nogil=True)
def map_id_kernel(values, tkeys, tvals, used, bits, default):
    out = np.empty(values.shape[0], dtype=np.int64)
    shift = np.uint64(64 - bits)
    mask = (1 << bits) - 1
    for i in range(values.shape[0]):
        x = values[i]
        h = numba.int64((numba.uint64(x) * _GOLDEN) >> shift)
        r = default
        while used[h]:
            if tkeys[h] == x:
                r = tvals[h]
                break
            h = (h + 1) & mask
        out[i] = r
    return out


# -- shared helpers ------------------------------------------------------------------------------
# Quantile bucketing needs hundreds to thousands of borders; this many keeps a hostile
# spec's compile (and a onehot's width, also capped as dense width at bind) small.
MAX_BORDERS = 1 << 16


def check_borders(params: Mapping[str, Any]) -> list:
    b = params.get("borders")
    if b is None:
        raise ParamError("borders", "required parameter is missing")
    if not isinstance(b, (list, tuple)) or not b:
        raise ParamError("borders", f"must be a non-empty list of numbers, got {b!r}")
    if len(b) > MAX_BORDERS:  # before anything walks the list
        raise ParamError("borders", f"{len(b):,} borders, at most {MAX_BORDERS:,}")
    for i, x in enumerate(b):
        if not is_number(x) or math.isnan(x):
            raise ParamError("borders", f"entry {i} is not a number: {x!r}")
    for i in range(1, len(b)):
        if b[i] < b[i - 1]:
            raise ParamError("borders", f"must be non-decreasing, but {b[i - 1]!r} > {b[i]!r} at {i}")
        if i >= 2 and b[i] == b[i - 1] == b[i - 2]:
            raise ParamError("borders", f"at most two equal borders in a row, {b[i]!r} appears three times at {i - 2}..{i}")
    return [int(x) if is_int(x) else float(x) for x in b]


class BucketPlan:
    """Borders prepared for both value types, computed once at compile time."""

    def __init__(self, borders: list) -> None:
        self.n = len(borders)
        # Float values compare against float64 borders (an int border above 2**53 rounds).
        self.float_borders = np.array([float(b) for b in borders], dtype=np.float64)
        # Int values compare exactly: Python compares int and float without rounding.
        first = sum(1 for b in borders if b < INT64_MIN)
        stop = self.n - sum(1 for b in borders if b > INT64_MAX)
        self.first = first
        self.floors = np.array([math.floor(b) for b in borders[first:stop]], dtype=np.int64)
        self.ceils = np.array([math.ceil(b) for b in borders[first:stop]], dtype=np.int64)

    def buckets(self, values: np.ndarray) -> np.ndarray:
        if values.dtype.kind in "iu":
            return bucketize_int_kernel(np.ascontiguousarray(values, dtype=np.int64), self.floors, self.ceils,
                                        self.first)
        return bucketize_float_kernel(np.ascontiguousarray(values, dtype=np.float64), self.float_borders)


# -- ops ----------------------------------------------------------------------------------------------
class IntElementwise(Op):
    """Integer-only element-wise op: sparse -> sparse (weights kept), dense int -> dense int."""

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        return need(inputs, sparse=True, dense_int=True)


class SigridHash(IntElementwise):
    name = "sigrid_hash"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("salt", "max_value"), required=("max_value",))
        return {"salt": int_param(params, "salt", 0),
                "max_value": int_param(params, "max_value", lo=1, what="an int in [1, 2**63)")}

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        col = inputs[0]
        return with_values(col, sigrid_hash_kernel(int_values(col), state["salt"], state["max_value"]))


class PositiveModulus(IntElementwise):
    name = "positive_modulus"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("modulus",), required=("modulus",))
        return {"modulus": int_param(params, "modulus", lo=1, what="an int in [1, 2**63)")}

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        col = inputs[0]
        return with_values(col, floormod_kernel(int_values(col), state["modulus"]))


class MapId(IntElementwise):
    name = "map_id"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("mapping", "default"), required=("mapping",))
        mapping = params["mapping"]
        if not isinstance(mapping, Mapping):
            raise ParamError("mapping", f"must be a mapping of int id -> int id, got {type(mapping).__name__}")
        out: dict[int, int] = {}
        for k, v in mapping.items():
            # JSON (and some wire formats) turn int keys into strings; accept "123" as 123.
            key = int(k) if isinstance(k, str) and _is_int_text(k) else k
            if not is_int(key) or not INT64_MIN <= int(key) <= INT64_MAX:
                raise ParamError("mapping", f"key {k!r} is not an int64 id")
            if not is_int(v) or not INT64_MIN <= int(v) <= INT64_MAX:
                raise ParamError("mapping", f"value {v!r} (for key {k!r}) is not an int64 id")
            if int(key) in out:
                raise ParamError("mapping", f"key {int(key)} appears twice")
            out[int(key)] = int(v)
        return {"mapping": out, "default": int_param(params, "default", 0)}

    def prepare(self, params: dict, inputs: tuple[Kind, ...]) -> Any:
        keys = np.fromiter(params["mapping"].keys(), dtype=np.int64, count=len(params["mapping"]))
        vals = np.fromiter(params["mapping"].values(), dtype=np.int64, count=len(params["mapping"]))
        return build_id_table(keys, vals) + (params["default"],)

    def apply(self, state: Any, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        col = inputs[0]
        tkeys, tvals, used, bits, default = state
        return with_values(col, map_id_kernel(int_values(col), tkeys, tvals, used, bits, default))


def _is_int_text(s: str) -> bool:
    t = s.strip()
    return t.lstrip("+-").isdigit()


class Bucketize(Op):
    name = "bucketize"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("borders", "as_sparse"), required=("borders",))
        return {"borders": check_borders(params), "as_sparse": bool_param(params, "as_sparse", False)}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        k = need(inputs, sparse=True, dense_int=True, dense_float=True)
        if k.kind == "sparse":
            if params["as_sparse"]:
                raise ParamError("as_sparse", "only applies to a dense input (a sparse input stays sparse)")
            return k
        return Kind("sparse") if params["as_sparse"] else DENSE_FLOAT

    def prepare(self, params: dict, inputs: tuple[Kind, ...]) -> Any:
        return BucketPlan(params["borders"]), params["as_sparse"]

    def apply(self, state: Any, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        plan, as_sparse = state
        col = inputs[0]
        idx = plan.buckets(col.values)
        if isinstance(col, SparseColumn):
            return with_values(col, idx)
        if as_sparse:  # one id per row
            return SparseColumn(idx, np.arange(idx.shape[0] + 1, dtype=np.int64))
        return DenseColumn(idx.astype(np.float64))


class Clamp(Op):
    name = "clamp"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("min", "max"), required=("min", "max"))
        lo, hi = float_param_exact(params, "min"), float_param_exact(params, "max")
        if lo > hi:
            raise ParamError("min", f"min ({lo!r}) must be <= max ({hi!r})")
        return {"min": lo, "max": hi}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        k = need(inputs, sparse=True, dense_int=True, dense_float=True)
        int_bounds = all(is_int(params[key]) and INT64_MIN <= params[key] <= INT64_MAX for key in ("min", "max"))
        if k.kind == "sparse" and not int_bounds:  # ids stay ids: the bounds must be int64 too
            key = next(key for key in ("min", "max") if not is_int(params[key]) or not INT64_MIN <= params[key] <= INT64_MAX)
            raise ParamError(key, f"must be an int64 for a sparse input, got {params[key]!r}")
        if k.kind == "dense" and k.dtype == "int" and not int_bounds:
            return DENSE_FLOAT  # an int column clamped to real bounds becomes float
        return k

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        col = inputs[0]
        if col.values.dtype.kind in "iu" and is_int(state["min"]) and is_int(state["max"]):
            v = int_values(col)
            lo, hi = np.int64(state["min"]), np.int64(state["max"])
        else:
            v = float_values(col)
            lo, hi = np.float64(state["min"]), np.float64(state["max"])
        # maximum/minimum propagate NaN (as min(max(v, lo), hi) does in Python).
        return with_values(col, np.minimum(np.maximum(v, lo), hi))


def float_param_exact(params: Mapping[str, Any], key: str) -> Any:
    v = params[key]
    if not is_number(v) or math.isnan(v):
        raise ParamError(key, f"must be a number, got {v!r}")
    return int(v) if is_int(v) else float(v)


OPS = (SigridHash(), PositiveModulus(), MapId(), Bucketize(), Clamp())
