"""Operators on two id lists of the same row: ``id_list_intersect``, ``compute_score``, ``cartesian``.

Per-row set operations use a small open-addressing hash table over ``b``'s row, reused
for every row: a slot belongs to the current row only if its stamp equals the row
number, so nothing is cleared between rows and a row costs O(len(a) + len(b)).

Weights: ``id_list_intersect`` keeps ``a``'s scores for the ids it keeps; ``cartesian``
output carries no scores; ``compute_score`` produces a dense value.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numba
import numpy as np
from numba import njit

from ..columns import Column, DenseColumn, SparseColumn
from .base import DENSE_FLOAT, Kind, KindError, Op, ParamError, check_keys, int_param
from .hashing import cartesian_kernel

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SMALL = 64  # rows with len(a) * len(b) up to this compare all pairs (SIMD): cheaper than hashing

SCORE_KINDS = ("has_overlap", "overlap_count", "max_count", "jaccard", "score_sum", "score_min", "score_max", "cosine")
# Which inputs must be scored for each kind: (a, b).
_NEEDS_SCORES = {"score_sum": (False, True), "score_min": (False, True), "score_max": (False, True),
                 "cosine": (True, True)}


@njit(inline="always")
def _bits_for(n):
    bits = 4
    while (1 << bits) < 2 * n:
        bits += 1
    return bits


@njit(inline="always")
def _max_len(offsets):
    m = 0
    for r in range(offsets.shape[0] - 1):
        m = max(m, offsets[r + 1] - offsets[r])
    return m


@njit(cache=True, nogil=True)
def intersect_mask_kernel(av, ao, bv, bo):
    """keep[i]: id i of a occurs in the same row of b; plus the output offsets."""
    rows = ao.shape[0] - 1
    keep = np.zeros(av.shape[0], dtype=np.bool_)
    out_offsets = np.zeros(rows + 1, dtype=np.int64)
    cap = 1 << _bits_for(_max_len(bo))
    keys = np.zeros(cap, dtype=np.int64)
    stamp = np.full(cap, -1, dtype=np.int64)
    for r in range(rows):
        a0, a1, b0, b1 = ao[r], ao[r + 1], bo[r], bo[r + 1]
        kept = 0
        if a1 > a0 and b1 > b0:
            if (a1 - a0) * (b1 - b0) <= _SMALL:
                for i in range(a0, a1):
                    x = av[i]
                    found = False
                    for j in range(b0, b1):  # no early exit: the loop vectorizes
                        found |= bv[j] == x
                    keep[i] = found
                    kept += found
            else:
                bits = _bits_for(b1 - b0)
                shift = np.uint64(64 - bits)
                mask = (1 << bits) - 1
                for j in range(b0, b1):
                    x = bv[j]
                    h = numba.int64((numba.uint64(x) * _GOLDEN) >> shift)
                    while stamp[h] == r and keys[h] != x:
                        h = (h + 1) & mask
                    stamp[h] = r
                    keys[h] = x
                for i in range(a0, a1):
                    x = av[i]
                    h = numba.int64((numba.uint64(x) * _GOLDEN) >> shift)
                    while stamp[h] == r:
                        if keys[h] == x:
                            keep[i] = True
                            kept += 1
                            break
                        h = (h + 1) & mask
        out_offsets[r + 1] = out_offsets[r] + kept
    return keep, out_offsets


@njit(cache=True, nogil=True, inline="always")
def _claim_slot(x, r, shift, mask, keys, stamp, cb, ca, sb, sa):
    """Slot of id ``x`` in row ``r``'s open-addressing table; a new id's slot is claimed
    and its counters zeroed (a stamp per slot avoids clearing the table per row)."""
    h = numba.int64((numba.uint64(x) * _GOLDEN) >> shift)
    while stamp[h] == r and keys[h] != x:
        h = (h + 1) & mask
    if stamp[h] == r:
        return h, False
    stamp[h] = r
    keys[h] = x
    cb[h] = 0
    ca[h] = 0
    sb[h] = 0.0
    sa[h] = 0.0
    return h, True


@njit(cache=True, nogil=True)
def compute_score_kernel(av, ao, aw, bv, bo, bw, kind):
    """One float per row; see transforms.md for each kind. Weights may be empty (unscored).

    Float sums run in a fixed order so results are reproducible: an id's summed score in
    the order of its list; sums over ids in the order of first occurrence in ``a``
    (``norm(sb)``: first occurrence in ``b``).
    """
    rows = ao.shape[0] - 1
    out = np.zeros(rows, dtype=np.float64)
    has_aw = aw.shape[0] > 0
    has_bw = bw.shape[0] > 0
    cap = 1 << _bits_for(_max_len(bo) + _max_len(ao))
    keys = np.zeros(cap, dtype=np.int64)
    stamp = np.full(cap, -1, dtype=np.int64)
    cb = np.zeros(cap, dtype=np.int64)
    ca = np.zeros(cap, dtype=np.int64)
    sb = np.zeros(cap, dtype=np.float64)
    sa = np.zeros(cap, dtype=np.float64)
    a_order = np.empty(max(_max_len(ao), 1), dtype=np.int64)  # slots of a's distinct ids
    b_order = np.empty(max(_max_len(bo), 1), dtype=np.int64)
    for r in range(rows):
        a0, a1, b0, b1 = ao[r], ao[r + 1], bo[r], bo[r + 1]
        if a1 == a0 or b1 == b0:
            continue  # every kind is 0.0 when a list is empty
        bits = _bits_for((a1 - a0) + (b1 - b0))
        shift = np.uint64(64 - bits)
        mask = (1 << bits) - 1
        nb = 0
        for j in range(b0, b1):
            h, new = _claim_slot(bv[j], r, shift, mask, keys, stamp, cb, ca, sb, sa)
            if new:
                b_order[nb] = h
                nb += 1
            cb[h] += 1
            if has_bw:
                sb[h] += numba.float64(bw[j])
        na = 0
        for i in range(a0, a1):
            h, _ = _claim_slot(av[i], r, shift, mask, keys, stamp, cb, ca, sb, sa)
            if ca[h] == 0:
                a_order[na] = h
                na += 1
            ca[h] += 1
            if has_aw:
                sa[h] += numba.float64(aw[i])
        res = 0.0
        if kind == 0:  # has_overlap
            for k in range(na):
                if cb[a_order[k]] > 0:
                    res = 1.0
                    break
        elif kind == 1 or kind == 3:  # overlap_count, jaccard
            c = 0
            for k in range(na):
                c += min(ca[a_order[k]], cb[a_order[k]])
            if kind == 1:
                res = c
            else:
                res = c / ((a1 - a0) + (b1 - b0) - c)
        elif kind == 2:  # max_count
            c = 0
            for k in range(na):
                h = a_order[k]
                if cb[h] > 0:
                    c += max(ca[h], cb[h])
            res = c
        elif kind == 4:  # score_sum
            for k in range(na):
                h = a_order[k]
                if cb[h] > 0:
                    res += sb[h]
        elif kind == 5 or kind == 6:  # score_min, score_max
            found = False
            for k in range(na):
                h = a_order[k]
                if cb[h] > 0:
                    if not found:
                        res = sb[h]
                        found = True
                    elif (kind == 5 and sb[h] < res) or (kind == 6 and sb[h] > res):
                        res = sb[h]
        else:  # cosine
            dot = 0.0
            na2 = 0.0
            for k in range(na):
                h = a_order[k]
                na2 += sa[h] * sa[h]
                if cb[h] > 0:
                    dot += sa[h] * sb[h]
            nb2 = 0.0
            for k in range(nb):
                h = b_order[k]
                nb2 += sb[h] * sb[h]
            if na2 != 0.0 and nb2 != 0.0:
                res = dot / (math.sqrt(na2) * math.sqrt(nb2))
        out[r] = np.float32(res)
    return out


def _two_sparse(op: str, inputs: tuple[Kind, ...]) -> None:
    if len(inputs) != 2:
        raise KindError(f"takes exactly two inputs (inputs: [a, b]), got {len(inputs)}")
    for which, k in zip("ab", inputs):
        if k.kind != "sparse":
            raise KindError(f"input {which} must be a sparse list, got {k}")


def _lists(col: SparseColumn) -> tuple[np.ndarray, np.ndarray]:
    return np.ascontiguousarray(col.values, dtype=np.int64), np.ascontiguousarray(col.offsets, dtype=np.int64)


def _check_rows(a: SparseColumn, b: SparseColumn) -> None:
    if len(a) != len(b):
        raise ValueError(f"inputs have different row counts: {len(a)} and {len(b)}")


class IdListIntersect(Op):
    name = "id_list_intersect"
    arity = 2

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ())
        return {}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        _two_sparse(self.name, inputs)
        return Kind("sparse", scored=inputs[0].scored)

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        a, b = inputs
        _check_rows(a, b)
        av, ao = _lists(a)
        keep, offsets = intersect_mask_kernel(av, ao, *_lists(b))
        return SparseColumn(av[keep], offsets, None if a.weights is None else np.asarray(a.weights, np.float32)[keep])


class ComputeScore(Op):
    name = "compute_score"
    arity = 2

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("kind",), required=("kind",))
        if params["kind"] not in SCORE_KINDS:
            raise ParamError("kind", f"must be one of {', '.join(SCORE_KINDS)}, got {params['kind']!r}")
        return {"kind": params["kind"]}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        _two_sparse(self.name, inputs)
        for which, needed, k in zip("ab", _NEEDS_SCORES.get(params["kind"], (False, False)), inputs):
            if needed and not k.scored:
                raise ParamError("kind", f"{params['kind']} needs scored input {which}, got an unscored list")
        return DENSE_FLOAT

    def prepare(self, params: dict, inputs: tuple[Kind, ...]) -> Any:
        return SCORE_KINDS.index(params["kind"])

    def apply(self, state: int, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        a, b = inputs
        _check_rows(a, b)
        none = np.empty(0, dtype=np.float32)
        aw = none if a.weights is None else np.ascontiguousarray(a.weights, dtype=np.float32)
        bw = none if b.weights is None else np.ascontiguousarray(b.weights, dtype=np.float32)
        (av, ao), (bv, bo) = _lists(a), _lists(b)
        return DenseColumn(compute_score_kernel(av, ao, aw, bv, bo, bw, state))


class Cartesian(Op):
    name = "cartesian"
    arity = 2

    def validate(self, params: Mapping[str, Any]) -> dict:
        check_keys(params, ("max_value",))
        mv = params.get("max_value")
        return {"max_value": None if mv is None else int_param(params, "max_value", lo=1, what="an int in [1, 2**63)")}

    def output_kind(self, params: dict, inputs: tuple[Kind, ...]) -> Kind:
        _two_sparse(self.name, inputs)
        return Kind("sparse")

    def apply(self, state: dict, inputs: Sequence[Column], extra: Mapping[str, Column]) -> Column:
        a, b = inputs
        _check_rows(a, b)
        mv = state["max_value"]
        values, offsets = cartesian_kernel(*_lists(a), *_lists(b), 0 if mv is None else mv)
        return SparseColumn(values, offsets)


OPS = (IdListIntersect(), ComputeScore(), Cartesian())
