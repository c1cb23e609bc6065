"""Transform throughput on one core: every operator, then a DLRM-style pipeline.

    .venv/bin/python -m benchmarks.transforms [--rows 100000] [--repeat 5]

Each operator runs through the compiled pipeline (a one-feature spec, so the number
includes the pipeline's own overhead) on realistic lists (heavy-tailed lengths, mean 25)
and is timed against a plain vectorized numpy pass over the same data in the same run.
Throughput is output values per second (for ``id_list_intersect`` and ``compute_score``
also input ids per second, since they emit far fewer values than they read). Prints a
markdown table.
"""
from __future__ import annotations

import os

# One core, single-threaded kernels: set before numba is imported.
os.environ["NUMBA_NUM_THREADS"] = "1"
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402

from remoteloader.columns import DenseColumn, SparseColumn  # noqa: E402
from remoteloader.transforms import compile_features  # noqa: E402

U = np.uint64
C = U(0x9DDFEA08EB382D69)


# -- data -------------------------------------------------------------------------------------------------
def lists(rng: np.random.Generator, rows: int, mean: float = 25.0, vocab: int = 1 << 20) -> SparseColumn:
    """Heavy-tailed (log-normal, sigma 1) lengths with the given mean; Zipf-distributed ids."""
    sigma = 1.0
    mu = np.log(mean) - sigma**2 / 2
    lengths = np.minimum(np.rint(rng.lognormal(mu, sigma, rows)), 2000).astype(np.int64)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ranks = np.minimum(rng.zipf(1.1, offsets[-1]), vocab) - 1
    table = rng.integers(-(2**63), 2**63 - 1, size=vocab, dtype=np.int64)  # ids look like hashes
    return SparseColumn(table[ranks], offsets)


def dense(rng: np.random.Generator, rows: int, null_rate: float = 0.1) -> DenseColumn:
    v = rng.lognormal(2.0, 2.0, rows)
    valid = rng.random(rows) >= null_rate
    return DenseColumn(np.where(valid, v, 0.0), valid)


# -- numpy baselines (vectorized, no per-row Python) ----------------------------------------------------------
def np_mix64(k):
    k = ~k + (k << U(21))
    k = k ^ (k >> U(24))
    k = k + (k << U(3)) + (k << U(8))
    k = k ^ (k >> U(14))
    k = k + (k << U(2)) + (k << U(4))
    k = k ^ (k >> U(28))
    return k + (k << U(31))


def np_combine(u, l):
    a = (l ^ u) * C
    a = a ^ (a >> U(47))
    b = (u ^ a) * C
    b = b ^ (b >> U(47))
    return b * C


def np_sigrid(values, salt, m):
    return np_combine(U(salt), np_mix64(values.view(np.uint64))).view(np.int64) % m


def np_row_index(offsets):
    return np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))


def np_pos_in_row(offsets):
    return np.arange(offsets[-1]) - np.repeat(offsets[:-1], np.diff(offsets))


def np_firstx(col, x):
    keep = np_pos_in_row(col.offsets) < x
    return col.values[keep]


def np_bucketize(v, borders):
    i = np.searchsorted(borders, v, side="left")
    nxt = borders[np.minimum(i + 1, borders.shape[0] - 1)]
    return i + ((i < borders.shape[0] - 1) & (v >= nxt))


def np_map_id(v, keys, vals, default):
    order = np.argsort(keys)
    k, w = keys[order], vals[order]
    i = np.minimum(np.searchsorted(k, v), k.shape[0] - 1)
    return np.where(k[i] == v, w[i], default)


def np_ngram(col, n, m):
    pos, lengths = np_pos_in_row(col.offsets), np.diff(col.offsets)
    starts = np.flatnonzero(pos <= np.repeat(lengths, lengths) - n)
    x = col.values.view(np.uint64)
    h = x[starts]
    for j in range(1, n):
        h = np_combine(h, x[starts + j])
    return h.view(np.int64) % m


def np_cartesian(a, b, m):
    la, lb = np.diff(a.offsets), np.diff(b.offsets)
    n = la * lb
    out_off = np.zeros(n.shape[0] + 1, dtype=np.int64)
    np.cumsum(n, out=out_off[1:])
    row = np.repeat(np.arange(n.shape[0]), n)
    p = np.arange(out_off[-1]) - out_off[:-1][row]
    i, j = p // lb[row], p % lb[row]
    x = a.values.view(np.uint64)[a.offsets[:-1][row] + i]
    y = b.values.view(np.uint64)[b.offsets[:-1][row] + j]
    return np_combine(x, y).view(np.int64) % m


def np_row_keys(col):
    # (row, id) pairs as one 64-bit key: a hash, so a baseline only (collisions are negligible here).
    return np_combine(np_row_index(col.offsets).astype(np.uint64), col.values.view(np.uint64))


def np_intersect(a, b):
    return a.values[np.isin(np_row_keys(a), np_row_keys(b))]


def np_overlap_count(a, b):
    ka, ca = np.unique(np_row_keys(a), return_counts=True)
    kb, cb = np.unique(np_row_keys(b), return_counts=True)
    _, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    # Row of each common key: from the first element of a with that key.
    first = np.unique(np_row_keys(a), return_index=True)[1][ia]
    rows = np_row_index(a.offsets)[first]
    return np.bincount(rows, weights=np.minimum(ca[ia], cb[ib]), minlength=len(a))


# -- timing ----------------------------------------------------------------------------------------------------
def best(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: numba cache load / compile is not part of steady-state throughput
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    rows = args.rows
    a, b = lists(rng, rows), lists(rng, rows)
    b = SparseColumn(np.where(rng.random(b.values.shape[0]) < 0.5, a.values[rng.integers(0, a.values.shape[0],
                                                                                           b.values.shape[0])],
                              b.values), b.offsets)  # half of b's ids also occur in a's lists
    scores = SparseColumn(rng.random(a.values.shape[0]).astype(np.float32), a.offsets)
    scores_b = SparseColumn(rng.random(b.values.shape[0]).astype(np.float32), b.offsets)
    x = dense(rng, rows)
    ts = DenseColumn(rng.integers(1_600_000_000, 1_700_000_000, rows))
    short_a = SparseColumn(*_firstx_cols(a, 5))
    short_b = SparseColumn(*_firstx_cols(b, 5))
    cols = {"a": a, "b": b, "sa": scores, "sb": scores_b, "x": x, "ts": ts, "a5": short_a, "b5": short_b}
    schema = {"a": "id_list", "b": "id_list", "sa": "float_list", "sb": "float_list", "x": "float", "ts": "int",
              "a5": "id_list", "b5": "id_list"}
    borders = np.sort(rng.integers(-(2**62), 2**62, 64)).astype(np.float64)
    dense_borders = np.exp(np.linspace(-2, 8, 16))
    mapping_keys = np.unique(a.values)[:: 4][:100_000]
    mapping = {int(k): i for i, k in enumerate(mapping_keys.tolist())}
    xv = np.where(x.valid, x.values, 0.0)
    ids_a = a.values.shape[0]
    print(f"data: {rows} rows, list lengths mean {ids_a / rows:.1f} (max {np.diff(a.offsets).max()}), "
          f"{ids_a / 1e6:.2f} M ids per list column")

    cases = [
        # name, feature (kind, column|inputs, transforms, scores), numpy baseline, output count, input ids
        ("sigrid_hash", ("sparse", "a", [{"op": "sigrid_hash", "salt": 7, "max_value": 1 << 40}]),
         lambda: np_sigrid(a.values, 7, 1 << 40)),
        ("bucketize (64 borders)", ("sparse", "a", [{"op": "bucketize", "borders": borders.tolist()}]),
         lambda: np_bucketize(a.values.astype(np.float64), borders)),
        ("firstx (x=10)", ("sparse", "a", [{"op": "firstx", "x": 10}]), lambda: np_firstx(a, 10)),
        ("firstx scored (x=10)", ("sparse", "a", [{"op": "firstx", "x": 10}], "sa"),
         lambda: (np_firstx(a, 10), np_firstx(scores, 10))),
        ("clamp (sparse)", ("sparse", "a", [{"op": "clamp", "min": -(2**60), "max": 2**60}]),
         lambda: np.clip(a.values, -(2**60), 2**60)),
        ("map_id (100k keys)", ("sparse", "a", [{"op": "map_id", "mapping": mapping, "default": -1}]),
         lambda: np_map_id(a.values, mapping_keys, np.arange(mapping_keys.shape[0]), -1)),
        ("positive_modulus", ("sparse", "a", [{"op": "positive_modulus", "modulus": 1000003}]),
         lambda: np.mod(a.values, 1000003)),
        ("enumerate", ("sparse", "a", [{"op": "enumerate"}]), lambda: np_pos_in_row(a.offsets)),
        ("ngram (n=3)", ("sparse", "a", [{"op": "ngram", "n": 3, "max_value": 1 << 40}]),
         lambda: np_ngram(a, 3, 1 << 40)),
        ("cartesian (firstx 5 x 5)", ("sparse", ("a5", "b5"), [{"op": "cartesian", "max_value": 1 << 40}]),
         lambda: np_cartesian(short_a, short_b, 1 << 40)),
        ("id_list_intersect", ("sparse", ("a", "b"), [{"op": "id_list_intersect"}]), lambda: np_intersect(a, b)),
        ("compute_score overlap_count", ("dense", ("a", "b"), [{"op": "compute_score", "kind": "overlap_count"}]),
         lambda: np_overlap_count(a, b)),
        ("compute_score jaccard", ("dense", ("a", "b"), [{"op": "compute_score", "kind": "jaccard"}]), None),
        ("compute_score cosine (scored)", ("dense", ("A", "B"), [{"op": "compute_score", "kind": "cosine"}]), None),
        ("clamp (dense)", ("dense", "x", [{"op": "clamp", "min": 0, "max": 1000}]), lambda: np.clip(xv, 0, 1000)),
        ("boxcox (lambda1 0.25)", ("dense", "x", [{"op": "boxcox", "lambda1": 0.25, "lambda2": 1.0}]),
         lambda: ((np.maximum(xv + 1.0, 1e-6) ** 0.25 - 1) / 0.25).astype(np.float32)),
        ("logit", ("dense", "x", [{"op": "logit", "eps": 1e-6}]),
         lambda: np.log((p := np.clip(xv, 1e-6, 1 - 1e-6)) / (1 - p)).astype(np.float32)),
        ("bucketize (dense, 16)", ("dense", "x", [{"op": "bucketize", "borders": dense_borders.tolist()}]),
         lambda: np_bucketize(xv, dense_borders).astype(np.float32)),
        ("onehot (16 borders)", ("dense", "x", [{"op": "onehot", "borders": dense_borders.tolist()}]),
         lambda: _np_onehot(np_bucketize(xv, dense_borders), 17)),
        ("get_local_hour", ("dense", "ts", [{"op": "get_local_hour", "tz_offset_seconds": -18000}]),
         lambda: ((ts.values - 18000) // 3600) % 24),
        ("fill_null", ("dense", "x", [{"op": "fill_null", "value": -1.0}]), lambda: np.where(x.valid, x.values, -1.0)),
    ]

    print("\n| op | values out | ids in | compiled M out/s | compiled M ids in/s | numpy M out/s | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, feat, baseline in cases:
        kind, src, steps, *sc = feat
        f = _spec(name, kind, src, steps, sc[0] if sc else None)
        extra = []
        if src == ("A", "B"):
            extra = [_spec("A", "sparse", "a", [], "sa"), _spec("B", "sparse", "b", [], "sb")]
        dense_f = [f] if kind == "dense" else []
        sparse_f = ([f] if kind == "sparse" else []) + extra
        p = compile_features(dense_f, sparse_f, schema)
        out = p.run(cols)
        n_out = out.dense.size if kind == "dense" else out.sparse[0].values.shape[0]
        n_in = sum(cols[c].values.shape[0] for c in ({"A": "a", "B": "b"}.get(s, s) for s in
                                                      (src if isinstance(src, tuple) else (src,))))
        t = best(lambda: p.run(cols), args.repeat)
        tb = best(baseline, args.repeat) if baseline is not None else None
        nb = f"{n_out / tb / 1e6:.1f}" if tb else "n/a"
        sp = f"{tb / t:.1f}x" if tb else ""
        print(f"| {name} | {n_out:,} | {n_in:,} | {n_out / t / 1e6:.1f} | {n_in / t / 1e6:.1f} | {nb} | {sp} |")

    # -- a DLRM-style pipeline ----------------------------------------------------------------------------------
    dense_specs, sparse_specs, prows = _pipeline(rng, rows, cols, schema)
    p = compile_features(dense_specs, sparse_specs, schema)
    p.run(cols)
    t = best(lambda: p.run(cols), max(2, args.repeat // 2))
    tb = best(lambda: _np_pipeline(cols, dense_borders), max(2, args.repeat // 2))
    n_ids = sum(c.values.shape[0] for c in p.run(cols).sparse)
    print(f"\n| pipeline ({len(dense_specs)} dense, {len(sparse_specs)} sparse features) | rows/s | "
          f"M output ids/s |\n|---|---:|---:|")
    print(f"| compiled | {rows / t:,.0f} | {n_ids / t / 1e6:.1f} |")
    print(f"| plain numpy (same ops) | {rows / tb:,.0f} | {n_ids / tb / 1e6:.1f} |")
    print(f"\n(benchmark wall time {time.perf_counter() - t0:.0f} s; one core, NUMBA_NUM_THREADS=1)")


def _firstx_cols(col: SparseColumn, x: int):
    lengths = np.minimum(np.diff(col.offsets), x)
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return np_firstx(col, x), offsets


def _np_onehot(idx, width):
    out = np.zeros((idx.shape[0], width), dtype=np.float32)
    out[np.arange(idx.shape[0]), idx] = 1.0
    return out


def _spec(name, kind, src, steps, scores=None):
    from remoteloader.spec import FeatureSpec

    column, inputs = (None, tuple(src)) if isinstance(src, tuple) else (src, ())
    return FeatureSpec(name=name, kind=kind, column=column, inputs=inputs, scores=scores, transforms=tuple(steps))


def _pipeline(rng, rows, cols, schema):
    """13 dense + 26 sparse features on 8 list columns, plus four derived features."""
    for i in range(6):  # six more list columns (four already exist: a, b, a5, b5)
        cols[f"l{i}"] = lists(rng, rows, mean=25.0)
        schema[f"l{i}"] = "id_list"
    for i in range(12):
        cols[f"d{i}"] = dense(rng, rows)
        schema[f"d{i}"] = "float"
    dense_specs = []
    for i in range(12):
        steps = [{"op": "clamp", "min": 0, "max": 1e6}, {"op": "boxcox", "lambda1": 0.0, "lambda2": 1.0}]
        if i % 4 == 3:
            steps = [{"op": "logit"}]
        dense_specs.append(_spec(f"dense{i}", "dense", f"d{i}", steps))
    dense_specs.append(_spec("hour", "dense", "ts", [{"op": "get_local_hour", "tz_offset_seconds": 3600}]))
    list_cols = ["a", "b"] + [f"l{i}" for i in range(6)]
    sparse_specs = [_spec(f"sparse{i}", "sparse", list_cols[i % len(list_cols)],
                          [{"op": "firstx", "x": 50}, {"op": "sigrid_hash", "salt": i, "max_value": 1_000_000}])
                    for i in range(26)]
    sparse_specs += [_spec("common", "sparse", ("sparse0", "sparse1"), [{"op": "id_list_intersect"}]),
                     _spec("cross", "sparse", ("a5", "b5"), [{"op": "cartesian", "max_value": 1_000_000}]),
                     _spec("bigram", "sparse", "a", [{"op": "firstx", "x": 20}, {"op": "ngram", "n": 2,
                                                                                  "max_value": 1_000_000}])]
    dense_specs.append(_spec("overlap", "dense", ("sparse0", "sparse1"), [{"op": "compute_score", "kind": "jaccard"}]))
    return dense_specs, sparse_specs, rows


def _np_pipeline(cols, dense_borders):
    """The same pipeline with the numpy baselines (compute_score as overlap counting)."""
    list_cols = ["a", "b"] + [f"l{i}" for i in range(6)]
    out = []
    for i in range(12):
        c = cols[f"d{i}"]
        v = np.where(c.valid, c.values, 0.0)
        if i % 4 == 3:
            p = np.clip(v, 1e-6, 1 - 1e-6)
            out.append(np.log(p / (1 - p)).astype(np.float32))
        else:
            out.append(np.log(np.maximum(np.clip(v, 0, 1e6) + 1.0, 1e-6)).astype(np.float32))
    out.append((((cols["ts"].values + 3600) // 3600) % 24).astype(np.float32))
    sparse = []
    for i in range(26):
        c = cols[list_cols[i % len(list_cols)]]
        v, o = _firstx_cols(c, 50)
        sparse.append(SparseColumn(np_sigrid(v, i, 1_000_000), o))
    sparse.append(np_intersect(sparse[0], sparse[1]))
    sparse.append(np_cartesian(cols["a5"], cols["b5"], 1_000_000))
    v, o = _firstx_cols(cols["a"], 20)
    sparse.append(np_ngram(SparseColumn(v, o), 2, 1_000_000))
    out.append(np_overlap_count(sparse[0], sparse[1]).astype(np.float32))
    return np.stack(out, axis=1), sparse


if __name__ == "__main__":
    main()
