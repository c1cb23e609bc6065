"""Feature reordering: the popularity log, the column order, rewriting a table in it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.orc as paorc
import pyarrow.parquet as pq
import pytest

from remoteloader.tools.datagen import generate_table
from remoteloader.formats import IOStats, TableError, clear_tail_cache, list_table, read_schema, read_split
from remoteloader.storage import column_order, load_popularity, record_projection, reorder_table

GEN = dict(rows=2400, partitions=2, dense=30, sparse=30, scored=5, seed=21, stripe_rows=400, row_group_rows=400,
           progress=False)


def read_all(table: Path) -> pa.Table:
    files = [f.path for f in list_table(str(table))]
    return pa.concat_tables([paorc.read_table(f) if f.endswith(".orc") else pq.read_table(f) for f in files])


@pytest.fixture(scope="module", params=["orc", "parquet"])
def source(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(f"reorder-{request.param}") / "t"
    generate_table(str(out), format=request.param, **GEN)
    return request.param, out


def test_popularity_log(tmp_path):
    log = tmp_path / "journal" / "popularity.jsonl"
    record_projection(str(log), "/t", ["label", "float_1", "idlist_2"], now=100.0)
    record_projection(str(log), "/t", ["label", "idlist_2", "idlist_2"], now=200.0)
    record_projection(str(log), "/other", ["label", "float_9"], now=300.0)
    with open(log, "a") as f:
        f.write('{"time": 400, "table": "/t", "colu')  # torn by a crash
    lines = log.read_text().splitlines()
    assert json.loads(lines[0]) == {"time": 100.0, "table": "/t", "columns": ["label", "float_1", "idlist_2"]}
    assert load_popularity(str(log), now=1000) == {"label": 3, "float_1": 1, "idlist_2": 2, "float_9": 1}
    assert load_popularity(str(log), window_s=150, now=310) == {"label": 2, "idlist_2": 1, "float_9": 1}
    assert load_popularity(str(log), table="/t") == {"label": 2, "float_1": 1, "idlist_2": 2}
    assert load_popularity(str(tmp_path / "missing.jsonl")) == {}


def test_column_order():
    schema = ["row_id", "label", "ts", "a", "b", "c", "m_5", "m_7_ids", "m_7_scores", "d"]
    popularity = {"c": 5, "label": 9, "m[5]": 2, "m[7].ids": 4, "m[7].scores": 4, "b": 2, "zzz": 7}
    assert column_order(schema, popularity) == [
        "row_id", "label", "ts", "c", "m_7_ids", "m_7_scores", "b", "m_5", "a", "d"]
    assert column_order(["x", "label"], {}) == ["label", "x"]


def test_reorder_keeps_every_value_and_changes_only_layout(source, tmp_path):
    fmt, src = source
    columns = list(read_schema(list_table(str(src))[0]))
    popular = ["idlist_7", "float_20", "idscore_3", "idscore_3_scores", "float_2"]
    order = column_order(columns, {c: 10 - i for i, c in enumerate(popular)})
    report = reorder_table(str(src), str(tmp_path / "r"), order, progress=False)
    assert report.verified and report.files == 2 and report.rows == 2400 and report.columns == len(columns)
    files = list_table(str(tmp_path / "r"))
    assert list(read_schema(files[0])) == order == ["row_id", "label", "ts", *popular,
                                                    *[c for c in columns[3:] if c not in popular]]
    # Same units (the default keeps the source's), same values in every column.
    assert [[u.num_rows for u in f.units] for f in files] == [[u.num_rows for u in f.units] for f in list_table(str(src))]
    assert read_all(tmp_path / "r").select(columns).equals(read_all(src))
    # The writer can produce the reordered layout directly.
    direct = tmp_path / "direct"
    generate_table(str(direct), format=fmt, column_order=order, **GEN)
    assert read_all(direct).equals(read_all(tmp_path / "r"))


def test_reorder_with_new_units(source, tmp_path):
    fmt, src = source
    columns = list(read_schema(list_table(str(src))[0]))
    reorder_table(str(src), str(tmp_path / "big"), columns[::-1], stripe_rows=1200, progress=False)
    files = list_table(str(tmp_path / "big"))
    assert [[u.num_rows for u in f.units] for f in files] == [[1200], [1200]]
    assert list(read_schema(files[0]))[:3] == columns[::-1][:3]
    assert read_all(tmp_path / "big").select(columns).equals(read_all(src))
    with pytest.raises(TableError, match="no column 'nope'"):
        reorder_table(str(src), str(tmp_path / "x"), ["nope"], progress=False)


def test_reordering_cuts_the_over_read_of_a_popular_projection(source, tmp_path):
    """Coalesced reads of a projection scattered over the schema read whole stripes;
    stored together, the same projection reads little more than it needs."""
    fmt, src = source
    columns = list(read_schema(list_table(str(src))[0]))
    rng = np.random.default_rng(0)
    projection = ["label"] + [columns[i] for i in sorted(rng.choice(np.arange(3, len(columns)), 8, replace=False))]
    reorder_table(str(src), str(tmp_path / "r"), column_order(columns, {c: 1 for c in projection}), progress=False)
    ratios = {}
    for name, table in (("before", src), ("after", tmp_path / "r")):
        clear_tail_cache()
        files = list_table(str(table))
        for f in files:  # file tails are read once per file (and cached): leave them out
            read_split(f, 0, 1, ["label"])
        stats = IOStats()
        for f in files:
            for unit in range(len(f.units)):
                read_split(f, unit, unit + 1, projection, io_stats=stats)
        ratios[name] = stats.bytes_requested / stats.bytes_needed
    assert ratios["after"] < 1.3 < ratios["before"]
