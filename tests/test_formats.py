"""The table layer: listing, footers, schema, split reads and the Arrow conversion."""
from __future__ import annotations

import dataclasses

import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.orc as paorc
import pyarrow.parquet as pq
import pytest

from remoteloader.columns import DenseColumn, SparseColumn
from remoteloader.tools.datagen import generate_table
from remoteloader.formats import (DataFile, TableError, Unit, arrow_to_column, column_kind, list_table,
                                  open_filesystem, read_schema, read_split, table_schema)
from remoteloader.formats import orc as orc_format
from remoteloader.formats import parquet as parquet_format

ROWS = 4000
COLUMNS = ["row_id", "label", "float_0", "idlist_1", "idscore_0", "idscore_0_scores"]


@pytest.fixture(scope="module", params=["orc", "parquet"])
def table(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(f"fmt-{request.param}") / "t"
    generate_table(str(out), ROWS, partitions=3, files_per_partition=2, dense=2, sparse=3, scored=1,
                   format=request.param, seed=11, stripe_size=64 << 10, row_group_rows=250, progress=False)
    return request.param, out


def write(path: Path, table: pa.Table, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = fmt or ("orc" if path.suffix == ".orc" else "parquet")
    if fmt == "orc":
        paorc.write_table(table, str(path))
    else:
        pq.write_table(table, str(path))
    return path


def small(n: int = 10, start: int = 0) -> pa.Table:
    return pa.table({"x": np.arange(start, start + n, dtype=np.int64),
                     "ids": pa.array([[i, i + 1] for i in range(start, start + n)], pa.list_(pa.int64()))})


def direct(file: DataFile, columns: list[str]) -> pa.Table:
    """What pyarrow reads from the whole file, for comparison."""
    return paorc.read_table(file.path, columns=columns) if file.format == "orc" else pq.read_table(file.path, columns=columns)


def assert_matches(column, expected: pa.ChunkedArray) -> None:
    """Compare a converted column with a per-row Python reading of the Arrow data."""
    rows = expected.to_pylist()
    valid = np.array([r is not None for r in rows])
    if isinstance(column, SparseColumn):
        lengths = [len(r) if r is not None else 0 for r in rows]
        values = [v for r in rows if r is not None for v in r]
        assert np.array_equal(column.offsets, np.concatenate([[0], np.cumsum(lengths)]))
        assert column.offsets.dtype == np.int64
        np.testing.assert_array_equal(column.values, np.array(values, dtype=column.values.dtype))
    else:
        np.testing.assert_array_equal(column.values, np.array([0 if r is None else r for r in rows], column.values.dtype))
    if valid.all():
        assert column.valid is None
    else:
        assert np.array_equal(column.valid, valid)


# -- listing -------------------------------------------------------------------------

def test_list_table(table):
    fmt, out = table
    files = list_table(str(out))
    assert [f.partition for f in files] == [f"ds=2026-01-0{d}" for d in (1, 1, 2, 2, 3, 3)]
    assert [f.path for f in files] == sorted(f.path for f in files)
    assert all(f.format == fmt and Path(f.path).is_absolute() for f in files)
    assert sum(f.num_rows for f in files) == ROWS
    for f in files:
        assert f.nbytes == os.path.getsize(f.path)
        assert len(f.units) > 1
        assert [u.index for u in f.units] == list(range(len(f.units)))
        assert [u.first_row for u in f.units] == list(np.cumsum([0] + [u.num_rows for u in f.units[:-1]]))
        assert sum(u.num_rows for u in f.units) == f.num_rows
        assert all(0 < u.nbytes < f.nbytes for u in f.units)


def test_units_match_the_files(table):
    fmt, out = table
    f = list_table(str(out))[0]
    if fmt == "orc":
        reader = paorc.ORCFile(f.path)
        assert [reader.read_stripe(u.index).num_rows for u in f.units] == [u.num_rows for u in f.units]
    else:
        meta = pq.ParquetFile(f.path).metadata
        assert [meta.row_group(u.index).num_rows for u in f.units] == [u.num_rows for u in f.units]


def test_partition_filter(table):
    _, out = table
    files = list_table(str(out), partitions=["ds=2026-01-03", "ds=2026-01-01/"])
    assert [f.partition for f in files] == ["ds=2026-01-01"] * 2 + ["ds=2026-01-03"] * 2
    assert [f.partition for f in list_table(str(out), partitions="ds=2026-01-02")] == ["ds=2026-01-02"] * 2
    with pytest.raises(TableError, match="ds=2026-01-09"):
        list_table(str(out), partitions=["ds=2026-01-01", "ds=2026-01-09"])
    with pytest.raises(TableError, match="empty"):
        list_table(str(out), partitions=[])


def test_nested_partitions(tmp_path):
    for i, part in enumerate(["ds=1/hr=00", "ds=1/hr=01", "ds=2/hr=00", "ds=10/hr=00"]):
        write(tmp_path / part / "part-0.parquet", small(5, 5 * i))
    assert [f.partition for f in list_table(str(tmp_path))] == ["ds=1/hr=00", "ds=1/hr=01", "ds=10/hr=00", "ds=2/hr=00"]
    assert [f.partition for f in list_table(str(tmp_path), partitions=["ds=1"])] == ["ds=1/hr=00", "ds=1/hr=01"]
    assert [f.partition for f in list_table(str(tmp_path), partitions=["ds=1/hr=01"])] == ["ds=1/hr=01"]
    with pytest.raises(TableError, match="'ds=1/hr=02'"):
        list_table(str(tmp_path), partitions=["ds=1/hr=02"])


def test_format_inference_and_bookkeeping_files(tmp_path):
    write(tmp_path / "ds=1" / "a.pq", small())
    (tmp_path / "ds=1" / "_SUCCESS").write_bytes(b"")
    (tmp_path / "ds=1" / ".a.pq.crc").write_bytes(b"junk")
    write(tmp_path / "_temporary" / "b.pq", small())
    files = list_table(str(tmp_path))
    assert [(Path(f.path).name, f.format) for f in files] == [("a.pq", "parquet")]
    write(tmp_path / "ds=2" / "c.orc", small())
    with pytest.raises(TableError, match="both ORC and Parquet"):
        list_table(str(tmp_path))
    assert [Path(f.path).name for f in list_table(str(tmp_path), format="orc")] == ["c.orc"]
    with pytest.raises(TableError, match="unknown format 'csv'"):
        list_table(str(tmp_path), format="csv")


def test_hive_files_without_suffix(tmp_path):
    write(tmp_path / "ds=1" / "000000_0", small(), fmt="orc")
    with pytest.raises(TableError, match="no .orc"):
        list_table(str(tmp_path))
    (f,) = list_table(str(tmp_path), format="orc")
    assert f.num_rows == 10 and f.partition == "ds=1"


def test_single_file_table(tmp_path, monkeypatch):
    path = write(tmp_path / "one.orc", small(7))
    monkeypatch.chdir(tmp_path)
    (f,) = list_table("one.orc")
    tail = hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()  # a small file is all tail
    assert f == DataFile(str(path), "orc", "", 7, os.path.getsize(path), (Unit(0, 0, 7, f.units[0].nbytes),), tail)
    assert read_split(f, 0, 1, ["x"])["x"].values.tolist() == list(range(7))
    with pytest.raises(TableError, match="single file"):
        list_table("one.orc", partitions=["ds=1"])
    (tmp_path / "one.dat").write_bytes(b"")
    with pytest.raises(TableError, match="one.dat"):
        list_table("one.dat")


def test_missing_and_empty_paths(tmp_path):
    with pytest.raises(TableError, match="nowhere.*does not exist"):
        list_table(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TableError, match="empty"):
        list_table(str(tmp_path / "empty"))


def test_file_uri(table):
    _, out = table
    files = list_table(out.as_uri(), partitions=["ds=2026-01-02"])
    assert all(f.path.startswith("file:///") and f.path.endswith(("orc", "parquet")) for f in files)
    local = list_table(str(out), partitions=["ds=2026-01-02"])
    fs, path = open_filesystem(files[0].path)
    assert path == local[0].path
    a = read_split(files[0], 0, 1, ["row_id"])["row_id"]
    b = read_split(local[0], 0, 1, ["row_id"])["row_id"]
    assert np.array_equal(a.values, b.values)


def test_listing_many_files_is_fast(tmp_path):
    for i in range(150):
        write(tmp_path / f"ds={i:03d}" / "part-0.orc", small(3, 3 * i))
    start = time.perf_counter()
    files = list_table(str(tmp_path))
    assert time.perf_counter() - start < 3
    assert len(files) == 150 and sum(f.num_rows for f in files) == 450


def test_unreadable_files_are_named(tmp_path):
    (tmp_path / "ds=1").mkdir()
    (tmp_path / "ds=1" / "garbage.orc").write_bytes(os.urandom(1000))
    with pytest.raises(TableError, match="garbage.orc"):
        list_table(str(tmp_path))
    good = write(tmp_path / "t" / "good.parquet", small())
    truncated = tmp_path / "t" / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[:-30])
    with pytest.raises(TableError, match="truncated.parquet"):
        list_table(str(tmp_path / "t"))


# -- schema ----------------------------------------------------------------------------

def test_schema(table):
    _, out = table
    files = list_table(str(out))
    schema = table_schema(files)
    assert schema == read_schema(files[-1])
    assert {k: schema[k] for k in COLUMNS} == {
        "row_id": "int", "label": "float", "float_0": "float", "idlist_1": "id_list",
        "idscore_0": "id_list", "idscore_0_scores": "float_list"}


def test_schema_mismatch_names_files_and_column(tmp_path):
    write(tmp_path / "ds=1" / "a.parquet", small())
    write(tmp_path / "ds=2" / "b.parquet", small().set_column(1, "ids", pa.array([[0.5]] * 10)))
    with pytest.raises(TableError, match=r"'ids' is id_list in .*a\.parquet but float_list in .*b\.parquet"):
        table_schema(list_table(str(tmp_path)))
    shutil.rmtree(tmp_path / "ds=2")
    write(tmp_path / "ds=2" / "b.parquet", small().drop_columns(["ids"]))
    with pytest.raises(TableError, match=r"'ids' of .*a\.parquet is missing from .*b\.parquet"):
        table_schema(list_table(str(tmp_path)))


def test_int_widths_share_a_kind(tmp_path):
    write(tmp_path / "ds=1" / "a.parquet", pa.table({"x": pa.array([1], pa.int32())}))
    write(tmp_path / "ds=2" / "b.parquet", pa.table({"x": pa.array([1], pa.int64())}))
    assert table_schema(list_table(str(tmp_path))) == {"x": "int"}


# -- split reads ----------------------------------------------------------------------

def test_read_split_equals_direct_read(table):
    _, out = table
    for f in list_table(str(out))[:3]:
        reference = direct(f, COLUMNS)
        n = len(f.units)
        for first, stop in [(0, 1), (1, min(3, n)), (n - 1, n), (0, n)]:
            got = read_split(f, first, stop, COLUMNS)
            assert list(got) == COLUMNS
            lo = f.units[first].first_row
            hi = f.units[stop - 1].first_row + f.units[stop - 1].num_rows
            for name in COLUMNS:
                assert_matches(got[name], reference[name].slice(lo, hi - lo))
        assert got["row_id"].values.dtype == np.int64 and got["label"].values.dtype == np.float32
        assert got["idscore_0_scores"].values.dtype == np.float32
        assert np.array_equal(got["idscore_0"].offsets, got["idscore_0_scores"].offsets)
        assert got["float_0"].valid is not None and got["idlist_1"].valid is not None


def test_read_split_reads_only_the_projection(table, monkeypatch):
    fmt, out = table
    module = orc_format if fmt == "orc" else parquet_format
    asked = []
    original = module.Reader.read

    def spy(self, first, stop, columns):
        result = original(self, first, stop, columns)
        asked.append((list(columns), sorted(result.column_names)))
        return result

    monkeypatch.setattr(module.Reader, "read", spy)
    f = list_table(str(out))[0]
    got = read_split(f, 0, 2, ["idlist_2", "label", "idlist_2"])
    assert list(got) == ["idlist_2", "label"]
    assert asked == [(["idlist_2", "label"], ["idlist_2", "label"])]  # ORC answers in file order


def test_read_split_errors_name_file_units_and_column(table, tmp_path):
    _, out = table
    f = list_table(str(out))[0]
    with pytest.raises(TableError, match=rf"{f.path} units \[0, 1\).*'nope'"):
        read_split(f, 0, 1, ["row_id", "nope"])
    with pytest.raises(TableError, match="out of range"):
        read_split(f, 0, len(f.units) + 1, ["row_id"])
    with pytest.raises(TableError, match="out of range"):
        read_split(f, 1, 1, ["row_id"])
    # The file is cut short after it was listed (e.g. rewritten by a producer).
    copy = tmp_path / Path(f.path).name
    shutil.copy(f.path, copy)
    listed = DataFile(str(copy), f.format, f.partition, f.num_rows, f.nbytes, f.units)
    copy.write_bytes(copy.read_bytes()[: f.nbytes // 2])
    n = len(f.units)
    with pytest.raises(TableError, match=rf"{copy}.*units \[{n - 1}, {n}\)"):
        read_split(listed, n - 1, n, ["row_id", "idlist_1"])
    with pytest.raises(TableError, match=str(tmp_path / "gone")):
        read_split(DataFile(str(tmp_path / "gone"), f.format, "", 1, 1, f.units), 0, 1, ["row_id"])


def test_read_split_notices_a_replaced_file(tmp_path):
    path = write(tmp_path / "a.orc", small(10))
    (f,) = list_table(str(path))
    write(path, small(4))
    with pytest.raises(TableError, match="a.orc units .* changed after it was listed .*not read"):
        read_split(f, 0, 1, ["x"])
    # A file journaled without an identity (by an older master) is still caught by its row count.
    with pytest.raises(TableError, match="promised 10"):
        read_split(dataclasses.replace(f, identity=""), 0, 1, ["x"])


def test_read_split_rejects_unsupported_columns(tmp_path):
    path = write(tmp_path / "a.parquet", pa.table({"s": ["a", "b"]}))
    (f,) = list_table(str(path))
    assert read_schema(f) == {"s": "other:string"}
    with pytest.raises(TableError, match=r"a\.parquet units \[0, 1\): column 's'.*string"):
        read_split(f, 0, 1, ["s"])


# -- Arrow conversion -------------------------------------------------------------------

@pytest.mark.parametrize("array, dtype", [
    (pa.array([1.5, None, 3.0], pa.float32()), np.float32),
    (pa.array([1.5, None, 3.0], pa.float64()), np.float64),
    (pa.array([1.5, None, 3.0], pa.float16()), np.float32),
    (pa.array([1, None, -3], pa.int32()), np.int64),
    (pa.array([1, 2, 255], pa.uint8()), np.int64),
])
def test_dense_conversion(array, dtype):
    column = arrow_to_column(array)
    assert isinstance(column, DenseColumn) and column.values.dtype == dtype
    assert_matches(column, pa.chunked_array([array]))


def test_list_conversion_types():
    ids = arrow_to_column(pa.array([[1, 2], None, [], [3]], pa.list_(pa.int32())))
    assert isinstance(ids, SparseColumn) and ids.values.dtype == np.int64 and ids.weights is None
    assert ids.values.tolist() == [1, 2, 3] and ids.offsets.tolist() == [0, 2, 2, 2, 3]
    assert ids.valid.tolist() == [True, False, True, True]
    scores = arrow_to_column(pa.array([[0.5], [1.5, None]], pa.large_list(pa.float64())))
    assert scores.values.dtype == np.float32 and scores.values.tolist() == [0.5, 1.5, 0.0]
    assert scores.valid is None


def test_null_entries_backed_by_sublists_and_slices():
    # Row 1 is null but its offsets still span values [2, 5): those must not leak out.
    offsets = pa.array([0, 2, 5, 6, 8], pa.int32())
    values = pa.array(np.arange(10, 18, dtype=np.int64))
    array = pa.ListArray.from_arrays(offsets, values, mask=pa.array([False, True, False, False]))
    assert len(array.values) == 8  # the hidden sublist is there
    column = arrow_to_column(array)
    assert column.values.tolist() == [10, 11, 15, 16, 17]
    assert column.offsets.tolist() == [0, 2, 2, 3, 5]
    for start, length in [(1, 3), (2, 2), (1, 1), (4, 0)]:
        part = array.slice(start, length)
        assert_matches(arrow_to_column(part), pa.chunked_array([part], type=array.type))


def test_chunked_arrays():
    typ = pa.list_(pa.int64())
    a = pa.array([[1], None, [2, 3]], typ)
    b = pa.ListArray.from_arrays(pa.array([0, 3, 4, 6], pa.int32()), pa.array(np.arange(6, dtype=np.int64)),
                                 mask=pa.array([True, False, False])).slice(1)
    chunked = pa.chunked_array([a.slice(1), b, pa.array([], typ)], type=typ)
    column = arrow_to_column(chunked)
    assert column.values.tolist() == [2, 3, 3, 4, 5]
    assert_matches(column, chunked)
    dense = pa.chunked_array([pa.array([1.0, None]), pa.array([2.0]).slice(1), pa.array([4.0, 5.0]).slice(1)])
    assert_matches(arrow_to_column(dense), dense)
    empty = arrow_to_column(pa.chunked_array([], type=typ))
    assert len(empty) == 0 and empty.offsets.tolist() == [0]
    single = pa.chunked_array([pa.array([7, None, 9]).slice(1)])
    assert_matches(arrow_to_column(single), single)


def test_column_kinds_and_unsupported_types():
    assert column_kind(pa.float32()) == "float" and column_kind(pa.uint64()) == "int"
    assert column_kind(pa.large_list(pa.int8())) == "id_list"
    assert column_kind(pa.list_(pa.float16())) == "float_list"
    assert column_kind(pa.list_(pa.string())) == "other:list<item: string>"
    assert column_kind(pa.bool_()) == "other:bool"
    with pytest.raises(TableError, match="map"):
        arrow_to_column(pa.array([[(1, 2.0)]], pa.map_(pa.int32(), pa.float32())))


def test_map_column_kinds():
    assert column_kind(pa.map_(pa.int32(), pa.float32())) == "map:float"
    assert column_kind(pa.map_(pa.int64(), pa.list_(pa.int64()))) == "map:id_list"
    assert column_kind(pa.map_(pa.int32(), pa.map_(pa.int64(), pa.float32()))) == "map:scored"
    assert column_kind(pa.map_(pa.string(), pa.float32())) == "other:map<string, float>"
    assert column_kind(pa.map_(pa.int32(), pa.string())) == "other:map<int32, string>"
