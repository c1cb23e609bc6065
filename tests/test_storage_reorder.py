"""Feature reordering: the popularity log, the column order, rewriting a table in it; the
rewrites' stripe-by-stripe ORC writer (linear in the rows) and their progress."""
from __future__ import annotations

import decimal
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.orc as paorc
import pyarrow.parquet as pq
import pytest

from remoteloader.tools.datagen import generate_table
from remoteloader.formats import IOStats, TableError, clear_tail_cache, list_table, read_schema, read_split
from remoteloader.storage import column_order, load_popularity, orc_stripes, record_projection, reorder_table, rewrite
from remoteloader.storage import reorder as reorder_module
from remoteloader.storage.orc_stripes import OrcStripeWriter

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


# -- writing stripe by stripe (issue 38: the rewrites grew quadratically with the stripe) --

def mixed_table(n: int, seed: int = 0) -> pa.Table:
    """Every kind of column the statistics merge handles, with nulls, a sum that overflows,
    an all-null column, lists and maps (nested too)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, n)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = int(offsets[-1])
    mask = rng.random(n) < 0.1
    inner = pa.ListArray.from_arrays(pa.array(np.arange(values + 1, dtype=np.int32) // 2 * 2),
                                     pa.array(rng.integers(0, 9, values // 2 * 2 + 2)))[:values]
    return pa.table({
        "row_id": pa.array(np.arange(n)),
        "i8": pa.array(rng.integers(-100, 100, n).astype(np.int8), mask=mask),
        "big": pa.array(np.full(n, 1 << 62, np.int64)),  # its sum overflows: left out
        "f32": pa.array(rng.random(n).astype(np.float32), mask=mask),
        "f64": pa.array(rng.standard_normal(n)),
        "none": pa.nulls(n, pa.float32()),
        "s": pa.array([f"v{i % 977}" for i in range(n)], mask=mask),
        "b": pa.array(rng.random(n) < 0.3),
        "date": pa.array(rng.integers(0, 20000, n).astype(np.int32)).cast(pa.date32()),
        "bin": pa.array([b"xy" * (i % 4) for i in range(n)], pa.binary()),
        "ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 1 << 40, values))),
        "m": pa.MapArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 50, values).astype(np.int32)),
                                     pa.array(rng.random(values).astype(np.float32))),
        "ml": pa.MapArray.from_arrays(pa.array(offsets), pa.array(np.arange(values).astype(np.int32)), inner),
    })


def test_stripe_writer_writes_the_orc_writers_own_file_byte_for_byte():
    """Stripes encoded one by one and copied, statistics merged: the very file one ORC
    writer writes with the same stripes (units large enough that it cuts them exactly)."""
    table = mixed_table(50_000)
    cuts = [(0, 20_000), (20_000, 20_000), (40_000, 10_000)]
    sink = pa.BufferOutputStream()
    reference = paorc.ORCWriter(sink, file_version=orc_stripes.ORC_FILE_VERSION, compression=orc_stripes.COMPRESSION,
                                stripe_size=1, batch_size=20_000)  # one batch per unit: the tools' former way
    for start, rows in cuts:
        reference.write(table.slice(start, rows))
    reference.close()
    expected = sink.getvalue().to_pybytes()
    sink = pa.BufferOutputStream()
    writer = OrcStripeWriter(sink)
    for start, rows in cuts:
        writer.write(table.slice(start, rows))
    writer.close(table.schema)
    got = sink.getvalue().to_pybytes()
    assert writer.stats == {"stripes": 3, "encoded_rows": 50_000, "copied_bytes": writer.stats["copied_bytes"]}
    assert got == expected
    f = paorc.ORCFile(pa.BufferReader(got))
    assert [f.read_stripe(i).num_rows for i in range(f.nstripes)] == [20_000, 20_000, 10_000]


def test_stripe_writer_exact_units_other_types_and_empty_files():
    # Small units are exact stripes (one ORC writer runs a stripe that fills no compression
    # block on into the next batch); timestamps and decimals keep their values (their file
    # statistics, which are not merged, are left out).
    table = pa.table({"t": pa.array(np.arange(60).astype("datetime64[ns]")),
                      "d": pa.array([decimal.Decimal(i) / 100 for i in range(60)], pa.decimal128(9, 2)),
                      "ids": pa.array([[i, i + 1] for i in range(60)])})
    sink = pa.BufferOutputStream()
    writer = OrcStripeWriter(sink)
    for start, rows in [(0, 1), (1, 7), (8, 0), (8, 52)]:
        writer.write(table.slice(start, rows))
    writer.close(table.schema)
    f = paorc.ORCFile(pa.BufferReader(sink.getvalue()))
    assert [f.read_stripe(i).num_rows for i in range(f.nstripes)] == [1, 7, 52]
    assert f.read().equals(table)
    sink = pa.BufferOutputStream()
    OrcStripeWriter(sink).close(table.schema)
    empty = paorc.ORCFile(pa.BufferReader(sink.getvalue()))
    assert empty.nrows == 0 and empty.schema.equals(table.schema)


@pytest.mark.parametrize("source", ["orc"], indirect=True)
def test_rewrite_encodes_each_row_once_in_bounded_batches(source, tmp_path, monkeypatch, orc_encoders):
    """What kept the rewrites quadratic, checked without timing them: the ORC encoder's
    batches (Arrow's adapter grows list buffers row by row within a batch, a copy per row)
    stay at BATCH_ROWS rows whatever the stripe size; every row is encoded once, one
    encoder per stripe; each stripe's bytes are written to the file once."""
    _, src = source
    encoders = orc_encoders
    writes: list[list[int]] = []

    class Counted(OrcStripeWriter):
        def __init__(self, sink, **options):
            sizes: list[int] = []
            writes.append(sizes)

            class Sink:
                def write(self, data):
                    sizes.append(len(data))
                    return sink.write(data)

            super().__init__(Sink(), **options)

    monkeypatch.setattr(rewrite, "OrcStripeWriter", Counted)
    columns = list(read_schema(list_table(str(src))[0]))
    report = reorder_table(str(src), str(tmp_path / "r"), columns[::-1], stripe_rows=1200, progress=False)
    files = list_table(str(tmp_path / "r"))
    assert [[u.num_rows for u in f.units] for f in files] == [[1200], [1200]]
    assert encoders == [{"batch_size": orc_stripes.BATCH_ROWS, "rows": 1200}] * 2 and 1200 > orc_stripes.BATCH_ROWS
    assert sum(e["rows"] for e in encoders) == report.rows
    # Per file: the header, each stripe once, the tail; nothing written twice.
    assert [len(w) for w in writes] == [3, 3]
    assert [sum(w) for w in writes] == [f.nbytes for f in files]


class RecordingBar:
    """Stands in for the tools' tqdm bar: records each advance."""

    def __init__(self, bars: list, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.updates = total, desc, []
        bars.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int) -> None:
        self.updates.append(n)


def test_progress_advances_per_stripe(source, tmp_path, monkeypatch):
    _, src = source
    bars: list[RecordingBar] = []
    monkeypatch.setattr(reorder_module, "progress_bar", lambda *a: RecordingBar(bars, *a))
    columns = list(read_schema(list_table(str(src))[0]))
    # Units kept (400 rows): each file's 3 stripes written, then each verified.
    reorder_table(str(src), str(tmp_path / "kept"), columns[::-1])
    # Restriped to 1200 rows: a file's one stripe written, then verified against its source's 3.
    reorder_table(str(src), str(tmp_path / "big"), columns[::-1], stripe_rows=1200)
    kept, big = bars
    assert kept.updates == [400] * 6 * 2 and sum(kept.updates) == kept.total == 2 * 2400
    assert big.updates == [1200, 400, 400, 400] * 2 and sum(big.updates) == big.total
