"""Synthetic recommendation tables shaped like production training data.

``generate_table`` writes a Hive-partitioned ORC or Parquet table with one column per
feature (flattened): ``row_id`` (unique, 0.. in canonical file order), ``label``
(float32 0/1, about 3% positive, learnable from a few features so a demo's loss falls),
``ts`` (UTC seconds within the partition's day), ``float_*`` dense features (counts,
ratios, amounts; up to 15% nulls) and ``idlist_*`` id-list features (coverage
0.05..0.85, mean 0.45; heavy-tailed lengths, mean about 25; Zipf-like ids from a
per-feature id space, hashed to large int64 values for most features), plus optionally
``idscore_*`` id lists with float32 ``idscore_*_scores`` of the same lengths.

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
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.orc as paorc
import pyarrow.parquet as pq
from tqdm import tqdm

from .formats.fs import child_name, open_filesystem, table_root

FIRST_DAY = _dt.datetime(2026, 1, 1, tzinfo=_dt.timezone.utc)
CHUNK_ROWS = 1 << 15  # rows per random stream; fixed so files never depend on writer settings
MAX_LIST_LENGTH = 1000
POSITIVE_RATE = 0.03
HOT_RANK = 20  # ids of popularity rank <= HOT_RANK count as "hot" for the label signal
# snappy: ORC encodes about 30% faster than with zstd; the data is synthetic anyway.
COMPRESSION = "snappy"
# ORC 0.11 (RLE v1 integers) writes 1.6x and reads 1.3x faster than 0.12 (RLE v2) here,
# and is the integer encoding of DWRF, the ORC dialect of DPP's production tables.
ORC_FILE_VERSION = "0.11"
_SUFFIX = {"orc": ".orc", "parquet": ".parquet"}
_DENSE_KINDS = ("count", "ratio", "amount")


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
           ts: np.ndarray) -> pa.Table:
    """One chunk of rows; ``ts`` gives its timestamps (their count is the chunk's size)."""
    n = len(ts)

    def rng(column: int) -> np.random.Generator:
        return np.random.default_rng([seed, file_index, chunk_index, column])

    columns: dict[str, pa.Array] = {}
    dense_signal, hot = [], []
    for i, d in enumerate(plan.dense):
        r = rng(3 + i)
        values = d.sample(r, n)
        valid = r.random(n) < d.coverage
        values[~valid] = 0
        columns[d.name] = pa.array(values.astype(np.float32), mask=~valid)
        dense_signal.append((values, valid))
    for i, s in enumerate(plan.sparse):
        r = rng(3 + len(plan.dense) + i)
        valid, offsets, ranks = s.sample(r, n)
        mask = pa.array(~valid)
        columns[s.name] = pa.ListArray.from_arrays(offsets, s.ids(ranks), mask=mask)
        if s.scores:
            scores = r.random(len(ranks), dtype=np.float32)
            columns[s.scores] = pa.ListArray.from_arrays(offsets, scores, mask=mask)
        if i < 2:
            hot.append(_hot_rows(valid, offsets, ranks))
    signal = _signal(plan, n, dense_signal[:3], hot)
    label = (rng(1).random(n) < _sigmoid(plan.label_bias + signal)).astype(np.float32)
    head = {
        "row_id": pa.array(np.arange(first_row_id, first_row_id + n, dtype=np.int64)),
        "label": pa.array(label),
        "ts": pa.array(ts),
    }
    return pa.Table.from_pydict({**head, **columns}, schema=plan.schema())


class _ParquetSink:
    """Writes row groups of exactly ``row_group_rows`` rows (pyarrow starts a new row
    group at every write call, so chunks are gathered until a group is full)."""

    def __init__(self, sink: pa.NativeFile, schema: pa.Schema, row_group_rows: int):
        self._writer = pq.ParquetWriter(sink, schema, compression=COMPRESSION)
        self._group = row_group_rows
        self._pending: list[pa.Table] = []
        self._rows = 0

    def write(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._rows += table.num_rows
        if self._rows >= self._group:
            pending = pa.concat_tables(self._pending)
            full = self._rows - self._rows % self._group
            self._writer.write_table(pending.slice(0, full), row_group_size=self._group)
            rest = pending.slice(full)
            self._pending, self._rows = ([rest] if rest.num_rows else []), rest.num_rows

    def close(self) -> None:
        if self._pending:
            self._writer.write_table(pa.concat_tables(self._pending), row_group_size=self._group)
        self._writer.close()


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


def _orc_batch_rows(plan: _Plan, stripe_size: int) -> int:
    """The ORC writer checks the stripe size once per batch of rows: batches of about a
    quarter of a stripe honour small stripe sizes, and large stripes keep the default 1024."""
    return int(np.clip(stripe_size / 4 / plan.row_bytes(), 64, 1024))


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
        return _chunk(job.plan, job.seed, job.file_index, index, job.first_row_id + start, ts)

    chunks = -(-job.rows // CHUNK_ROWS)
    with fs.open_output_stream(path) as sink, ThreadPoolExecutor(1) as generator:
        writer = (paorc.ORCWriter(sink, file_version=ORC_FILE_VERSION, stripe_size=job.stripe_size,
                                    batch_size=_orc_batch_rows(job.plan, job.stripe_size), compression=COMPRESSION)
                  if job.format == "orc" else _ParquetSink(sink, job.plan.schema(), job.row_group_rows))
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
                   progress: bool = True) -> list[str]:
    """Write the table under ``out`` (local path or pyarrow filesystem URI) as
    ``out/ds=2026-01-01/part-00000.orc`` ...; return the files' names in canonical order."""
    if format not in _SUFFIX:
        raise ValueError(f"format must be orc or parquet, not {format!r}")
    for name, value in (("partitions", partitions), ("files_per_partition", files_per_partition),
                        ("stripe_size", stripe_size), ("row_group_rows", row_group_rows)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    if min(dense, sparse, scored) < 0:
        raise ValueError("dense, sparse and scored must not be negative")
    if rows < partitions * files_per_partition:
        raise ValueError(f"rows ({rows}) must be at least partitions x files_per_partition "
                         f"({partitions * files_per_partition}): every file gets rows")
    plan = _plan(seed, dense, sparse, scored)
    jobs, row_id = [], 0
    for p, partition_rows in enumerate(_rows_per(rows, partitions)):
        day = FIRST_DAY + _dt.timedelta(days=p)
        position = 0
        for f, file_rows in enumerate(_rows_per(partition_rows, files_per_partition)):
            relative = f"ds={day.date().isoformat()}/part-{f:05d}{_SUFFIX[format]}"
            jobs.append(_FileJob(out, relative, len(jobs), file_rows, row_id, int(day.timestamp()), partition_rows,
                                 position, format, stripe_size, row_group_rows, seed, plan))
            row_id += file_rows
            position += file_rows
    fs, root = open_filesystem(out)
    _check_no_stale_files(fs, root, [j.relative for j in jobs], out)
    with tqdm(total=rows, unit="rows", unit_scale=True, desc="gen-data", file=sys.stderr, disable=not progress) as bar:
        for job in jobs:
            _write_file(job, bar.update)
    name = table_root(out)
    return [child_name(name, j.relative) for j in jobs]


def _check_no_stale_files(fs: pafs.FileSystem, root: str, relatives: list[str], out: str) -> None:
    """Refuse to mix a new table with files it would not overwrite: readers would take
    them as part of the table."""
    if fs.get_file_info(root).type == pafs.FileType.NotFound:
        return
    prefix = root.rstrip("/") + "/"
    ours = set(relatives)
    stale = [
        info.path[len(prefix):] for info in fs.get_file_info(pafs.FileSelector(root, recursive=True))
        if info.type == pafs.FileType.File and info.path[len(prefix):] not in ours
    ]
    if stale:
        raise ValueError(f"{out} already holds files this table would not replace (e.g. {sorted(stale)[0]}): "
                         "remove them or pick another directory")
