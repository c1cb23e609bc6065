"""Reading one split: a range of units of one file, only the projected columns.

The bytes come through a coalescing read planner (``prefetch``): the format module plans
the byte ranges of the selected columns from the file's metadata, ranges closer than
``coalesce_gap`` are merged into one request, and pyarrow decodes from memory.
Columns may be virtual (``X[K]``: a feature inside map column ``X``, see ``maps``).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import pyarrow as pa

from ..columns import Column
from . import maps
from .convert import arrow_to_column, column_kind
from .fs import open_filesystem, target
from .prefetch import DEFAULT_COALESCE_GAP, PrefetchedFile
from .table import format_module, posix_identity
from .types import DataFile, IOStats, TableError


def read_split(file: DataFile, first_unit: int, stop_unit: int, columns: Sequence[str], *,
               coalesce_gap: int = DEFAULT_COALESCE_GAP, io_stats: Optional[IOStats] = None) -> dict[str, Column]:
    """Units ``[first_unit, stop_unit)`` of ``file``, columns in the order given.

    ``coalesce_gap``: merge the byte ranges of selected streams / column chunks whose gap
    is at most this many bytes into one request (0: one request per stream / chunk).
    ``io_stats``: the read's requests and bytes are added to it."""
    where = f"{file.path} units [{first_unit}, {stop_unit})"
    units = file.unit_range(first_unit, stop_unit)
    if not units:
        listed = f"[{file.units[0].index}, {file.units[-1].index + 1})" if file.units else "none"
        raise TableError(f"{where}: out of range, the file lists units {listed}")
    columns = list(dict.fromkeys(columns))
    table = read_units(file, first_unit, stop_unit, columns, coalesce_gap=coalesce_gap, io_stats=io_stats)
    expected = sum(u.num_rows for u in units)
    if table.num_rows != expected:
        raise TableError(f"{where}: read {table.num_rows} rows where the listing promised {expected} (file changed?)")
    names = set(table.column_names)
    virtual: dict[str, list[maps.Virtual]] = {}
    for name in columns:
        if name not in names:
            v = maps.parse_virtual(name)
            virtual.setdefault(v.base, []).append(v)
    out: dict[str, Column] = {}
    try:
        for base, wanted in virtual.items():
            out.update(maps.extract(table.column(base), column_kind(table.schema.field(base).type), wanted))
    except TableError as e:
        raise TableError(f"{where}: {e}") from None
    for name in columns:
        if name in names:
            try:
                out[name] = arrow_to_column(table.column(name))
            except TableError as e:
                raise TableError(f"{where}: column {name!r}: {e}") from None
    return {name: out[name] for name in columns}


def read_units(file: DataFile, first_unit: int, stop_unit: int, columns: Sequence[str], *,
               coalesce_gap: int = DEFAULT_COALESCE_GAP, io_stats: Optional[IOStats] = None) -> pa.Table:
    """The Arrow table of a unit range: the one place a split touches storage. A virtual
    column (``X[K]``) is answered by its whole map column ``X``, so the table holds the
    file's columns named in ``columns`` or behind their virtual names (ORC answers in the
    file's column order, Parquet in the order asked)."""
    where = f"{file.path} units [{first_unit}, {stop_unit})"
    module = format_module(file.format, where)
    stats = IOStats(splits=1)
    fs, path = open_filesystem(file.path)
    missing: list[str] = []
    _check_unchanged(file, path, where)
    try:
        with fs.open_input_file(path) as source:
            prefetched = PrefetchedFile(source, source.size(), stats)
            layout = module.read_tail(prefetched, file.path)
            physical, missing = _physical(columns, layout.columns)
            if not missing:
                reader = module.prefetched_reader(prefetched, layout, first_unit, stop_unit, physical, coalesce_gap)
                table = reader.read(first_unit, stop_unit, physical)
                _check_unchanged(file, path, where)  # a rewrite during the read: none of it is used
                return table
    except module.READ_ERRORS as e:  # TableError is a ValueError: planning errors land here too
        raise TableError(f"cannot read {where}: {e}") from e
    finally:
        if io_stats is not None:
            io_stats.add(stats)
    raise TableError(f"{where}: no column {missing[0]!r} in the file" + (f" (nor {missing[1:]})" if missing[1:] else ""))


def _check_unchanged(file: DataFile, path: str, where: str) -> None:
    """A file on a POSIX filesystem must be the version that was listed (``identity``: inode,
    modification and change times, and size): rows planned from its old footer are never
    read from a new version, nor half from each. One ``stat`` per split read. (An object
    store's version is checked when a following job lists its table again.)"""
    if not file.identity.startswith("posix:") or not target(file.path).local:
        return
    try:
        st = os.stat(path)
    except OSError as e:
        raise TableError(f"{where}: cannot stat the file ({e}): removed after it was listed?") from None
    now = posix_identity(st)
    if (now, st.st_size) != (file.identity, file.nbytes):
        raise TableError(f"{where}: the file changed after it was listed (size {file.nbytes} -> {st.st_size}, "
                         f"identity {file.identity} -> {now}): not read; list the table again to read it")


def _physical(columns: Sequence[str], names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the file's columns to read, the names that are neither a column nor a feature
    inside one)."""
    physical, missing = [], []
    for name in columns:
        if name in names:
            physical.append(name)
            continue
        v = maps.parse_virtual(name)
        if v is not None and v.base in names:
            physical.append(v.base)
        else:
            missing.append(name)
    return list(dict.fromkeys(physical)), missing
