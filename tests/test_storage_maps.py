"""Map-column tables: the generator's map layout, virtual-column reads, and flattening."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from remoteloader.columns import DenseColumn, SparseColumn
from remoteloader.tools.datagen import generate_table, map_key
from remoteloader.formats import (TableError, column_kind, flat_name, list_table, read_split, table_schema,
                                  virtual_column_kind)
from remoteloader.formats import maps
from remoteloader.storage import flatten_table
from remoteloader.storage import flatten as flatten_module
from remoteloader.storage import orc_stripes
from tests.test_storage_reorder import RecordingBar

GEN = dict(rows=3000, partitions=2, dense=4, sparse=5, scored=2, seed=9, stripe_rows=500, row_group_rows=500,
           progress=False)
MAPS = {"float_features": "map:float", "id_list_features": "map:id_list", "id_score_list_features": "map:scored"}


@pytest.fixture(scope="module", params=["orc", "parquet"])
def tables(request, tmp_path_factory) -> tuple[str, Path, Path, Path]:
    """(format, flat table, map table, the map table flattened), same seed."""
    root = tmp_path_factory.mktemp(f"maps-{request.param}")
    generate_table(str(root / "flat"), format=request.param, **GEN)
    generate_table(str(root / "map"), format=request.param, layout="map", **GEN)
    flatten_table(str(root / "map"), str(root / "flattened"), progress=False)
    return request.param, root / "flat", root / "map", root / "flattened"


def same_names() -> dict[str, tuple[str, str]]:
    """flat column -> (virtual column of the map table, column of the flattened table)."""
    out = {}
    for i in range(4):
        out[f"float_{i}"] = (f"float_features[{map_key(i)}]", f"float_features_{map_key(i)}")
    for i in range(5):
        out[f"idlist_{i}"] = (f"id_list_features[{map_key(i)}]", f"id_list_features_{map_key(i)}")
    for i in range(2):
        k = map_key(i)
        out[f"idscore_{i}"] = (f"id_score_list_features[{k}].ids", f"id_score_list_features_{k}_ids")
        out[f"idscore_{i}_scores"] = (f"id_score_list_features[{k}].scores", f"id_score_list_features_{k}_scores")
    return out


def assert_same(x, y) -> None:
    assert type(x) is type(y)
    assert x.values.dtype == y.values.dtype
    np.testing.assert_array_equal(x.values, y.values)
    assert (x.valid is None) == (y.valid is None)
    if x.valid is not None:
        np.testing.assert_array_equal(x.valid, y.valid)
    if isinstance(x, SparseColumn):
        np.testing.assert_array_equal(x.offsets, y.offsets)


def test_map_layout_schema(tables):
    _, _, map_table, _ = tables
    schema = table_schema(list_table(str(map_table)))
    assert schema == {"row_id": "int", "label": "float", "ts": "int", **MAPS}


def test_map_reads_equal_flat_and_flattened_reads(tables):
    _, flat, map_table, flattened = tables
    names = same_names()
    for f, m, g in zip(list_table(str(flat)), list_table(str(map_table)), list_table(str(flattened))):
        assert [u.num_rows for u in f.units] == [u.num_rows for u in m.units] == [u.num_rows for u in g.units]
        for first, stop in [(0, 1), (1, len(f.units))]:
            a = read_split(f, first, stop, ["row_id", "label", *names])
            b = read_split(m, first, stop, ["row_id", "label", *(v for v, _ in names.values())])
            c = read_split(g, first, stop, ["row_id", "label", *(c for _, c in names.values())])
            for flat_column, (virtual, flattened_column) in names.items():
                assert_same(a[flat_column], b[virtual])
                assert_same(a[flat_column], c[flattened_column])
            assert_same(a["row_id"], b["row_id"])


def test_flattened_schema_and_absent_keys(tables):
    _, _, map_table, flattened = tables
    schema = table_schema(list_table(str(flattened)))
    expected = {"row_id": "int", "label": "float", "ts": "int"}
    expected.update({f"float_features_{map_key(i)}": "float" for i in range(4)})
    expected.update({f"id_list_features_{map_key(i)}": "id_list" for i in range(5)})
    for i in range(2):
        expected.update({f"id_score_list_features_{map_key(i)}_ids": "id_list",
                         f"id_score_list_features_{map_key(i)}_scores": "float_list"})
    assert schema == expected and list(schema) == list(expected)
    # A key missing from the map table reads as an all-null column, like a null feature.
    (m,) = list_table(str(map_table), partitions=["ds=2026-01-01"])
    got = read_split(m, 0, 1, ["float_features[99999]", "id_list_features[5]"])
    assert not got["float_features[99999]"].valid.any() and not got["id_list_features[5]"].values.size


def test_flatten_report_and_conversion(tables, tmp_path):
    fmt, flat, map_table, _ = tables
    other = "parquet" if fmt == "orc" else "orc"
    report = flatten_table(str(map_table), str(tmp_path / "out"), progress=False, format=other, stripe_rows=1000)
    assert (report.files, report.rows, report.columns) == (2, 3000, 3 + 4 + 5 + 4)
    assert report.keys == {"float_features": 4, "id_list_features": 5, "id_score_list_features": 2}
    assert report.values_verified > 3000 and "verified" in str(report)
    files = list_table(str(tmp_path / "out"))
    assert [Path(f.path).suffix for f in files] == [f".{other}"] * 2
    assert [f.partition for f in files] == ["ds=2026-01-01", "ds=2026-01-02"]
    assert all(u.num_rows == 1000 for f in files for u in f.units[:-1])
    name = f"id_list_features_{map_key(4)}"
    a = read_split(files[1], 0, len(files[1].units), [name])[name]
    reference = list_table(str(flat))[1]
    assert_same(read_split(reference, 0, len(reference.units), ["idlist_4"])["idlist_4"], a)


def test_flatten_refuses_bad_destinations_and_flat_tables(tables, tmp_path):
    _, flat, map_table, _ = tables
    with pytest.raises(TableError, match="outside"):
        flatten_table(str(map_table), str(map_table / "flat"), progress=False)
    with pytest.raises(TableError, match="no map columns"):
        flatten_table(str(flat), str(tmp_path / "x"), progress=False)


def test_flatten_verification_catches_a_wrong_conversion(tables, tmp_path, monkeypatch):
    _, _, map_table, _ = tables
    original = flatten_module.extract

    def off_by_one(array, kind, wanted):
        out = original(array, kind, wanted)
        first = wanted[0].name
        column = out[first]
        out[first] = DenseColumn(column.values + 1, column.valid) if isinstance(column, DenseColumn) else column
        return out

    monkeypatch.setattr(flatten_module, "extract", off_by_one)
    with pytest.raises(TableError, match="differ from the source"):
        flatten_table(str(map_table), str(tmp_path / "bad"), progress=False)
    assert not [p for p in (tmp_path / "bad").rglob("*") if p.is_file()]  # the failed file is gone


def test_virtual_column_kinds_and_errors(tables):
    _, _, map_table, _ = tables
    schema = table_schema(list_table(str(map_table)))
    assert virtual_column_kind(schema, "float_features[107]") == "float"
    assert virtual_column_kind(schema, "id_list_features[-3]") == "id_list"
    assert virtual_column_kind(schema, "id_score_list_features[1].ids") == "id_list"
    assert virtual_column_kind(schema, "id_score_list_features[1].scores") == "float_list"
    for name in ["id_score_list_features[1]", "float_features[1].ids", "label[1]", "nope[1]", "float_features", "x[a]"]:
        assert virtual_column_kind(schema, name) is None
    assert flat_name("id_score_list_features[12].scores") == "id_score_list_features_12_scores"
    assert flat_name("float_features[7]") == "float_features_7" and flat_name("label") == "label"
    f = list_table(str(map_table))[0]
    with pytest.raises(TableError, match=r"units \[0, 1\).*'id_score_list_features' is map:scored.*\.ids"):
        read_split(f, 0, 1, ["id_score_list_features[100]"])
    with pytest.raises(TableError, match="no column 'nope\\[1\\]'"):
        read_split(f, 0, 1, ["nope[1]"])
    with pytest.raises(TableError, match="'label' is float"):
        read_split(f, 0, 1, ["label[1]"])


def python_extract(array: pa.Array, key: int, part):
    """The per-row reference: each row's first entry with the key."""
    rows = []
    for entries in array.to_pylist():
        value = None
        for k, v in entries or []:
            if k == key:
                value = v
                break
        if value is not None and part is not None:
            value = [x[0] if part == "ids" else x[1] for x in value]
        rows.append(value)
    return rows


@pytest.mark.parametrize("kind", ["map:float", "map:id_list", "map:scored"])
def test_extraction_matches_a_per_row_reference(kind):
    """Nulls (rows, items), duplicate keys, slices and chunks, against plain Python."""
    rng = np.random.default_rng(1)
    n = 300
    rows = []
    for _ in range(n):
        if rng.random() < 0.1:
            rows.append(None)
            continue
        keys = list(rng.integers(0, 6, rng.integers(0, 5)))
        entries = []
        for k in keys:
            if kind == "map:float":
                value = None if rng.random() < 0.1 else float(rng.random())
            elif kind == "map:id_list":
                value = None if rng.random() < 0.1 else [int(x) for x in rng.integers(0, 99, rng.integers(0, 4))]
            else:
                value = [(int(x), float(np.float32(rng.random()))) for x in rng.integers(0, 99, rng.integers(0, 4))]
            entries.append((int(k), value))
        rows.append(entries)
    item = {"map:float": pa.float32(), "map:id_list": pa.list_(pa.int64()),
            "map:scored": pa.map_(pa.int64(), pa.float32())}[kind]
    array = pa.array(rows, pa.map_(pa.int32(), item))
    assert column_kind(array.type) == kind
    chunked = pa.chunked_array([array.slice(0, 100), array.slice(100, 150).slice(7), array.slice(107)])
    parts = ["ids", "scores"] if kind == "map:scored" else [None]
    wanted = [maps.Virtual(f"k{k}{p}", "m", k, p) for k in range(7) for p in parts]
    for source in (array, chunked, array.slice(33, 200)):
        got = maps.extract(source, kind, wanted)
        flat = source.to_pylist() if isinstance(source, pa.Array) else [r for c in source.chunks for r in c.to_pylist()]
        plain = pa.array(flat, source.type)
        for v in wanted:
            expected = python_extract(plain, v.key, v.part)
            column = got[v.name]
            valid = np.array([e is not None for e in expected])
            assert np.array_equal(valid, np.ones(len(flat), bool) if column.valid is None else column.valid)
            if kind == "map:float":
                np.testing.assert_allclose(column.values, [0 if e is None else e for e in expected])
            else:
                assert np.array_equal(np.diff(column.offsets), [len(e or []) for e in expected])
                np.testing.assert_allclose(column.values, [x for e in expected for x in e or []])


def test_flatten_progress_advances_per_stripe(tables, tmp_path, monkeypatch):
    """Each bar moves once per stripe / row group: keys scanned per source unit, then per
    file each output unit as it is written and each written unit as it is verified."""
    _, _, map_table, _ = tables
    recorded: list[RecordingBar] = []
    monkeypatch.setattr(flatten_module, "progress_bar", lambda *a: RecordingBar(recorded, *a))
    flatten_table(str(map_table), str(tmp_path / "kept"))  # 2 files of 3 units of 500 rows
    flatten_table(str(map_table), str(tmp_path / "big"), stripe_rows=1000)  # 1000 + 500 rows a file
    assert [bar.updates for bar in recorded] == [[500] * 6, [500] * 3 * 2 * 2, [500] * 6, [1000, 500] * 2 * 2]


def test_flatten_encodes_each_row_once_in_bounded_batches(tables, tmp_path, orc_encoders):
    """The growth's cause, checked without timings (issue 38): whatever the stripe size,
    the ORC encoder gets batches of at most BATCH_ROWS rows (Arrow's adapter copies a
    batch's list values on every row it adds), one encoder per output stripe, each row once."""
    _, _, map_table, _ = tables
    encoders = orc_encoders
    report = flatten_table(str(map_table), str(tmp_path / "out"), progress=False, format="orc", stripe_rows=1500)
    assert [[u.num_rows for u in f.units] for f in list_table(str(tmp_path / "out"))] == [[1500], [1500]]
    assert encoders == [{"batch_size": orc_stripes.BATCH_ROWS, "rows": 1500}] * 2 and 1500 > orc_stripes.BATCH_ROWS
    assert sum(e["rows"] for e in encoders) == report.rows
