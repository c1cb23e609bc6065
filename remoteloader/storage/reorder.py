"""Feature reordering: store the features that jobs read together next to each other.

The master appends every submitted job's projection to a popularity log (see
``core.popularity``); ``load_popularity`` counts, per column, the jobs that read it
(optionally over a recent window); ``column_order`` turns the counts into a column order (most popular first);
``reorder_table`` rewrites a table in that order, and ``generate_table(column_order=)``
writes one directly. Coalesced reads of a popular projection then fetch one dense run of
streams per stripe instead of a run full of unselected columns.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence

import pyarrow as pa

from ..formats import DataFile, TableError, list_table, read_schema, table_schema
from ..formats.maps import flat_name
from .rewrite import progress_bar, source_units, targets, unit_rows, verified, write_file

HEAD = ("row_id", "label", "ts")  # kept first: every job reads them


def column_order(schema_columns: Sequence[str], popularity: Mapping[str, int]) -> list[str]:
    """The schema's columns ordered for storage: row_id, label, ts first, then by
    popularity, most read first, ties (and unread columns) in schema order, so columns
    read by the same jobs (equal counts) stay adjacent. A job's virtual names (``X[K]``,
    ``X[K].ids``) count for the flattened columns (``X_K``, ``X_K_ids``)."""
    counts: Counter[str] = Counter()
    for name, n in popularity.items():
        counts[flat_name(name)] += n
    head = [c for c in HEAD if c in schema_columns]
    rest = [c for c in schema_columns if c not in head]
    position = {c: i for i, c in enumerate(rest)}
    return head + sorted(rest, key=lambda c: (-counts.get(c, 0), position[c]))


@dataclass
class ReorderReport:
    files: int = 0
    rows: int = 0
    columns: int = 0
    units_in: int = 0
    units_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    verified: bool = False
    seconds: float = 0.0

    def __str__(self) -> str:
        check = "verified: every value equal" if self.verified else "not verified"
        return (f"reordered {self.files} files, {self.rows} rows, {self.columns} columns "
                f"({self.units_in} -> {self.units_out} units, {self.bytes_in / 1e6:.1f} MB -> "
                f"{self.bytes_out / 1e6:.1f} MB); {check}; {self.seconds:.1f} s")


def reorder_table(src: str, dst: str, order: Sequence[str], *, stripe_size: Optional[int] = None,
                  stripe_rows: Optional[int] = None, progress: bool = True, format: Optional[str] = None,
                  verify: bool = True) -> ReorderReport:
    """Rewrite table ``src`` into ``dst`` with the columns in ``order`` (columns it leaves
    out follow in schema order). Units: ``stripe_rows`` rows, or about ``stripe_size``
    bytes, or (default) the source's. Only the layout changes: with ``verify``, every
    output file is read back and compared with its source, value by value."""
    start = time.perf_counter()
    files = list_table(src)
    schema = list(table_schema(files))
    unknown = [c for c in order if c not in schema]
    if unknown:
        raise TableError(f"table {src} has no column {unknown[0]!r}" + (f" (nor {unknown[1:6]})" if unknown[1:] else ""))
    columns = list(dict.fromkeys(order)) + [c for c in schema if c not in order]
    fs, jobs = targets(src, dst, files, format)
    rows = sum(f.num_rows for f in files)
    report = ReorderReport(len(files), rows, len(columns), sum(len(f.units) for f in files),
                           bytes_in=sum(f.nbytes for f in files), verified=verify)
    arrow_schema = None
    with progress_bar(rows * (2 if verify else 1), "reorder" + (" + verify" if verify else ""), progress) as bar:
        for job in jobs:
            # ORC answers a projection in file order: select() puts the columns in ours.
            tables = (table.select(columns) for _, table in source_units(job.source, columns))
            first = next(tables)
            arrow_schema = arrow_schema or first.schema
            written = write_file(fs, job, arrow_schema, _chain(first, tables),
                                 unit_rows(job.source, stripe_size, stripe_rows), bar.update)
            report.units_out += len(written.units)
            report.bytes_out += written.nbytes
            if verify:
                verified(fs, job, lambda: _verify(job.source, written, columns, bar.update))
    report.seconds = time.perf_counter() - start
    return report


def _chain(first: pa.Table, rest: Iterator[pa.Table]) -> Iterator[pa.Table]:
    yield first
    yield from rest


def _verify(source: DataFile, written: DataFile, columns: list[str], done: Callable[[int], object]) -> None:
    """Compare the two files row range by row range (their units may differ)."""
    if written.num_rows != source.num_rows:
        raise TableError(f"{written.path}: {written.num_rows} rows, its source {source.path} has {source.num_rows}")
    if list(read_schema(written)) != columns:
        raise TableError(f"{written.path}: columns are not in the order asked")
    ours = (t.select(columns) for _, t in source_units(written, columns))
    theirs = (t.select(columns) for _, t in source_units(source, columns))
    a = b = None
    while True:
        a = a if a is not None and a.num_rows else next(theirs, None)
        b = b if b is not None and b.num_rows else next(ours, None)
        if a is None or b is None:
            return
        n = min(a.num_rows, b.num_rows)
        if not a.slice(0, n).equals(b.slice(0, n)):
            raise TableError(f"{written.path}: values differ from its source {source.path}")
        done(n)
        a, b = a.slice(n), b.slice(n)
