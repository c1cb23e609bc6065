"""Parquet: row groups are the read units; everything comes from the footer."""
from __future__ import annotations

from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from .types import Unit

# Everything a damaged or foreign file can make the library raise.
READ_ERRORS = (OSError, ValueError, pa.ArrowException)


def units(source: pa.NativeFile) -> tuple[int, tuple[Unit, ...]]:
    """(rows, row groups) from the footer; a row group's size is its column chunks'
    compressed sizes, what reading all of it costs."""
    meta = pq.ParquetFile(source).metadata
    groups, first_row = [], 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        nbytes = sum(group.column(j).total_compressed_size for j in range(group.num_columns))
        groups.append(Unit(i, first_row, group.num_rows, nbytes))
        first_row += group.num_rows
    return meta.num_rows, tuple(groups)


class Reader:
    def __init__(self, source: pa.NativeFile):
        self._file = pq.ParquetFile(source)

    @property
    def schema(self) -> pa.Schema:
        return self._file.schema_arrow

    def read(self, first_unit: int, stop_unit: int, columns: Sequence[str]) -> pa.Table:
        return self._file.read_row_groups(range(first_unit, stop_unit), columns=list(columns))
