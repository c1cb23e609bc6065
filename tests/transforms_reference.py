"""Slow scalar reference of transforms.md: one row, one value at a time, in pure Python.

Integers are Python ints with explicit 64-bit masking, so the wrap-around of the
definitions is spelled out instead of inherited from numpy or numba. Floats are Python
floats (IEEE double); ``f32`` rounds where the kernels store float32. ``run_features``
interprets a whole feature list the way the spec defines it, including nulls, defaults,
scores and derived features, so tests can compare it with the compiled pipeline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

M64 = (1 << 64) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

try:
    from remoteloader.spec import FeatureSpec
except ImportError:  # the spec module is written concurrently; same fields
    @dataclass(frozen=True)
    class FeatureSpec:  # type: ignore[no-redef]
        name: str
        kind: str
        column: Optional[str] = None
        inputs: tuple = ()
        scores: Optional[str] = None
        transforms: tuple = ()
        default: Optional[float] = None


def spec(name, kind, column=None, inputs=(), scores=None, transforms=(), default=None) -> FeatureSpec:
    return FeatureSpec(name=name, kind=kind, column=column, inputs=tuple(inputs), scores=scores,
                       transforms=tuple(transforms), default=default)


# -- 64-bit words -------------------------------------------------------------------------
def u64(x: int) -> int:
    return x & M64


def signed(h: int) -> int:
    h &= M64
    return h - (1 << 64) if h >> 63 else h


def mix64(k: int) -> int:
    k = u64(k)
    k = u64((~k & M64) + (k << 21))
    k = k ^ (k >> 24)
    k = u64(k + (k << 3) + (k << 8))
    k = k ^ (k >> 14)
    k = u64(k + (k << 2) + (k << 4))
    k = k ^ (k >> 28)
    k = u64(k + (k << 31))
    return k


C = 0x9DDFEA08EB382D69


def combine(u: int, l: int) -> int:
    u, l = u64(u), u64(l)
    a = u64((l ^ u) * C)
    a ^= a >> 47
    b = u64((u ^ a) * C)
    b ^= b >> 47
    return u64(b * C)


def f32(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def to_f32(x) -> float:
    """A dense value as stored in the batch (an int64 rounds to float32 in one step)."""
    if isinstance(x, int):
        return float(np.float32(np.int64(x)))
    return f32(x)


def whole(v) -> bool:
    return isinstance(v, int) or (isinstance(v, float) and v.is_integer())


# -- operators on one value / one row ----------------------------------------------------------
def sigrid_hash(x: int, salt: int, max_value: int) -> int:
    if max_value == 1:
        return 0
    return signed(combine(salt, mix64(x))) % max_value


def bucketize(v, borders) -> int:
    if isinstance(v, float):
        borders = [float(b) for b in borders]  # float values compare with float64 borders
    i = sum(1 for b in borders if b < v)
    if i < len(borders) - 1 and v >= borders[i + 1]:
        return i + 1
    return i


def clamp(v, lo, hi):
    if isinstance(v, float) or not isinstance(lo, int) or not isinstance(hi, int):
        lo, hi = float(lo), float(hi)
    return min(max(v, lo), hi)


def boxcox(v, lambda1: float, lambda2: float = 0.0) -> float:
    t = float(v) + lambda2
    if t < 1e-6:
        t = 1e-6
    if lambda1 == 0:
        return f32(math.log(t))
    try:
        p = t ** lambda1
    except OverflowError:
        p = math.inf
    return f32((p - 1.0) / lambda1)


def logit(v, eps: float = 1e-6) -> float:
    p = float(v)
    if p < eps:
        p = eps
    if p > 1.0 - eps:
        p = 1.0 - eps
    return f32(math.log(p / (1.0 - p)))


def onehot(v, borders) -> list:
    out = [0.0] * (len(borders) + 1)
    out[bucketize(v, borders)] = 1.0
    return out


def map_id(x: int, mapping: dict, default: int = 0) -> int:
    return {int(k): v for k, v in mapping.items()}.get(x, default)


def positive_modulus(x: int, modulus: int) -> int:
    return x % modulus


def local_hour(ts: int, offset: int) -> int:
    t = signed(ts + offset)
    return (t // 3600) % 24


def firstx(row: list, x: int) -> list:
    return row[:x]


def enumerate_row(row: list, start: int) -> list:
    return [signed(start + j) for j in range(len(row))]


def ngram(row: list, n: int, max_value: Optional[int]) -> list:
    out = []
    for i in range(len(row) - n + 1):
        h = u64(row[i])
        for j in range(1, n):
            h = combine(h, row[i + j])
        v = signed(h)
        out.append(v % max_value if max_value else v)
    return out


def cartesian(a: list, b: list, max_value: Optional[int]) -> list:
    out = []
    for x in a:
        for y in b:
            v = signed(combine(x, y))
            out.append(v % max_value if max_value else v)
    return out


def intersect(a: list, b: list) -> list:
    """Indexes (into a) of the ids of a that occur in b."""
    bs = set(b)
    return [i for i, x in enumerate(a) if x in bs]


def compute_score(a: list, b: list, aw: Optional[list], bw: Optional[list], kind: str) -> float:
    ca: dict = {}
    cb: dict = {}
    sa: dict = {}
    sb: dict = {}
    for j, x in enumerate(b):
        cb[x] = cb.get(x, 0) + 1
        sb[x] = sb.get(x, 0.0) + (float(bw[j]) if bw is not None else 0.0)
    for i, x in enumerate(a):
        ca[x] = ca.get(x, 0) + 1
        sa[x] = sa.get(x, 0.0) + (float(aw[i]) if aw is not None else 0.0)
    if not a or not b:
        return 0.0
    common = [x for x in ca if x in cb]  # first occurrence order in a
    if kind == "has_overlap":
        res = 1.0 if any(x in ca for x in b) else 0.0
    elif kind in ("overlap_count", "jaccard"):
        c = sum(min(ca[x], cb[x]) for x in common)
        res = float(c) if kind == "overlap_count" else c / (len(a) + len(b) - c)
    elif kind == "max_count":
        res = float(sum(max(ca[x], cb[x]) for x in common))
    elif kind == "score_sum":
        res = 0.0
        for x in common:
            res += sb[x]
    elif kind in ("score_min", "score_max"):
        res = 0.0
        for k, x in enumerate(common):
            if k == 0 or (kind == "score_min" and sb[x] < res) or (kind == "score_max" and sb[x] > res):
                res = sb[x]
    elif kind == "cosine":
        dot = na2 = nb2 = 0.0
        for x in ca:
            na2 += sa[x] * sa[x]
            if x in cb:
                dot += sa[x] * sb[x]
        for x in cb:
            nb2 += sb[x] * sb[x]
        res = dot / (math.sqrt(na2) * math.sqrt(nb2)) if na2 != 0.0 and nb2 != 0.0 else 0.0
    else:
        raise ValueError(kind)
    return f32(res)


def sampling_u(seed: int, r: int) -> float:
    return (mix64(combine(seed, r)) >> 11) / 2.0**53


# -- a feature list, row by row -----------------------------------------------------------------
# A dense value is an int or float (None = null); a sparse value is a list of ids, and a
# scored one a list of (id, score) pairs.
def _apply(op: str, p: dict, v: Any, scored: bool, rows_b=None) -> tuple[Any, bool]:
    ids = (lambda row: [x for x, _ in row]) if scored else (lambda row: row)
    rebuild = (lambda row, new: [(n, s) for n, (_, s) in zip(new, row)]) if scored else (lambda row, new: new)
    is_list = isinstance(v, list)
    if op == "sigrid_hash":
        f = lambda x: sigrid_hash(x, p.get("salt", 0), p["max_value"])  # noqa: E731
    elif op == "positive_modulus":
        f = lambda x: positive_modulus(x, p["modulus"])  # noqa: E731
    elif op == "map_id":
        f = lambda x: map_id(x, p["mapping"], p.get("default", 0))  # noqa: E731
    elif op == "clamp":
        f = lambda x: clamp(x, p["min"], p["max"])  # noqa: E731
    elif op == "bucketize":
        if not is_list:
            b = bucketize(v, p["borders"])
            return ([b], False) if p.get("as_sparse") else (float(b), False)
        f = lambda x: bucketize(x, p["borders"])  # noqa: E731
    elif op == "firstx":
        return v[: p["x"]], scored
    elif op == "enumerate":
        return rebuild(v, enumerate_row(ids(v), p.get("start", 0))), scored
    elif op == "ngram":
        return ngram(ids(v), p["n"], p.get("max_value")), False
    elif op == "boxcox":
        return boxcox(v, p["lambda1"], p.get("lambda2", 0.0)), False
    elif op == "logit":
        return logit(v, p.get("eps", 1e-6)), False
    elif op == "onehot":
        return onehot(v, p["borders"]), False
    elif op == "get_local_hour":
        return local_hour(v, p["_offset"]), False
    elif op == "fill_null":  # dense nulls were filled when the column was read
        return v, scored
    else:
        raise ValueError(op)
    if is_list:
        return rebuild(v, [f(x) for x in ids(v)]), scored
    return f(v), False


def _pair(op: str, p: dict, a: list, b: list, a_scored: bool, b_scored: bool) -> tuple[Any, bool]:
    ai = [x for x, _ in a] if a_scored else a
    bi = [x for x, _ in b] if b_scored else b
    if op == "id_list_intersect":
        return [a[i] for i in intersect(ai, bi)], a_scored
    if op == "cartesian":
        return cartesian(ai, bi, p.get("max_value")), False
    if op == "compute_score":
        return compute_score(ai, bi, [s for _, s in a] if a_scored else None,
                             [s for _, s in b] if b_scored else None, p["kind"]), False
    raise ValueError(op)


def run_features(dense: list, sparse: list, schema: dict, table: dict, rows: int) -> tuple[list, list]:
    """(dense rows as lists of float32 values, sparse features as lists of rows).

    ``table[column]`` is a list of row values: None for null, a list for list columns.
    Sparse outputs are lists of ids, or of (id, score) pairs for scored features.
    """
    by_name = {f.name: f for f in [*dense, *sparse]}
    done: dict[str, tuple[list, bool]] = {}

    def compute(f) -> tuple[list, bool]:
        if f.name in done:
            return done[f.name]
        srcs = [f.column] if f.column is not None else list(f.inputs)
        first = f.transforms[0]["op"] if f.transforms else None
        ins = []
        for s in srcs:
            if f.column is None and s in by_name:
                ins.append(compute(by_name[s]))
                continue
            col = table[s]
            if schema[s] == "id_list":
                if f.scores is not None:
                    sc = table[f.scores]
                    vals = [list(zip(r or [], [f32(x) for x in (q or [])])) for r, q in zip(col, sc)]
                    ins.append((vals, True))
                else:
                    ins.append(([list(r) if r is not None else [] for r in col], False))
            else:
                fill = f.transforms[0]["value"] if first == "fill_null" else (0.0 if f.default is None else f.default)
                if schema[s] == "int" and whole(fill):
                    vals = [int(fill) if x is None else x for x in col]
                else:
                    vals = [float(fill) if x is None else float(x) for x in col]
                if schema[s] == "float":
                    vals = [None if x is None else float(x) for x in vals]
                ins.append((vals, False))
        out = []
        scored_out = False
        for r in range(rows):
            if len(ins) == 2:
                (a, sa), (b, sb) = ins
                v, scored = _pair(f.transforms[0]["op"], f.transforms[0], a[r], b[r], sa, sb)
                steps = f.transforms[1:]
            else:
                v, scored = ins[0][0][r], ins[0][1]
                steps = f.transforms
            for t in steps:
                p = dict(t)
                if t["op"] == "get_local_hour":
                    c = t.get("tz_offset_column")
                    p["_offset"] = (table[c][r] or 0) if c else t.get("tz_offset_seconds", 0)
                v, scored = _apply(t["op"], p, v, scored)
            out.append(v)
            scored_out = scored
        done[f.name] = (out, scored_out)
        return done[f.name]

    dense_rows = [[] for _ in range(rows)]
    for f in dense:
        vals, _ = compute(f)
        for r in range(rows):
            v = vals[r]
            dense_rows[r].extend(to_f32(x) for x in (v if isinstance(v, list) else [v]))
    sparse_out = [compute(f)[0] for f in sparse]
    return dense_rows, sparse_out


# -- converting between Python rows and columns (test helpers) ----------------------------------
def sparse_col(rows: list, dtype=np.int64):
    """A SparseColumn from a list of rows (None = null row, stored with length 0)."""
    from remoteloader.columns import SparseColumn

    lengths = [0 if r is None else len(r) for r in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths, dtype=np.int64)
    values = np.array([x for r in rows if r is not None for x in r], dtype=dtype)
    valid = None if all(r is not None for r in rows) else np.array([r is not None for r in rows])
    return SparseColumn(values, offsets, None, valid)


def dense_col(values: list, dtype):
    """A DenseColumn from a list of values (None = null, stored as 0)."""
    from remoteloader.columns import DenseColumn

    arr = np.array([0 if v is None else v for v in values], dtype=dtype)
    valid = None if all(v is not None for v in values) else np.array([v is not None for v in values])
    return DenseColumn(arr, valid)


def sparse_rows(col) -> list:
    """Rows of a SparseColumn as lists of ids, or of (id, score) pairs when it has weights."""
    v, o = col.values.tolist(), col.offsets.tolist()
    if col.weights is None:
        return [v[o[r]:o[r + 1]] for r in range(len(o) - 1)]
    w = [float(x) for x in col.weights]
    return [list(zip(v[o[r]:o[r + 1]], w[o[r]:o[r + 1]])) for r in range(len(o) - 1)]
