"""Feature flattening: a map-column table rewritten with one column per feature.

Every key of a map column becomes a column named ``<map column>_<key>`` (a float column
for 'map:float', a list<int> column for 'map:id_list'); a key of a 'map:scored' column
becomes ``<map column>_<key>_ids`` and ``<map column>_<key>_scores`` (aligned lists). A
row without the key holds null. The keys are all those occurring anywhere in the source
(a first pass collects them, so every output file has the same schema); plain columns
are copied. The output keeps the source's partitions, file names and units (stripes /
row groups) unless ``stripe_size`` / ``stripe_rows`` say otherwise.

Each output file is verified after writing: digests (``digest``) of every feature taken
from the source map entries must equal those of the written columns read back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import numpy as np
import pyarrow as pa

from ..columns import Column, DenseColumn
from ..formats import DataFile, TableError, arrow_to_column, list_table, table_schema
from ..formats.maps import Items, Virtual, extract, flat_name, key_entries
from .digest import Digest, column_digest, grouped_totals, value_hashes
from .rewrite import progress_bar, source_units, targets, unit_rows, verified, write_file

_PARTS = {"map:float": (None,), "map:id_list": (None,), "map:scored": ("ids", "scores")}


@dataclass
class FlattenReport:
    files: int = 0
    rows: int = 0
    keys: dict[str, int] = field(default_factory=dict)  # map column -> keys found
    columns: int = 0  # columns of the output
    verified: bool = False
    values_verified: int = 0  # feature values checked against the source
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        keys = ", ".join(f"{k}: {n} keys" for k, n in self.keys.items())
        check = (f"verified {self.values_verified} values, all equal, absent keys null" if self.verified
                 else "not verified")
        return (f"flattened {self.files} files, {self.rows} rows ({keys}) into {self.columns} columns; {check}; "
                f"{self.bytes_in / 1e6:.1f} MB -> {self.bytes_out / 1e6:.1f} MB in {self.seconds:.1f} s")


def flatten_table(src: str, dst: str, *, progress: bool = True, format: Optional[str] = None,
                  stripe_size: Optional[int] = None, stripe_rows: Optional[int] = None,
                  verify: bool = True) -> FlattenReport:
    """Flatten the map columns of table ``src`` into table ``dst`` (``format``: of the
    output, default the source's). Raises TableError if a written file does not verify."""
    start = time.perf_counter()
    files = list_table(src)
    schema = table_schema(files)
    maps = [c for c, kind in schema.items() if kind in _PARTS]
    if not maps:
        raise TableError(f"table {src} has no map columns to flatten ({schema})")
    plain = [c for c in schema if c not in maps]
    fs, jobs = targets(src, dst, files, format)
    rows = sum(f.num_rows for f in files)
    with progress_bar(rows, "flatten: scan keys", progress) as bar:
        source_schema, keys = _scan_keys(files, maps, plain, bar.update)
    report = FlattenReport(len(files), rows, {m: len(keys[m]) for m in maps}, verified=verify,
                           bytes_in=sum(f.nbytes for f in files))
    outputs = {m: [Virtual(flat_name(_virtual_name(m, k, p)), m, k, p)
                   for k in keys[m] for p in _PARTS[schema[m]]] for m in maps}
    out_schema = pa.schema([source_schema.field(c) for c in plain] +
                           [pa.field(v.name, _flat_type(source_schema.field(m).type, v.part)) for m in maps for v in outputs[m]])
    report.columns = len(out_schema)
    with progress_bar(rows * (2 if verify else 1), "flatten" + (" + verify" if verify else ""), progress) as bar:
        for job in jobs:
            expected: dict[str, Digest] = {}

            def tables() -> Iterator[pa.Table]:
                for first_row, table in source_units(job.source, plain + maps):
                    if verify:
                        for m in maps:
                            _add_map_digests(expected, table.column(m), schema[m], m, first_row)
                    yield _flatten(table, plain, maps, schema, outputs, out_schema)

            written = write_file(fs, job, out_schema, tables(), unit_rows(job.source, stripe_size, stripe_rows), bar.update)
            report.bytes_out += written.nbytes
            if verify:
                names = [v.name for m in maps for v in outputs[m]]
                report.values_verified += verified(fs, job, lambda: _verify(written, names, expected, bar.update))
    report.seconds = time.perf_counter() - start
    return report


def _scan_keys(files: list[DataFile], maps: list[str], plain: list[str],
               done: Callable[[int], object]) -> tuple[pa.Schema, dict[str, list[int]]]:
    """(the Arrow schema, every key of every map column), reading the map columns once."""
    found: dict[str, set[int]] = {m: set() for m in maps}
    schema = None
    for file in files:
        for _, table in source_units(file, maps + plain if schema is None else maps):
            schema = schema or table.schema
            for m in maps:
                for chunk in table.column(m).chunks:
                    found[m].update(np.unique(key_entries(chunk, None)[2]).tolist())
            done(table.num_rows)
    return schema, {m: sorted(found[m]) for m in maps}


def _flat_type(map_type: pa.MapType, part: Optional[str]) -> pa.DataType:
    """A feature's column type: the map's item type (a float, or a list of ids), or for
    a scored feature a list of its ids or of its scores."""
    item = map_type.item_type
    if part is None:
        return item
    return pa.list_(item.key_type if part == "ids" else item.item_type)


def _virtual_name(map_name: str, key: int, part: Optional[str]) -> str:
    return f"{map_name}[{key}]" + (f".{part}" if part else "")


def _flatten(table: pa.Table, plain: list[str], maps: list[str], schema: dict[str, str],
             outputs: dict[str, list[Virtual]], out_schema: pa.Schema) -> pa.Table:
    arrays = [table.column(c) for c in plain]
    for m in maps:
        columns = extract(table.column(m), schema[m], outputs[m])
        arrays += [_to_arrow(columns[v.name], out_schema.field(v.name).type) for v in outputs[m]]
    return pa.Table.from_arrays(arrays, schema=out_schema)


def _to_arrow(column: Column, type_: pa.DataType) -> pa.Array:
    mask = None if column.valid is None else ~column.valid
    if isinstance(column, DenseColumn):
        return pa.array(column.values, type=type_, mask=mask)
    values = pa.array(column.values, type=type_.value_type)
    return pa.ListArray.from_arrays(pa.array(column.offsets.astype(np.int32)), values, type=type_,
                                    mask=None if mask is None else pa.array(mask))


def _add_map_digests(into: dict[str, Digest], array: pa.ChunkedArray, kind: str, map_name: str, first_row: int) -> None:
    """Digests of every key's values straight from the map entries (not through the
    extraction that wrote the file), keyed by the output column name."""
    for chunk in array.chunks:
        entries, rows, keys = key_entries(chunk, None)
        rows = rows + first_row
        first_row += len(chunk)
        group_keys, starts = np.unique(keys, return_index=True)
        stops = np.append(starts[1:], len(keys))
        for part in _PARTS[kind]:
            items = Items(chunk.items, kind, part or "ids")
            ok = np.ones(len(entries), bool) if items.valid is None else items.valid[entries]
            present = grouped_totals(ok.astype(np.uint64), starts, stops)
            if items.dense:
                hashes = value_hashes(items.values[entries], rows, np.zeros(len(rows), np.int64)) * ok
                values, sums = present, grouped_totals(hashes, starts, stops)
            else:
                begin = items.offsets[entries].astype(np.int64)
                lengths = np.where(ok, items.offsets[entries + 1] - begin, 0)
                ends = np.zeros(len(lengths) + 1, np.int64)
                np.cumsum(lengths, out=ends[1:])
                at = np.repeat(begin - ends[:-1], lengths) + np.arange(ends[-1], dtype=np.int64)
                positions = np.arange(ends[-1], dtype=np.int64) - np.repeat(ends[:-1], lengths)
                hashes = value_hashes(items.values[at], np.repeat(rows, lengths), positions)
                values, sums = ends[stops] - ends[starts], grouped_totals(hashes, ends[starts], ends[stops])
            for key, p, v, h in zip(group_keys.tolist(), present.tolist(), values.tolist(), sums.tolist()):
                into.setdefault(flat_name(_virtual_name(map_name, key, part)), Digest()).add(Digest(p, v, h))


def _verify(written: DataFile, columns: list[str], expected: dict[str, Digest], done: Callable[[int], object]) -> int:
    got = {c: Digest() for c in columns}
    for first_row, table in source_units(written, columns):
        for c in columns:
            got[c].add(column_digest(arrow_to_column(table.column(c)), first_row))
        done(table.num_rows)
    wrong = [c for c in columns if got[c] != expected.get(c, Digest())]
    if wrong:
        raise TableError(f"{written.path}: flattened columns differ from the source map entries: {wrong[:5]}"
                         + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""))
    return sum(d.values for d in got.values())
