"""Coalesced split reads: planning from file metadata, request counts, identical data,
ORC tail parsing and codecs, and the slow-storage simulation."""
from __future__ import annotations

import io
import math
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.orc as paorc
import pyarrow.parquet as pq
import pytest

from remoteloader.columns import DenseColumn
from remoteloader.tools.datagen import generate_table
from remoteloader.formats import (DEFAULT_COALESCE_GAP, IOStats, TableError, clear_tail_cache, list_table,
                                  read_split)
from remoteloader.formats import orc_layout, split
from remoteloader.formats.prefetch import PrefetchedFile, merge_ranges
from remoteloader.formats.slowfs import SLOW_IO, split_slow_uri

FEATURES = dict(dense=250, sparse=200, scored=50)  # 500 features, 553 columns


@pytest.fixture(scope="module", params=["orc", "parquet"])
def wide(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(f"wide-{request.param}") / "t"
    generate_table(str(out), 400, format=request.param, stripe_rows=100, seed=4, progress=False, **FEATURES)
    return request.param, out


def projection(columns: list[str], share: float = 0.1, seed: int = 0) -> list[str]:
    """label plus a random ``share`` of the feature columns (a scored feature with its scores)."""
    features = [c for c in columns if c not in ("row_id", "label", "ts") and not c.endswith("_scores")]
    rng = np.random.default_rng(seed)
    picked = sorted(rng.choice(len(features), int(len(features) * share), replace=False))
    names = ["label"]
    for i in picked:
        names.append(features[i])
        if features[i].startswith("idscore_"):
            names.append(features[i] + "_scores")
    return names


class CountingFile(io.RawIOBase):
    """A local file counting the reads pyarrow makes (one read = one storage request)."""

    def __init__(self, path: str):
        super().__init__()
        self._f = open(path, "rb")
        self.reads: list[tuple[int, int]] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def read(self, n: int = -1) -> bytes:
        position = self._f.tell()
        data = self._f.read(n)
        self.reads.append((position, len(data)))
        return data

    def close(self) -> None:
        self._f.close()
        super().close()


def plain_reads_per_unit(path: str, fmt: str, unit: int, columns: list[str]) -> int:
    """Reads plain pyarrow makes for one stripe / row group (after opening the file)."""
    counting = CountingFile(path)
    source = pa.PythonFile(counting, mode="r")
    if fmt == "orc":
        reader = paorc.ORCFile(source)
        counting.reads.clear()
        reader.read_stripe(unit, columns=columns)
    else:
        reader = pq.ParquetFile(source, pre_buffer=False)
        counting.reads.clear()
        reader.read_row_group(unit, columns=columns)
    return len(counting.reads)


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        x, y = a[name], b[name]
        assert type(x) is type(y)
        np.testing.assert_array_equal(x.values, y.values)
        assert (x.valid is None) == (y.valid is None)
        if x.valid is not None:
            np.testing.assert_array_equal(x.valid, y.valid)
        if not isinstance(x, DenseColumn):
            np.testing.assert_array_equal(x.offsets, y.offsets)


@pytest.fixture
def unplanned(monkeypatch) -> list[PrefetchedFile]:
    """Every PrefetchedFile that split reads make, to check nothing was read unplanned."""
    made: list[PrefetchedFile] = []

    class Recording(PrefetchedFile):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(split, "PrefetchedFile", Recording)
    return made


# -- range planning ---------------------------------------------------------------------

def test_merge_ranges():
    ranges = [(100, 200), (0, 10), (205, 300), (1000, 1100), (150, 160), (300, 300)]
    assert merge_ranges(ranges, 0) == [(0, 10), (100, 200), (205, 300), (1000, 1100)]
    assert merge_ranges(ranges, 5) == [(0, 10), (100, 300), (1000, 1100)]
    assert merge_ranges(ranges, 90) == [(0, 300), (1000, 1100)]
    assert merge_ranges(ranges, 700) == [(0, 1100)]
    assert merge_ranges([], 10) == []


def test_prefetched_file_serves_fetched_ranges_and_counts_the_rest(tmp_path):
    data = bytes(range(256)) * 40
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    stats = IOStats()
    with pa.OSFile(str(path)) as source:
        f = PrefetchedFile(source, len(data), stats)
        f.fetch([(10, 100), (200, 300)])
        f.fetch([(50, 250)])  # only the hole [100, 200) is new
        assert (stats.requests, stats.bytes_requested) == (3, 290)
        f.add(5000, data[5000:5100])
        f.seek(20)
        assert bytes(f.read(260)) == data[20:280] and f.unplanned == 0  # spans three pieces
        f.seek(5050)
        assert bytes(f.read(50)) == data[5050:5100]
        f.seek(400)
        assert bytes(f.read(10)) == data[400:410] and f.unplanned == 1 and stats.requests == 4
        assert f.seek(0, io.SEEK_END) == len(data) and f.read(5) == b""
        with pytest.raises(TableError, match="short read"):  # the file is shorter than listed
            PrefetchedFile(source, len(data) + 10, stats).fetch([(len(data) - 5, len(data) + 10)])


def test_io_stats():
    a = IOStats(3, 300, 200, 1)
    a.add(IOStats(1, 10, 10, 1))
    assert a.to_dict() == {"requests": 4, "bytes_requested": 310, "bytes_needed": 210, "splits": 2}


# -- identical data, request counts -----------------------------------------------------

def test_coalesced_and_uncoalesced_reads_are_identical(wide, unplanned):
    fmt, out = wide
    files = list_table(str(out))
    columns = projection(list(pq.read_schema(files[0].path).names) if fmt == "parquet"
                         else paorc.ORCFile(files[0].path).schema.names)
    for f in files[:2]:
        for first, stop in [(0, 1), (1, 4), (3, 4)]:
            reads = [read_split(f, first, stop, columns, coalesce_gap=gap) for gap in (0, 4096, DEFAULT_COALESCE_GAP, 1 << 40)]
            for other in reads[1:]:
                assert_same(reads[0], other)
    assert unplanned and all(p.unplanned == 0 for p in unplanned)


def test_request_counts_of_a_ten_percent_projection(wide, unplanned):
    """With coalescing: at most ceil(bytes_needed / gap) + a small constant requests per
    split; without: one request per column stream / chunk, exactly what plain pyarrow reads."""
    fmt, out = wide
    f = list_table(str(out))[0]
    names = paorc.ORCFile(f.path).schema.names if fmt == "orc" else pq.read_schema(f.path).names
    columns = projection(names)
    assert len(columns) >= 50
    for unit in range(len(f.units)):
        # ORC: the stripe footer + one read per stream (about 1.6 per column);
        # Parquet: one read per column chunk (without pyarrow's own pre-buffering).
        plain = plain_reads_per_unit(f.path, fmt, unit, columns)
        assert plain >= len(columns)
        stripe_footer = 1 if fmt == "orc" else 0
        for gap in (0, DEFAULT_COALESCE_GAP, 64 << 10):
            clear_tail_cache()
            stats = IOStats()
            read_split(f, unit, unit + 1, columns, coalesce_gap=gap, io_stats=stats)
            # A warm tail cache saves the tail requests (two when the footer is over 64 KiB).
            warm = IOStats()
            read_split(f, unit, unit + 1, columns, coalesce_gap=gap, io_stats=warm)
            assert stats.requests - warm.requests in (1, 2) and warm.splits == 1
            if gap == 0:
                assert warm.requests == plain
                assert warm.bytes_requested <= warm.bytes_needed  # the cached tail may hold some
            elif gap == DEFAULT_COALESCE_GAP:
                assert warm.requests <= math.ceil(warm.bytes_needed / gap) + stripe_footer + 1
            else:  # merged ranges are more than a gap apart
                assert warm.requests <= math.ceil(f.units[unit].nbytes / gap) + stripe_footer + 1
                assert warm.requests < plain / 2
    assert all(p.unplanned == 0 for p in unplanned)
    # Coalesced with the default gap, a whole file is a few requests per stripe.
    clear_tail_cache()
    stats = IOStats()
    read_split(f, 0, len(f.units), columns, io_stats=stats)
    assert stats.requests <= 2 + 2 * len(f.units)  # tail (1-2), per stripe: footer + data


def test_whole_small_file_comes_with_the_tail(tmp_path, unplanned):
    path = tmp_path / "small.orc"
    paorc.write_table(pa.table({"x": np.arange(100), "y": np.arange(100) * 0.5}), str(path))
    (f,) = list_table(str(path))
    clear_tail_cache()
    stats = IOStats()
    got = read_split(f, 0, 1, ["y"], io_stats=stats)
    assert got["y"].values.tolist() == (np.arange(100) * 0.5).tolist()
    assert stats.requests == 1 and stats.bytes_requested == f.nbytes
    assert unplanned[-1].unplanned == 0


# -- ORC layout --------------------------------------------------------------------------

@pytest.mark.parametrize("compression", ["UNCOMPRESSED", "ZLIB", "SNAPPY", "LZ4", "ZSTD"])
def test_orc_codecs(tmp_path, compression, monkeypatch, unplanned):
    """Tails and stripe footers of every codec pyarrow writes parse, compressed chunks
    included, and split reads decode from the planned ranges alone."""
    seen = []
    original = orc_layout._decompress_chunk

    def spy(chunk, codec, block_size):
        seen.append(codec)
        return original(chunk, codec, block_size)

    monkeypatch.setattr(orc_layout, "_decompress_chunk", spy)
    rng = np.random.default_rng(0)
    n = 60000
    table = pa.table({f"c{i:03d}": rng.integers(0, 1 << 40, n) for i in range(8)} |
                     {"ids": pa.ListArray.from_arrays(np.arange(0, 2 * n + 1, 2, dtype=np.int32), rng.integers(0, 9, 2 * n))})
    path = tmp_path / "c.orc"
    paorc.write_table(table, str(path), compression=compression, stripe_size=64 << 10, batch_size=1000)
    (f,) = list_table(str(path))
    assert len(f.units) > 2
    for unit in range(len(f.units)):
        got = read_split(f, unit, unit + 1, ["c007", "ids", "c005"], coalesce_gap=0)
        lo = f.units[unit].first_row
        assert got["c005"].values.tolist() == table["c005"].to_numpy()[lo:lo + f.units[unit].num_rows].tolist()
    assert all(p.unplanned == 0 for p in unplanned)
    if compression not in ("UNCOMPRESSED", "LZ4"):  # LZ4 leaves these small footers as they are
        assert compression.lower() in seen
    data = path.read_bytes()
    tail = orc_layout.parse_tail(data[-orc_layout.tail_length(data[-300:]):])
    assert [(s.rows, s.index_length + s.data_length + s.footer_length) for s in tail.stripes] == [
        (u.num_rows, u.nbytes) for u in f.units]
    assert tail.columns["ids"] == range(9, 11) and tail.columns["c000"] == range(1, 2)
    for stripe in tail.stripes:  # the numpy stream-list decoder agrees with the generic parser
        raw = orc_layout.decompress(data[stripe.footer_offset:stripe.footer_offset + stripe.footer_length],
                                    tail.compression, tail.block_size)
        fast, slow = orc_layout._stream_fields(raw), orc_layout._stream_fields_slowly(raw)
        assert fast is not None and all(np.array_equal(a, b) for a, b in zip(fast, slow))
        streams = orc_layout.parse_stripe_footer(data[stripe.footer_offset:stripe.footer_offset + stripe.footer_length],
                                                 stripe, tail.compression, tail.block_size)
        assert streams.offset[0] == stripe.offset and {1, 2, 6} <= set(streams.kind.tolist())  # DATA, LENGTH, ROW_INDEX


@pytest.mark.parametrize("codec", ["zlib", "snappy", "zstd", "lz4"])
def test_orc_chunk_decompression(codec):
    """Chunked ORC compression: 3-byte headers, compressed and original chunks mixed."""
    import zlib

    def compress(data: bytes) -> bytes:
        if codec == "zlib":
            c = zlib.compressobj(wbits=-15)
            return c.compress(data) + c.flush()
        return pa.Codec({"lz4": "lz4_raw"}.get(codec, codec)).compress(data, asbytes=True)

    def chunk(payload: bytes, original: bool) -> bytes:
        return ((len(payload) << 1) | original).to_bytes(3, "little") + payload

    parts = [b"stream list " * 500, bytes(range(256)) * 3, b"x" * 70000]
    raw = chunk(compress(parts[0]), False) + chunk(parts[1], True) + chunk(compress(parts[2]), False)
    assert orc_layout.decompress(raw, codec, 1 << 17) == b"".join(parts)


def test_orc_nested_column_ids():
    # struct<a:int, m:map<int, list<int>>, b:float>: 0 root, 1 a, 2 m, 3 key, 4 value, 5 item, 6 b
    types = [([1, 2, 6], ["a", "m", "b"]), ([], []), ([3, 4], []), ([], []), ([5], []), ([], []), ([], [])]
    assert orc_layout._top_level_columns(types) == {"a": range(1, 2), "m": range(2, 6), "b": range(6, 7)}


def test_orc_garbage_is_a_table_error(tmp_path):
    with pytest.raises(TableError):
        orc_layout.tail_length(b"\x00" * 100)
    with pytest.raises(TableError, match="truncated"):
        orc_layout.decompress(b"\x10\x00\x00abc", "snappy", 1 << 16)


# -- slow storage ------------------------------------------------------------------------

def test_slow_uri_parsing():
    inner, slow = split_slow_uri("slow+file:///data/t?profile=hdd")
    assert inner == "file:///data/t" and (slow.latency, slow.bandwidth) == (0.008, 150e6)
    inner, slow = split_slow_uri("slow+s3://b/t?endpoint_override=h:1&profile=object_store&latency_ms=5&scheme=http")
    assert inner == "s3://b/t?endpoint_override=h%3A1&scheme=http" and (slow.latency, slow.bandwidth) == (0.005, 80e6)
    inner, slow = split_slow_uri("slow+file:///t?latency_ms=1&mbps=10")
    assert (slow.latency, slow.bandwidth) == (0.001, 10e6)
    for bad in ["slow+file:///t", "slow+file:///t?profile=tape", "slow+file:///t?latency_ms=x&mbps=1"]:
        with pytest.raises(TableError):
            split_slow_uri(bad)


def test_slow_filesystem_adds_latency_and_counts(wide):
    fmt, out = wide
    columns = ["label", "float_3", "idlist_5", "idlist_150"]
    fast = list_table(str(out), partitions=["ds=2026-01-01"])[0]
    files = list_table(f"slow+{out.as_uri()}?latency_ms=10&mbps=100", partitions=["ds=2026-01-01"])
    assert files[0].path.startswith("slow+file:///") and files[0].path.endswith("?latency_ms=10&mbps=100")
    for gap in (0, DEFAULT_COALESCE_GAP):
        clear_tail_cache()
        SLOW_IO.reset()
        stats = IOStats()
        start = time.perf_counter()
        got = read_split(files[0], 0, 2, columns, coalesce_gap=gap, io_stats=stats)
        elapsed = time.perf_counter() - start
        assert_same(got, read_split(fast, 0, 2, columns))
        counted = SLOW_IO.snapshot()
        assert counted["requests"] == stats.requests and counted["bytes"] == stats.bytes_requested
        assert elapsed >= 0.01 * stats.requests + stats.bytes_requested / 100e6
        if gap == 0:
            slow_requests = stats.requests
    assert stats.requests < slow_requests  # coalescing pays fewer latencies


def test_slow_filesystem_bandwidth(tmp_path):
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"x": np.random.default_rng(0).random(400_000)}), str(path), compression="none")
    (f,) = list_table(f"slow+{path.as_uri()}?latency_ms=0&mbps=32")
    clear_tail_cache()
    start = time.perf_counter()
    read_split(f, 0, 1, ["x"])
    assert time.perf_counter() - start >= 3.2e6 / 32e6 * 0.9
