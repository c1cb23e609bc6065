"""Operators that reshape id lists: ``firstx``, ``enumerate``, ``ngram``.

Weights: ``firstx`` keeps the scores of the ids it keeps and ``enumerate`` keeps each
position's score (it is one-to-one); ``ngram`` hashes several ids into one, so its
output carries no scores.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from numba import njit

from ..columns import Column, SparseColumn
from .base import Kind, Op, check_keys, int_param, need
from .hashing import ngram_kernel


@njit(cache=True, nogil=True)
def prefix_offsets_kernel(offsets, x):
    """Offsets of the rows cut to their first ``x`` elements."""
    rows = offsets.shape[0] - 1
    out = np.zeros(rows + 1, dtype=np.int64)
    for r in range(rows):
        out[r + 1] = out[r] + min(offsets[r + 1] - offsets[r], x)
    return out


@njit(cache=True, nogil=True)
def gather_prefix_kernel(src, offsets, out_offsets):
    """Copy the first ``len(out row)`` elements of each row (ids or weights)."""
    out = np.empty(out_offsets[-1], dtype=src.dtype)
    for r in range(offsets.shape[0] - 1):
        s, o = offsets[r], out_offsets[r]
        for j in range(out_offsets[r + 1] - o):
            out[o + j] = src[s + j]
    return out


@njit(cache=True, nogil=True)
def enumerate_kernel(offsets, start):
    out = np.empty(offsets[-1], dtype=np.int64)
    for r in range(offsets.shape[0] - 1):
        s = offsets[r]
        for j in range(offsets[r + 1] - s):
            out[s + j] = start + j
    return out


class FirstX(Op):
    name = "firstx"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("x",), required=("x",))
        return {"x": int_param(params, "x", lo=0, what="an int >= 0")}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        return need(inputs, sparse=True)

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        col: SparseColumn = inputs[0]
        offsets = np.ascontiguousarray(col.offsets, dtype=np.int64)
        out_offsets = prefix_offsets_kernel(offsets, state["x"])
        values = gather_prefix_kernel(np.ascontiguousarray(col.values, dtype=np.int64), offsets, out_offsets)
        weights = None
        if col.weights is not None:
            weights = gather_prefix_kernel(np.ascontiguousarray(col.weights, dtype=np.float32), offsets, out_offsets)
        return SparseColumn(values, out_offsets, weights)


class Enumerate(Op):
    name = "enumerate"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("start",))
        return {"start": int_param(params, "start", 0)}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        return need(inputs, sparse=True)

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        col: SparseColumn = inputs[0]
        offsets = np.ascontiguousarray(col.offsets, dtype=np.int64)
        # start + j wraps modulo 2**64 like every integer op of transforms.md.
        return SparseColumn(enumerate_kernel(offsets, state["start"]), offsets, col.weights)


class NGram(Op):
    name = "ngram"

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("n", "max_value"), required=("n",))
        n = int_param(params, "n", lo=1, hi=1 << 20, what="an int >= 1")
        mv = params.get("max_value")
        return {"n": n, "max_value": None if mv is None else int_param(params, "max_value", lo=1,
                                                                          what="an int in [1, 2**63)")}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        need(inputs, sparse=True)
        return Kind("sparse")

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        col: SparseColumn = inputs[0]
        mv = state["max_value"]
        values, offsets = ngram_kernel(np.ascontiguousarray(col.values, dtype=np.int64),
                                       np.ascontiguousarray(col.offsets, dtype=np.int64), state["n"],
                                       0 if mv is None else mv)
        return SparseColumn(values, offsets)


OPS = (FirstX(), Enumerate(), NGram())
