"""The synthetic table generator: shape, statistics, layout and determinism."""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.orc as paorc
import pyarrow.parquet as pq
import pytest

from remoteloader.tools import datagen
from remoteloader.tools.datagen import generate_table

ROWS = 6000


def read(path: str) -> pa.Table:
    return paorc.read_table(path) if path.endswith(".orc") else pq.read_table(path)


def read_all(files: list[str]) -> pa.Table:
    return pa.concat_tables([read(f) for f in files])


@pytest.fixture(scope="module", params=["orc", "parquet"])
def table(request, tmp_path_factory) -> tuple[str, list[str], pa.Table]:
    out = tmp_path_factory.mktemp(f"gen-{request.param}") / "t"
    files = generate_table(str(out), ROWS, partitions=2, dense=4, sparse=6, format=request.param, seed=3,
                           stripe_size=256 << 10, row_group_rows=1000, scored=2, progress=False)
    return request.param, files, read_all(files)


def test_layout_and_schema(table):
    fmt, files, t = table
    suffix = ".orc" if fmt == "orc" else ".parquet"
    assert [Path(f).relative_to(Path(f).parents[1]).as_posix() for f in files] == [
        f"ds=2026-01-01/part-00000{suffix}", f"ds=2026-01-02/part-00000{suffix}"]
    assert all(Path(f).is_absolute() for f in files)
    expected = {"row_id": pa.int64(), "label": pa.float32(), "ts": pa.int64()}
    expected.update({f"float_{i}": pa.float32() for i in range(4)})
    expected.update({f"idlist_{i}": pa.list_(pa.int64()) for i in range(6)})
    for i in range(2):
        expected[f"idscore_{i}"] = pa.list_(pa.int64())
        expected[f"idscore_{i}_scores"] = pa.list_(pa.float32())
    assert {f.name: f.type for f in t.schema} == expected
    assert t.num_rows == ROWS
    assert [read(f).num_rows for f in files] == [ROWS // 2, ROWS // 2]


def test_row_id_label_ts(table):
    _, files, t = table
    assert np.array_equal(t["row_id"].to_numpy(), np.arange(ROWS))
    label = t["label"].to_numpy()
    assert set(np.unique(label)) <= {0.0, 1.0} and t["label"].null_count == 0
    assert 0.015 < label.mean() < 0.05
    for day, f in enumerate(files):
        ts = read(f)["ts"].to_numpy()
        start = int(dt.datetime(2026, 1, 1 + day, tzinfo=dt.timezone.utc).timestamp())
        assert start <= ts.min() and ts.max() < start + 86400
        assert np.all(np.diff(ts) >= 0)  # an event log: time advances with the rows


def test_sparse_statistics(table):
    _, _, t = table
    coverages, means, longest = [], [], []
    for i in range(6):
        column = t[f"idlist_{i}"].combine_chunks()
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        lengths = column.value_lengths().to_numpy(zero_copy_only=False)[valid]
        coverages.append(valid.mean())
        means.append(lengths.mean())
        longest.append(lengths.max())
        assert lengths.min() >= 1  # a covered row has ids
        ids = column.flatten().to_numpy()
        assert ids.min() > 0
        # Zipf-like: the hottest id is far more common than uniform over the distinct ids.
        _, counts = np.unique(ids, return_counts=True)
        assert counts.max() / len(ids) > 5 / len(counts)
    assert 0.3 < np.mean(coverages) < 0.6 and max(coverages) < 1 and min(coverages) > 0
    assert len(set(np.round(coverages, 2))) > 3  # coverage varies per feature
    assert 18 < np.mean(means) < 35
    assert max(longest) > 4 * np.mean(means)  # heavy tail
    hashed = max(t[f"idlist_{i}"].combine_chunks().flatten().to_numpy().max() for i in range(6))
    assert hashed > 1 << 40  # some id spaces are large hashed int64 values


def test_scored_lists_align_with_ids(table):
    _, _, t = table
    for i in range(2):
        ids, scores = t[f"idscore_{i}"].combine_chunks(), t[f"idscore_{i}_scores"].combine_chunks()
        assert ids.is_valid().equals(scores.is_valid())
        assert ids.value_lengths().equals(scores.value_lengths())
        values = scores.flatten().to_numpy()
        assert values.dtype == np.float32 and len(values) > 0


def test_dense_columns_have_nulls_and_distinct_shapes(table):
    _, _, t = table
    coverage = [1 - t[f"float_{i}"].null_count / ROWS for i in range(4)]
    assert all(0.8 < c < 1 for c in coverage)
    count = t["float_0"].drop_null().to_numpy()
    ratio = t["float_1"].drop_null().to_numpy()
    assert np.all(count == np.floor(count)) and count.max() > 10 * np.median(count)
    assert ratio.min() >= 0 and ratio.max() <= 1


def test_units(table):
    fmt, files, _ = table
    for f in files:
        if fmt == "orc":
            assert paorc.ORCFile(f).nstripes > 1
        else:
            meta = pq.ParquetFile(f).metadata
            assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [1000, 1000, 1000]


def test_deterministic_and_seeded(tmp_path):
    kwargs = dict(rows=1500, partitions=1, dense=2, sparse=3, format="parquet", progress=False)
    a = read_all(generate_table(str(tmp_path / "a"), seed=5, **kwargs))
    b = read_all(generate_table(str(tmp_path / "b"), seed=5, **kwargs))
    c = read_all(generate_table(str(tmp_path / "c"), seed=6, **kwargs))
    assert a.equals(b)
    # Writer settings change the layout, never the rows.
    kwargs["format"] = "orc"
    d = read_all(generate_table(str(tmp_path / "d"), seed=5, stripe_size=32 << 10, **kwargs))
    assert d.equals(a)
    assert not a.select(["idlist_0"]).equals(c.select(["idlist_0"]))


def test_chunking_across_files_and_row_groups(tmp_path, monkeypatch):
    """Several generation chunks per file: rows stay contiguous and row groups exact."""
    monkeypatch.setattr(datagen, "CHUNK_ROWS", 300)
    files = generate_table(str(tmp_path / "t"), 3200, partitions=2, files_per_partition=2, dense=1, sparse=1,
                           format="parquet", row_group_rows=350, progress=False)
    assert [Path(f).name for f in files] == ["part-00000.parquet", "part-00001.parquet"] * 2
    t = read_all(files)
    assert np.array_equal(t["row_id"].to_numpy(), np.arange(3200))
    meta = pq.ParquetFile(files[0]).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [350] * 2 + [100]
    ts = pa.concat_tables([read(f) for f in files[:2]])["ts"].to_numpy()
    assert np.all(np.diff(ts) >= 0)


def test_progress_bar_on_stderr(tmp_path, capsys):
    generate_table(str(tmp_path / "t"), 100, dense=1, sparse=1, progress=True)
    assert "gen-data" in capsys.readouterr().err


def test_rewrites_own_files_but_refuses_stale_ones(tmp_path):
    out = tmp_path / "t"
    generate_table(str(out), 200, partitions=2, dense=1, sparse=1, progress=False)
    generate_table(str(out), 200, partitions=2, dense=1, sparse=1, progress=False)
    with pytest.raises(ValueError, match="ds=2026-01-02"):
        generate_table(str(out), 200, partitions=1, dense=1, sparse=1, progress=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(format="csv"), "format"),
    (dict(partitions=0), "partitions"),
    (dict(rows=3, partitions=2, files_per_partition=2), "rows"),
    (dict(sparse=-1), "negative"),
])
def test_bad_arguments(tmp_path, kwargs, message):
    args = dict(rows=100, dense=1, sparse=1, progress=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate_table(str(tmp_path / "t"), **args)


def test_map_layout_holds_the_flat_features(tmp_path):
    kwargs = dict(rows=700, dense=3, sparse=2, scored=1, seed=8, progress=False, format="parquet")
    flat = read_all(generate_table(str(tmp_path / "flat"), **kwargs))
    mapped = read_all(generate_table(str(tmp_path / "map"), layout="map", **kwargs))
    assert {f.name: f.type for f in mapped.schema} == {
        "row_id": pa.int64(), "label": pa.float32(), "ts": pa.int64(),
        "float_features": pa.map_(pa.int32(), pa.float32()),
        "id_list_features": pa.map_(pa.int32(), pa.list_(pa.int64())),
        "id_score_list_features": pa.map_(pa.int32(), pa.map_(pa.int64(), pa.float32()))}
    assert mapped.select(["row_id", "label", "ts"]).equals(flat.select(["row_id", "label", "ts"]))
    dense, lists, scored = (mapped[c].to_pylist() for c in ("float_features", "id_list_features", "id_score_list_features"))
    for row in range(0, 700, 7):
        assert [k for k, _ in dense[row]] == sorted(k for k, _ in dense[row])  # feature order
        assert dict(dense[row]) == {datagen.map_key(i): flat[f"float_{i}"][row].as_py() for i in range(3)
                                    if flat[f"float_{i}"][row].is_valid}
        assert dict(lists[row]) == {datagen.map_key(i): flat[f"idlist_{i}"][row].as_py() for i in range(2)
                                    if flat[f"idlist_{i}"][row].is_valid}
        ids, scores = flat["idscore_0"][row].as_py(), flat["idscore_0_scores"][row].as_py()
        assert dict(scored[row]) == ({} if ids is None else {datagen.map_key(0): list(zip(ids, scores))})


def test_column_order_and_stripe_rows(tmp_path):
    kwargs = dict(rows=3000, dense=2, sparse=4, seed=4, progress=False, format="orc", stripe_rows=1000)
    default = read_all(generate_table(str(tmp_path / "a"), **kwargs))
    files = generate_table(str(tmp_path / "b"), column_order=["idlist_1", "label", "float_0"], **kwargs)
    reordered = read_all(files)
    assert reordered.column_names[:6] == ["idlist_1", "label", "float_0", "row_id", "ts", "float_1"]
    assert reordered.select(default.column_names).equals(default)
    reader = paorc.ORCFile(files[0])
    assert [reader.read_stripe(i).num_rows for i in range(reader.nstripes)] == [1000] * 3
    with pytest.raises(ValueError, match="nope"):
        generate_table(str(tmp_path / "c"), column_order=["nope"], **kwargs)
    with pytest.raises(ValueError, match="layout"):
        generate_table(str(tmp_path / "d"), layout="wide", **kwargs)
