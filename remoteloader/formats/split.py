"""Reading one split: a range of units of one file, only the projected columns."""
from __future__ import annotations

from typing import Sequence

import pyarrow as pa

from ..columns import Column
from .convert import arrow_to_column
from .fs import open_filesystem
from .table import format_module
from .types import DataFile, TableError


def read_split(file: DataFile, first_unit: int, stop_unit: int, columns: Sequence[str]) -> dict[str, Column]:
    """Units ``[first_unit, stop_unit)`` of ``file``, columns in the order given."""
    where = f"{file.path} units [{first_unit}, {stop_unit})"
    if not 0 <= first_unit < stop_unit <= len(file.units):
        raise TableError(f"{where}: out of range, the file has {len(file.units)} units")
    columns = list(dict.fromkeys(columns))
    table = read_units(file, first_unit, stop_unit, columns)
    expected = sum(u.num_rows for u in file.units[first_unit:stop_unit])
    if table.num_rows != expected:
        raise TableError(f"{where}: read {table.num_rows} rows where the listing promised {expected} (file changed?)")
    out = {}
    for name in columns:
        try:
            out[name] = arrow_to_column(table.column(name))
        except TableError as e:
            raise TableError(f"{where}: column {name!r}: {e}") from None
    return out


def read_units(file: DataFile, first_unit: int, stop_unit: int, columns: Sequence[str]) -> pa.Table:
    """The Arrow table of a unit range: the one place a split touches storage. The format
    readers take an open random-access file, so a coalescing read planner can hand them a
    source that serves prefetched, merged byte ranges instead of a plain file."""
    where = f"{file.path} units [{first_unit}, {stop_unit})"
    module = format_module(file.format, where)
    fs, path = open_filesystem(file.path)
    try:
        with fs.open_input_file(path) as source:
            reader = module.Reader(source)
            names = set(reader.schema.names)
            missing = [c for c in columns if c not in names]
            if missing:
                raise TableError(f"{where}: no column {missing[0]!r} in the file" + (f" (nor {missing[1:]})" if missing[1:] else ""))
            return reader.read(first_unit, stop_unit, columns)
    except TableError:
        raise
    except module.READ_ERRORS as e:
        raise TableError(f"cannot read {where}: {e}") from e
