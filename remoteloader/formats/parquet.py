"""Parquet: row groups are the read units; everything comes from the footer.

Split reads take the selected column chunks' byte ranges from the footer, fetch them
coalesced, and decode through pyarrow from memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import pyarrow as pa
import pyarrow.parquet as pq

from .prefetch import PrefetchedFile, fetch_tail, merge_ranges
from .types import TableError, Unit

# Arrow's footer read size: most footers come in one request.
TAIL_GUESS = 64 << 10
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
    def __init__(self, source: Union[pa.NativeFile, pa.PythonFile], metadata: Optional[pq.FileMetaData] = None):
        # pre_buffer (on by default) would merge reads across holes of the planned ranges.
        self._file = pq.ParquetFile(source, metadata=metadata, pre_buffer=False)

    @property
    def schema(self) -> pa.Schema:
        return self._file.schema_arrow

    def read(self, first_unit: int, stop_unit: int, columns: Sequence[str]) -> pa.Table:
        return self._file.read_row_groups(range(first_unit, stop_unit), columns=list(columns))


def _tail_length(end: memoryview) -> int:
    if len(end) < 8 or bytes(end[-4:]) != b"PAR1":
        raise TableError("not a Parquet file (no PAR1 magic at the end)")
    return int.from_bytes(end[-8:-4], "little") + 8


@dataclass(frozen=True)
class Tail:
    metadata: pq.FileMetaData
    columns: dict[str, range]  # top-level column -> its leaf (column chunk) indices


def read_tail(file: PrefetchedFile, name: str) -> Tail:
    """The file's footer, its bytes fetched."""
    return fetch_tail(file, name, TAIL_GUESS, _tail_length, _parse_tail)


def _parse_tail(raw: memoryview) -> Tail:
    meta = pq.read_metadata(pa.BufferReader(pa.py_buffer(raw)))
    leaves, first = {}, 0
    for field in meta.schema.to_arrow_schema():
        n = _leaf_count(field.type)
        leaves[field.name] = range(first, first + n)
        first += n
    if first != meta.num_columns:  # a type mapped differently: fall back on leaf paths
        leaves = {}
        for j in range(meta.num_columns):
            top = meta.schema.column(j).path.split(".")[0]
            leaves[top] = range(leaves[top].start if top in leaves else j, j + 1)
    return Tail(meta, leaves)


def _leaf_count(type_: pa.DataType) -> int:
    return sum(_leaf_count(type_.field(i).type) for i in range(type_.num_fields)) if type_.num_fields else 1


def prefetched_reader(file: PrefetchedFile, tail: Tail, first_unit: int, stop_unit: int,
                      columns: Sequence[str], coalesce_gap: int) -> Reader:
    """Fetch the selected column chunks of row groups [first_unit, stop_unit), merged by
    ``coalesce_gap``; return a reader decoding from them (and the footer)."""
    meta, leaves = tail.metadata, tail.columns
    if stop_unit > meta.num_row_groups:
        raise TableError(f"the file has {meta.num_row_groups} row groups (file changed?)")
    selected = sorted({j for c in columns if c in leaves for j in leaves[c]})
    ranges = []
    for i in range(first_unit, stop_unit):
        group = meta.row_group(i)
        for j in selected:
            chunk = group.column(j)
            # Where Arrow's reader starts a chunk: at its dictionary page when it has one.
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
                start = chunk.dictionary_page_offset
            ranges.append((start, start + chunk.total_compressed_size))
    file.stats.bytes_needed += sum(end - start for start, end in ranges)
    file.fetch(merge_ranges(ranges, coalesce_gap))
    return Reader(pa.PythonFile(file, mode="r"), metadata=meta)
