"""The shared driver of table rewrites (flatten, reorder): file by file, unit by unit, so
memory holds one source stripe / row group and the writer's current unit; the output
mirrors the source's partitions and file names.

Every output unit is encoded once and written once (``UnitWriter``): ORC units go through
``orc_stripes.OrcStripeWriter`` (one stripe each, encoded in small batches: time linear
in the rows), Parquet units are one row group each. Progress advances per unit written."""
from __future__ import annotations

import posixpath
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.fs as pafs
from tqdm import tqdm

from ..formats import DataFile, TableError, list_table
from ..formats.fs import child_name, open_filesystem, relative_name, table_root
from ..formats.split import read_units
from ..formats.writer import SUFFIX, TableWriter, check_no_stale_files
from .orc_stripes import OrcStripeWriter


@dataclass(frozen=True)
class Target:
    source: DataFile
    name: str  # reopenable name of the output file
    path: str  # its path in the output filesystem
    format: str


def targets(src: str, dst: str, files: Sequence[DataFile], format: Optional[str]) -> tuple[pafs.FileSystem, list[Target]]:
    """Where each source file goes under ``dst`` (same partition and name; the suffix
    follows ``format``, default the source's)."""
    if format not in (None, *SUFFIX):
        raise TableError(f"format must be orc or parquet, not {format!r}")
    src_root, dst_root = table_root(src), table_root(dst)
    if dst_root == src_root or dst_root.startswith(src_root.rstrip("/") + "/"):
        raise TableError(f"the output {dst} must lie outside the source table {src}")
    fs, root = open_filesystem(dst)
    out, relatives = [], []
    for file in files:
        fmt = format or file.format
        relative = relative_name(src_root, file.path) if file.path != src_root else ""
        if fmt != file.format:
            stem, suffix = posixpath.splitext(relative)
            relative = (stem if suffix else relative) + SUFFIX[fmt]
        if relative:
            out.append(Target(file, child_name(dst_root, relative), posixpath.join(root, relative), fmt))
        else:  # a single-file table becomes a single file
            out.append(Target(file, dst_root, root, fmt))
        relatives.append(relative)
    if all(relatives):
        check_no_stale_files(fs, root, relatives, dst)
    return fs, out


def unit_rows(file: DataFile, stripe_size: Optional[int], stripe_rows: Optional[int]) -> Optional[int]:
    """Rows per output unit: ``stripe_rows``, or as many rows as the source stores in
    ``stripe_size`` bytes, or None to keep the source's units."""
    if stripe_rows:
        return stripe_rows
    if stripe_size:
        return max(1, round(stripe_size * file.num_rows / max(file.nbytes, 1)))
    return None


def source_units(file: DataFile, columns: Sequence[str]) -> Iterator[tuple[int, pa.Table]]:
    """(first row in the file, table) of each unit of ``file``."""
    for unit in file.units:
        yield unit.first_row, read_units(file, unit.index, unit.index + 1, columns)


def write_file(fs: pafs.FileSystem, target: Target, schema: pa.Schema, tables: Iterator[pa.Table],
               rows: Optional[int], done: Callable[[int], object]) -> DataFile:
    """Write ``tables`` to ``target`` (units of ``rows`` rows, None: one per table) and
    return the new file as listed; ``done(n)`` follows each unit written (its rows). A
    failed write leaves no file behind."""
    fs.create_dir(posixpath.dirname(target.path), recursive=True)
    try:
        with fs.open_output_stream(target.path) as sink:
            writer = UnitWriter(sink, target.format, schema, rows, done)
            for table in tables:
                writer.write(table)
            writer.close()
    except BaseException:
        remove(fs, target)
        raise
    (written,) = list_table(target.name, format=target.format)
    return written


class UnitWriter:
    """One output file, unit by unit: ``unit_rows`` rows per unit (the last one fewer),
    or None: every ``write`` call is one unit. Each unit is handed to the format's writer
    once, as soon as it is complete, and then reported to ``done`` (its rows)."""

    def __init__(self, sink: pa.NativeFile, format: str, schema: pa.Schema, unit_rows: Optional[int],
                 done: Callable[[int], object] = lambda rows: None):
        self.schema, self.unit_rows, self.done = schema, unit_rows, done
        self._orc = OrcStripeWriter(sink) if format == "orc" else None
        self._parquet = TableWriter(sink, format, schema) if self._orc is None else None
        self._pending: list[pa.Table] = []
        self._rows = 0

    def write(self, table: pa.Table) -> None:
        if not self.unit_rows:
            self._unit(table)
            return
        self._pending.append(table)
        self._rows += table.num_rows
        if self._rows >= self.unit_rows:
            pending = pa.concat_tables(self._pending)
            full = self._rows - self._rows % self.unit_rows
            for start in range(0, full, self.unit_rows):
                self._unit(pending.slice(start, self.unit_rows))
            rest = pending.slice(full)
            self._pending, self._rows = ([rest] if rest.num_rows else []), rest.num_rows

    def close(self) -> None:
        if self._pending:
            self._unit(pa.concat_tables(self._pending))
            self._pending, self._rows = [], 0
        if self._orc is not None:
            self._orc.close(self.schema)
        else:
            self._parquet.close()

    def _unit(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        if self._orc is not None:
            self._orc.write(table)
        else:
            self._parquet.write(table)
        self.done(table.num_rows)


def remove(fs: pafs.FileSystem, target: Target) -> None:
    """Delete an output file that failed (best effort: the error that got here matters more)."""
    try:
        fs.delete_file(target.path)
    except OSError:
        pass


def verified(fs: pafs.FileSystem, target: Target, check: Callable[[], object]) -> object:
    """``check()``'s result; a file that fails its check is deleted."""
    try:
        return check()
    except BaseException:
        remove(fs, target)
        raise


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, unit="rows", unit_scale=True, desc=desc, file=sys.stderr, disable=not enabled)
