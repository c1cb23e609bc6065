"""Synthetic recommendation tables shaped like production training data.

``generate_table`` writes a Hive-partitioned ORC or Parquet table with one column per
feature (flattened): ``row_id`` (unique, 0.. in canonical file order), ``label``
(float32 0/1, about 3% positive, learnable from a few features so a demo's loss falls),
``ts`` (UTC seconds within the partition's day), ``float_*`` dense features (counts,
ratios, amounts; up to 15% nulls) and ``idlist_*`` id-list features (coverage
0.05..0.85, mean 0.45; heavy-tailed lengths, mean about 25; Zipf-like ids from a
per-feature id space, hashed to large int64 values for most features), plus optionally
``idscore_*`` id lists with float32 ``idscore_*_scores`` of the same lengths.

``layout="map"`` writes the same features unflattened, as production tables keep them:
``float_features map<int32, float>``, ``id_list_features map<int32, list<int64>>`` and
``id_score_list_features map<int32, map<int64, float>>`` (id -> score), next to plain
``row_id``, ``label``, ``ts``. Feature ``float_i`` / ``idlist_i`` / ``idscore_i`` is key
``map_key(i) = 100 + 7 * i`` of its map (spread out, as production feature ids are), a
null feature is an absent key, and the values are those of the flat layout with the same
seed. ``column_order`` permutes the written columns (popular features first, see
``remoteloader.storage.reorder``); it never changes the rows.

Everything is vectorized numpy turned into Arrow arrays from offsets and values. Rows are
generated in fixed-size chunks, each column of each chunk from its own random stream
keyed by (seed, file, chunk, column), so the content depends only on the arguments and
memory stays bounded by a chunk plus the writer's stripe / row group.
"""
from __future__ import annotations

import datetime as _dt
import posixpath
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from ..formats.fs import child_name, open_filesystem, table_root
from ..formats.writer import SUFFIX, TableWriter, check_no_stale_files

FIRST_DAY = _dt.datetime(2026, 1, 1, tzinfo=_dt.timezone.utc)
CHUNK_ROWS = 1 << 15  # rows per random stream; fixed so files never depend on writer settings
MAX_LIST_LENGTH = 1000
POSITIVE_RATE = 0.03
HOT_RANK = 20  # ids of popularity rank <= HOT_RANK count as "hot" for the label signal
_DENSE_KINDS = ("count", "ratio", "amount")
LAYOUTS = ("flat", "map")


def map_key(index: int) -> int:
    """The map key of feature ``index`` (``float_i``, ``idlist_i``, ``idscore_i``) in the map layout."""
    return 100 + 7 * index


@dataclass(frozen=True)
class _Dense:
    name: str
    kind: str  # "count" (heavy-tailed integers), "ratio" (in [0, 1]), "amount" (positive real)
    coverage: float
    a: float  # count: log-mean; ratio: beta alpha; amount: gamma shape
    b: float  # count: log-sd;   ratio: beta beta;  amount: gamma scale

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "count":
            return np.floor(rng.lognormal(self.a, self.b, n))
        if self.kind == "ratio":
            return rng.beta(self.a, self.b, n)
        return rng.gamma(self.a, self.b, n)

    def standardized(self, values: np.ndarray) -> np.ndarray:
        """Roughly zero-mean, unit-variance version of the values (label signal)."""
        if self.kind == "count":
            return (np.log1p(values) - self.a) / self.b
        if self.kind == "ratio":
            mean = self.a / (self.a + self.b)
            sd = np.sqrt(self.a * self.b / ((self.a + self.b) ** 2 * (self.a + self.b + 1)))
            return (values - mean) / sd
        return (values - self.a * self.b) / (np.sqrt(self.a) * self.b)


@dataclass(frozen=True)
class _Sparse:
    name: str
    coverage: float
    log_mean: float  # lognormal parameters of the list length
    log_sd: float
    cardinality: int  # id space: popularity ranks 1..cardinality
    exponent: float  # Zipf exponent of the rank distribution
    multiplier: int  # odd: id = rank * multiplier mod 2**63 (a bijection); 0: id = rank
    scores: Optional[str]  # name of the parallel score column, if any

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(valid, int32 offsets, popularity ranks) for n rows."""
        valid = rng.random(n) < self.coverage
        lengths = np.ceil(rng.lognormal(self.log_mean, self.log_sd, n))
        np.minimum(lengths, MAX_LIST_LENGTH, out=lengths)
        lengths[~valid] = 0
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths.astype(np.int32), out=offsets[1:])
        # Bounded Zipf: invert the continuous power-law CDF on [1, cardinality + 1), in
        # float32 (4x faster than float64; the far tail of big id spaces gets coarser).
        u = rng.random(int(offsets[-1]), dtype=np.float32)
        if abs(self.exponent - 1) < 1e-6:
            u *= np.float32(np.log(self.cardinality + 1.0))
        else:
            e = 1.0 - self.exponent
            u *= np.float32((self.cardinality + 1.0) ** e - 1)
            u += np.float32(1)
            np.log(u, out=u)  # log(1 + x), not log1p: numpy vectorizes float32 log only
            u *= np.float32(1 / e)
        x = np.exp(u, out=u)
        ranks = x.astype(np.int64)
        np.clip(ranks, 1, self.cardinality, out=ranks)
        return valid, offsets, ranks

    def ids(self, ranks: np.ndarray) -> np.ndarray:
        if not self.multiplier:
            return ranks
        hashed = ranks.view(np.uint64) * np.uint64(self.multiplier)
        hashed &= np.uint64((1 << 63) - 1)
        return hashed.view(np.int64)


@dataclass(frozen=True)
class _Plan:
    dense: tuple[_Dense, ...]
    sparse: tuple[_Sparse, ...]
    label_bias: float

    def row_bytes(self) -> float:
        """Expected uncompressed bytes per row."""
        total = 3 * 8 + 4 * len(self.dense)
        for s in self.sparse:
            ids = s.coverage * (np.exp(s.log_mean + s.log_sd**2 / 2) + 0.5)
            total += ids * (12 if s.scores else 8)
        return total

    def schema(self) -> pa.Schema:
        fields = [("row_id", pa.int64()), ("label", pa.float32()), ("ts", pa.int64())]
        fields += [(d.name, pa.float32()) for d in self.dense]
        for s in self.sparse:
            fields.append((s.name, pa.list_(pa.int64())))
            if s.scores:
                fields.append((s.scores, pa.list_(pa.float32())))
        return pa.schema(fields)

    def map_schema(self) -> pa.Schema:
        return pa.schema([("row_id", pa.int64()), ("label", pa.float32()), ("ts", pa.int64()),
                          ("float_features", pa.map_(pa.int32(), pa.float32())),
                          ("id_list_features", pa.map_(pa.int32(), pa.list_(pa.int64()))),
                          ("id_score_list_features", pa.map_(pa.int32(), pa.map_(pa.int64(), pa.float32())))])

    def layout_schema(self, layout: str, column_order: Optional[Sequence[str]]) -> pa.Schema:
        """The written schema: the layout's columns, those in ``column_order`` first."""
        schema = self.schema() if layout == "flat" else self.map_schema()
        if not column_order:
            return schema
        unknown = [c for c in column_order if c not in schema.names]
        if unknown:
            raise ValueError(f"column_order names columns the {layout} layout does not have: {unknown[:5]}")
        first = list(dict.fromkeys(column_order))
        return pa.schema([schema.field(c) for c in first + [c for c in schema.names if c not in first]])


def _plan(seed: int, dense: int, sparse: int, scored: int) -> _Plan:
    """Per-feature distributions, drawn once from the seed."""
    rng = np.random.default_rng([seed, 1 << 20])
    dense_features = []
    for i in range(dense):
        kind = _DENSE_KINDS[i % len(_DENSE_KINDS)]
        a, b = {
            "count": (rng.uniform(0.5, 4.0), rng.uniform(0.8, 1.8)),
            "ratio": (rng.uniform(0.5, 2.0), rng.uniform(2.0, 30.0)),
            "amount": (rng.uniform(1.0, 5.0), rng.uniform(1.0, 100.0)),
        }[kind]
        dense_features.append(_Dense(f"float_{i}", kind, float(rng.uniform(0.85, 1.0)), float(a), float(b)))
    n = sparse + scored
    # Stratified coverages average 0.45 even over a handful of features.
    coverage = 0.05 + 0.8 * (rng.permutation(n) + rng.random(n)) / max(n, 1)
    weights = rng.lognormal(0.0, 0.6, n)
    mean_length = np.clip(25.0 * weights / weights.mean(), 1.5, 200.0) if n else weights
    sparse_features = []
    for i in range(n):
        log_sd = float(rng.uniform(0.6, 1.1))
        # ceil() adds about half an id to the lognormal mean.
        log_mean = float(np.log(mean_length[i] - 0.5) - log_sd**2 / 2)
        multiplier = int(rng.integers(1 << 40, 1 << 62)) | 1 if rng.random() < 0.7 else 0
        cardinality = int(10 ** rng.uniform(3, 8))
        exponent = float(rng.uniform(0.8, 1.3))
        name, scores = (f"idlist_{i}", None) if i < sparse else (f"idscore_{i - sparse}", f"idscore_{i - sparse}_scores")
        sparse_features.append(_Sparse(name, float(coverage[i]), log_mean, log_sd, cardinality, exponent, multiplier, scores))
    plan = _Plan(tuple(dense_features), tuple(sparse_features), 0.0)
    # Calibrate the label bias on a pilot sample so that about POSITIVE_RATE rows are positive.
    signal = _label_signal(plan, np.random.default_rng([seed, 1 << 21]), 1 << 16)
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _sigmoid(mid + signal).mean() < POSITIVE_RATE else (lo, mid)
    return _Plan(plan.dense, plan.sparse, (lo + hi) / 2)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _label_signal(plan: _Plan, rng: np.random.Generator, n: int) -> np.ndarray:
    """The pilot: the label signal of n rows sampled like the table's."""
    dense = [(d.sample(rng, n), rng.random(n) < d.coverage) for d in plan.dense[:3]]
    hot = [_hot_rows(*s.sample(rng, n)) for s in plan.sparse[:2]]
    return _signal(plan, n, dense, hot)


def _hot_rows(valid: np.ndarray, offsets: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Rows whose list holds at least one hot id."""
    rows = np.repeat(np.arange(len(valid)), np.diff(offsets))
    return np.bincount(rows[ranks <= HOT_RANK], minlength=len(valid)) > 0


def _signal(plan: _Plan, n: int, dense: list[tuple[np.ndarray, np.ndarray]], hot: list[np.ndarray]) -> np.ndarray:
    """A logit contribution from the first dense and sparse features, so a model can learn."""
    signal = np.zeros(n)
    for d, (values, valid) in zip(plan.dense, dense):
        signal += 0.6 * np.where(valid, np.clip(d.standardized(values), -4, 4), 0.0)
    for h in hot:
        signal += 1.2 * h
    return signal


def _rows_per(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def _chunk(plan: _Plan, seed: int, file_index: int, chunk_index: int, first_row_id: int,
           ts: np.ndarray, layout: str, schema: pa.Schema) -> pa.Table:
    """One chunk of rows; ``ts`` gives its timestamps (their count is the chunk's size)."""
    n = len(ts)

    def rng(column: int) -> np.random.Generator:
        return np.random.default_rng([seed, file_index, chunk_index, column])

    dense, sparse, hot = [], [], []
    for i, d in enumerate(plan.dense):
        r = rng(3 + i)
        values = d.sample(r, n)
        valid = r.random(n) < d.coverage
        values[~valid] = 0
        dense.append((values, valid))
    for i, s in enumerate(plan.sparse):
        r = rng(3 + len(plan.dense) + i)
        valid, offsets, ranks = s.sample(r, n)
        scores = r.random(len(ranks), dtype=np.float32) if s.scores else None
        sparse.append((valid, offsets, s.ids(ranks), scores))
        if i < 2:
            hot.append(_hot_rows(valid, offsets, ranks))
    signal = _signal(plan, n, dense[:3], hot)
    label = (rng(1).random(n) < _sigmoid(plan.label_bias + signal)).astype(np.float32)
    columns = {
        "row_id": pa.array(np.arange(first_row_id, first_row_id + n, dtype=np.int64)),
        "label": pa.array(label),
        "ts": pa.array(ts),
    }
    columns.update(_flat_columns(plan, dense, sparse) if layout == "flat" else _map_columns(dense, sparse, n))
    return pa.Table.from_arrays([columns[name] for name in schema.names], schema=schema)


_DenseData = tuple[np.ndarray, np.ndarray]  # values, valid
_SparseData = tuple[np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray]]  # valid, offsets, ids, scores


def _flat_columns(plan: _Plan, dense: list[_DenseData], sparse: list[_SparseData]) -> dict[str, pa.Array]:
    columns = {}
    for d, (values, valid) in zip(plan.dense, dense):
        columns[d.name] = pa.array(values.astype(np.float32), mask=~valid)
    for s, (valid, offsets, ids, scores) in zip(plan.sparse, sparse):
        mask = pa.array(~valid)
        columns[s.name] = pa.ListArray.from_arrays(offsets, ids, mask=mask)
        if scores is not None:
            columns[s.scores] = pa.ListArray.from_arrays(offsets, scores, mask=mask)
    return columns


def _map_columns(dense: list[_DenseData], sparse: list[_SparseData], n: int) -> dict[str, pa.Array]:
    """The three feature maps; a row's entries are in feature order, a null feature has none."""
    valid = np.stack([v for _, v in dense], axis=1) if dense else np.zeros((n, 0), bool)
    rows, features = np.nonzero(valid)  # row-major: each row's entries together
    values = np.stack([d for d, _ in dense], axis=1)[rows, features] if dense else np.zeros(0)
    return {
        "float_features": pa.MapArray.from_arrays(_row_offsets(valid), _keys(features), values.astype(np.float32)),
        "id_list_features": _list_map([s for s in sparse if s[3] is None], n, scored=False),
        "id_score_list_features": _list_map([s for s in sparse if s[3] is not None], n, scored=True),
    }


def _row_offsets(valid: np.ndarray) -> np.ndarray:
    offsets = np.zeros(valid.shape[0] + 1, dtype=np.int32)
    np.cumsum(valid.sum(axis=1), out=offsets[1:])
    return offsets


def _keys(features: np.ndarray) -> np.ndarray:
    return map_key(features).astype(np.int32)


def _list_map(features: list[_SparseData], n: int, scored: bool) -> pa.Array:
    """map<key, list<id>> (scored: map<key, map<id, score>>) from per-feature id lists:
    entry (row, feature) holds that feature's list of that row, gathered in one pass."""
    if not features:
        items = pa.array([], pa.map_(pa.int64(), pa.float32()) if scored else pa.list_(pa.int64()))
        return pa.MapArray.from_arrays(np.zeros(n + 1, np.int32), pa.array([], pa.int32()), items)
    valid = np.stack([f[0] for f in features], axis=1)
    rows, columns = np.nonzero(valid)
    base = np.cumsum([0] + [len(f[2]) for f in features])[:-1]
    starts = np.stack([f[1][:-1] for f in features], axis=1)[rows, columns] + base[columns]
    lengths = np.stack([np.diff(f[1]) for f in features], axis=1)[rows, columns]
    item_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=item_offsets[1:])
    if item_offsets[-1] >= 1 << 31:
        raise ValueError("a generation chunk holds 2**31 ids or more: lower CHUNK_ROWS")
    # Source index of every id: its entry's start plus its place in the entry.
    gather = np.repeat(starts - item_offsets[:-1], lengths) + np.arange(item_offsets[-1], dtype=np.int64)
    ids = np.concatenate([f[2] for f in features])[gather]
    item_offsets = item_offsets.astype(np.int32)
    if scored:
        items = pa.MapArray.from_arrays(item_offsets, ids, np.concatenate([f[3] for f in features])[gather])
    else:
        items = pa.ListArray.from_arrays(item_offsets, ids)
    return pa.MapArray.from_arrays(_row_offsets(valid), _keys(columns), items)


@dataclass(frozen=True)
class _FileJob:
    """Where one file goes and which rows it holds."""

    out: str
    relative: str  # path under out
    file_index: int
    rows: int
    first_row_id: int
    day_start: int  # UTC seconds
    partition_rows: int
    partition_position: int  # rows of the partition before this file
    format: str
    stripe_size: int
    row_group_rows: int
    seed: int
    plan: _Plan
    layout: str
    schema: pa.Schema
    stripe_rows: Optional[int]


def _write_file(job: _FileJob, report: Callable[[int], object]) -> None:
    """Write one file; the next chunk is generated in a helper thread while the writer
    encodes the current one (numpy and the Arrow writers both release the GIL)."""
    fs, root = open_filesystem(job.out)
    path = posixpath.join(root, job.relative)
    fs.create_dir(posixpath.dirname(path), recursive=True)

    def chunk(index: int) -> pa.Table:
        start = index * CHUNK_ROWS
        n = min(CHUNK_ROWS, job.rows - start)
        # Time advances through the day with the rows, as in an event log.
        position = np.arange(job.partition_position + start, job.partition_position + start + n, dtype=np.int64)
        ts = job.day_start + position * 86400 // job.partition_rows
        return _chunk(job.plan, job.seed, job.file_index, index, job.first_row_id + start, ts, job.layout, job.schema)

    chunks = -(-job.rows // CHUNK_ROWS)
    with fs.open_output_stream(path) as sink, ThreadPoolExecutor(1) as generator:
        writer = (TableWriter(sink, "orc", job.schema, stripe_size=job.stripe_size, row_bytes=job.plan.row_bytes())
                  if job.format == "orc" and not job.stripe_rows else
                  TableWriter(sink, job.format, job.schema, unit_rows=job.stripe_rows or job.row_group_rows))
        upcoming = generator.submit(chunk, 0)
        for index in range(chunks):
            table = upcoming.result()
            if index + 1 < chunks:
                upcoming = generator.submit(chunk, index + 1)
            writer.write(table)
            report(table.num_rows)
        writer.close()


def generate_table(out: str, rows: int, partitions: int = 1, dense: int = 13, sparse: int = 26,
                   format: str = "orc", seed: int = 0, stripe_size: int = 64 << 20,
                   row_group_rows: int = 128 * 1024, files_per_partition: int = 1, scored: int = 0,
                   progress: bool = True, layout: str = "flat",
                   column_order: Optional[Sequence[str]] = None, stripe_rows: Optional[int] = None,
                   first_row_id: int = 0) -> list[str]:
    """Write the table under ``out`` (local path or pyarrow filesystem URI) as
    ``out/ds=2026-01-01/part-00000.orc`` ...; return the files' names in canonical order.

    ``layout``: "flat" (one column per feature) or "map" (features in three map columns).
    ``column_order``: columns to write first, in this order (the others follow in the
    layout's order). ``stripe_size`` (ORC, bytes, as estimated by the ORC writer) and
    ``row_group_rows`` (Parquet) size the read units; ``stripe_rows`` gives every unit
    (either format) exactly that many rows instead. See docs/storage.md for how large."""
    if format not in SUFFIX:
        raise ValueError(f"format must be orc or parquet, not {format!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be flat or map, not {layout!r}")
    for name, value in (("partitions", partitions), ("files_per_partition", files_per_partition),
                        ("stripe_size", stripe_size), ("row_group_rows", row_group_rows), ("stripe_rows", stripe_rows or 1)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    if min(dense, sparse, scored) < 0:
        raise ValueError("dense, sparse and scored must not be negative")
    if rows < partitions * files_per_partition:
        raise ValueError(f"rows ({rows}) must be at least partitions x files_per_partition "
                         f"({partitions * files_per_partition}): every file gets rows")
    plan = _plan(seed, dense, sparse, scored)
    schema = plan.layout_schema(layout, column_order)
    jobs, row_id = [], first_row_id
    for p, partition_rows in enumerate(_rows_per(rows, partitions)):
        day = FIRST_DAY + _dt.timedelta(days=p)
        position = 0
        for f, file_rows in enumerate(_rows_per(partition_rows, files_per_partition)):
            relative = f"ds={day.date().isoformat()}/part-{f:05d}{SUFFIX[format]}"
            jobs.append(_FileJob(out, relative, len(jobs), file_rows, row_id, int(day.timestamp()), partition_rows,
                                 position, format, stripe_size, row_group_rows, seed, plan, layout, schema, stripe_rows))
            row_id += file_rows
            position += file_rows
    fs, root = open_filesystem(out)
    check_no_stale_files(fs, root, [j.relative for j in jobs], out)
    with tqdm(total=rows, unit="rows", unit_scale=True, desc="gen-data", file=sys.stderr, disable=not progress) as bar:
        for job in jobs:
            _write_file(job, bar.update)
    name = table_root(out)
    return [child_name(name, j.relative) for j in jobs]
