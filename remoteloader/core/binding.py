"""Binding a spec to its table: files, schema, the compiled feature pipeline.

The master binds a spec once per job (listing files, checking every column the spec
names against the table's schema, compiling the transforms). Workers receive the
resulting schema with the spec, so they compile the same pipeline without listing the
table again.
"""
from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

from ..formats import (
    DataFile,
    TableError,
    Skipped,
    in_stream,
    list_table,
    read_schema,
    virtual_column_kind,
)
from ..spec import MAP_REF, DatasetSpec, FeatureSpec, SpecError, TableSpec
from ..transforms import (
    FeaturePipeline,
    TransformError,
    compile_features,
    validate_sampling,
)

SCALAR_KINDS = ("float", "int")
# A worker transforms a whole split at once and holds its pieces until they are sent, so
# what a spec makes a worker allocate is rows x bytes a row; these bound it (docs/spec.md).
MAX_DENSE_WIDTH = 1 << 16  # float32 columns a row: 256 KiB a row
MAX_PIECE_BYTES = 256 << 20  # batch_size rows: the loader's default prefetch_bytes, so one piece fits its window
MAX_SPLIT_BYTES = 1 << 30  # split_rows rows: the wire's largest frame


@dataclass
class BoundDataset:
    spec: DatasetSpec
    schema: dict[str, str]
    pipeline: FeaturePipeline
    read_columns: list[str]  # every table column a worker reads: features, label, passthrough
    files: Optional[list[DataFile]] = None  # the master's view; workers get files per split
    skipped: list[str] = field(default_factory=list)  # files left out by on_error: skip, with the reason
    ignored: list[str] = field(default_factory=list)  # files under the table's path of another format
    file_tables: list[int] = field(default_factory=list)  # tables mixed by weight: each file's table (else empty)

    @property
    def sparse_keys(self) -> list[str]:
        return list(self.pipeline.sparse_names)


def bind(spec: DatasetSpec) -> BoundDataset:
    """List the table and check the spec against it; errors name the key, file and column.

    Only the columns the spec reads must agree across files: a partition that gained an
    unrelated column is fine. A file that lacks a read column or has it with another
    type fails the bind (``on_error: fail``) or is left out and reported (``skip``).
    """
    sources = [(t.table, f"tables[{i}]", t) for i, t in enumerate(spec.tables)] or [(spec.table, "table", None)]
    files: list[DataFile] = []
    schemas: list[dict[str, str]] = []
    table_of: list[int] = []  # each file's table in the mix
    skipped: list[str] = []
    ignored: list[str] = []
    for i, (table, key, mixed) in enumerate(sources):
        left_out = Skipped()
        try:
            listed = list_table(table.path, table.format, table.partitions, skipped=left_out)
            if table.follow is not None:  # a following job reads up to its until partition
                listed = _in_stream(table, listed)
            with ThreadPoolExecutor(8) as pool:
                read = list(pool.map(read_schema, listed))
        except TableError as e:
            raise SpecError(f"{key}: {e}") from None
        if left_out.unreadable and spec.on_error != "skip":
            more = f" (and {len(left_out.unreadable) - 1} more)" if len(left_out.unreadable) > 1 else ""
            raise SpecError(f"{key}: data file {left_out.unreadable[0]}{more}: fix or remove it, or set on_error: "
                            "skip to leave it out (reported)")
        skipped += [f"{u} skipped (on_error: skip)" for u in left_out.unreadable]
        ignored += left_out.ignored
        files += listed
        schemas += read if mixed is None else [job_schema(schema, mixed.columns) for schema in read]
        table_of += [i] * len(listed)
    bound = bind_schema(spec, _majority_schema(schemas))
    kept, kept_tables = [], []
    stored = stored_columns(bound)
    for f, schema, t in zip(files, schemas, table_of):
        problem = next((f"column {c!r} is {schema.get(c, 'missing')} in {f.path}, "
                        f"{bound.schema[c]} in the rest of the {'tables' if spec.tables else 'table'}"
                        for c in stored if schema.get(c) != bound.schema[c]), None)
        if problem is None:
            kept.append(f)
            kept_tables.append(t)
        elif spec.on_error == "skip":
            skipped.append(f"{f.path} skipped (on_error: skip): {problem}")
        else:
            raise SpecError(f"{sources[t][1]}: {problem}")
    for i, (table, key, _) in enumerate(sources):
        if i not in kept_tables:
            raise SpecError(f"{key}: no readable file left in {table.path!r}: {'; '.join(skipped)[:2000]}")
    bound.files, bound.skipped, bound.ignored = kept, skipped, ignored
    bound.file_tables = kept_tables if spec.tables else []
    return bound


def stored_columns(bound: BoundDataset) -> list[str]:
    """The file columns a job reads (a map column once for all its features), sorted."""
    return sorted({_stored_column(c) for c in bound.read_columns})


def job_schema(schema: Mapping[str, str], renames: Sequence[tuple[str, str]]) -> dict[str, str]:
    """A mixed table's schema under the job's column names (``tables[i].columns``: job name ->
    the table's name); a job name the table also has as a column of its own is the renamed one."""
    out = dict(schema)
    for job, stored in renames:
        out.pop(job, None)
    for job, stored in renames:
        if stored in schema:
            out[job] = schema[stored]
    return out


def _in_stream(table: TableSpec, files: list[DataFile]) -> list[DataFile]:
    """The files of a following table up to its ``until`` partition."""
    if len(files) == 1 and files[0].path == table.path:
        raise SpecError(f"table.follow: table {table.path!r} is a single file: there is nothing to "
                        "follow (follow a directory of partitions)")
    files = [f for f in files if in_stream(f.partition, table.follow["until"])]
    if not files:
        raise TableError(f"no file of table {table.path} is in a partition up to table.follow.until "
                         f"{table.follow['until']!r} yet")
    return files


def _stored_column(name: str) -> str:
    """The file column behind a read column: ``X[K]``, ``X[K].ids`` and ``X[K].scores`` live in map ``X``."""
    m = MAP_REF.match(name.removesuffix(".ids").removesuffix(".scores"))
    return m.group(1) if m else name


def _majority_schema(schemas: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """Each column's most common kind across files, so one odd file cannot define the table."""
    votes: dict[str, Counter] = {}
    for schema in schemas:
        for column, kind in schema.items():
            votes.setdefault(column, Counter())[kind] += 1
    return {column: counts.most_common(1)[0][0] for column, counts in votes.items()}


def bind_schema(spec: DatasetSpec, schema: Mapping[str, str]) -> BoundDataset:
    schema = dict(schema)
    where = "the tables' columns (after tables[i].columns)" if spec.tables else f"table {spec.table.path!r}"
    for key, column in ([("features.label", spec.label)] if spec.label else []) + [
        (f"features.passthrough[{i}]", c) for i, c in enumerate(spec.passthrough)
    ]:
        if column not in schema:
            raise SpecError(f"{key}: column {column!r} is not in {where}")
        if schema[column] not in SCALAR_KINDS:
            raise SpecError(f"{key}: column {column!r} has type {schema[column]}, a scalar (float or int) column is needed")
    dense, sparse = _resolve_map_columns(spec.dense, schema), _resolve_map_columns(spec.sparse, schema)
    try:
        pipeline = compile_features(dense, sparse, schema)
    except TransformError as e:
        raise SpecError(f"features: {e}") from None
    if spec.sampling is not None:
        try:
            sampling = validate_sampling(spec.sampling)
        except ValueError as e:
            raise SpecError(str(e)) from None
        if sampling["label_value"] is not None and not spec.label:
            raise SpecError("sampling.label_value: needs features.label (the column it compares)")
    _check_size(spec, pipeline)
    columns = set(pipeline.input_columns) | set(spec.passthrough)
    if spec.label:
        columns.add(spec.label)
    return BoundDataset(spec, schema, pipeline, sorted(columns))


def _check_size(spec: DatasetSpec, pipeline: FeaturePipeline) -> None:
    """Refuse a spec whose rows are too wide, or whose pieces or splits too big, naming the
    feature that makes them so. A row counts what every row costs whatever the data: 4 bytes
    a dense column, the label, each sparse feature's length and each passthrough column; a
    sparse feature's ids depend on the table, so they are not counted."""
    width = 0
    for i, (name, w) in enumerate(zip(pipeline.dense_names, pipeline.dense_widths)):
        width += w
        if width > MAX_DENSE_WIDTH:
            raise SpecError(f"features.dense[{i}]: feature {name!r} brings the dense width to {width:,} float32 "
                            f"columns a row (at most {MAX_DENSE_WIDTH:,})")
    row_bytes = 4 * (width + 1 + len(pipeline.sparse_names) + len(spec.passthrough))
    for key, rows, limit, unit in (("batch_size", spec.batch_size, MAX_PIECE_BYTES, "a piece"),
                                   ("split_rows", spec.split_rows, MAX_SPLIT_BYTES, "a split")):
        if rows * row_bytes > limit:
            raise SpecError(f"{key}: {rows:,} rows of {row_bytes:,} bytes are {_mib(rows * row_bytes)} "
                            f"(at most {_mib(limit)} {unit}){_widest(pipeline)}; lower {key}")


def _widest(pipeline: FeaturePipeline) -> str:
    """Which dense feature takes most of a row, for the error."""
    if not pipeline.dense_names:
        return ""
    width, name = max(zip(pipeline.dense_widths, pipeline.dense_names))
    return f"; feature {name!r} alone is {width:,} float32 columns"


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.0f} MiB"


def _resolve_map_columns(features: Sequence[FeatureSpec], schema: dict[str, str]) -> tuple[FeatureSpec, ...]:
    """Give each ``{map: X, key: K}`` column (held as ``X[K]``) a schema entry, so the
    pipeline treats it like any column; a scored map's key becomes ids + scores."""
    out = []
    for f in features:
        m = MAP_REF.match(f.column or "")
        if m and f.column not in schema and schema.get(m.group(1)) == "map:scored":
            f = replace(f, column=f.column + ".ids", scores=f.column + ".scores")
        for name in (f.column, f.scores):
            if name and name not in schema and (kind := virtual_column_kind(schema, name)) is not None:
                schema[name] = kind
        out.append(f)
    return tuple(out)
