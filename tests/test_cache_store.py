"""The block cache's storage: segment format, MACs, lookups that never fail, writes,
gc and verify, on a local directory, slow storage and an S3-protocol server."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow.fs as pafs
import pytest

from remoteloader.columns import Column, DenseColumn, SparseColumn
from remoteloader.core.cache import store as store_module
from remoteloader.core.cache.segments import (BlockSigner, CorruptBlock, Unverifiable, decode_block,
                                              encode_segment, read_footer)
from remoteloader.core.cache.store import BlockStore
from remoteloader.core.cache.writer import BlockWriter
from remoteloader.formats import IOStats
from remoteloader.tools import cli

RNG = np.random.default_rng(5)
SPLIT = "ab12cd"
PLAIN = BlockSigner.plain()


def sparse(rows: int, weights: bool = False, valid: bool = False) -> SparseColumn:
    lengths = RNG.integers(0, 4, rows)
    lengths[: rows // 3] = 0  # empty rows
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = RNG.integers(0, 1 << 40, int(offsets[-1]), dtype=np.int64)
    return SparseColumn(values, offsets, RNG.random(values.shape[0], dtype=np.float32) if weights else None,
                        RNG.random(rows) > 0.3 if valid else None)


COLUMNS: dict[str, Column] = {
    "dense-f32": DenseColumn(RNG.random(37, dtype=np.float32)),
    "dense-f64-valid": DenseColumn(RNG.random(37), RNG.random(37) > 0.5),
    "dense-i64-2d": DenseColumn(RNG.integers(-9, 9, (37, 3), dtype=np.int64)),
    "dense-f32-2d-valid": DenseColumn(RNG.random((37, 4), dtype=np.float32), RNG.random(37) > 0.5),
    "dense-empty": DenseColumn(np.zeros(0, np.float32)),
    "sparse": sparse(41),
    "sparse-weights-valid": sparse(41, weights=True, valid=True),
    "sparse-weights": sparse(41, weights=True),
    "sparse-valid": sparse(41, valid=True),
    "sparse-zero-rows": SparseColumn(np.zeros(0, np.int64), np.zeros(1, np.int64)),
    "sparse-all-empty": SparseColumn(np.zeros(0, np.int64), np.zeros(6, np.int64), np.zeros(0, np.float32)),
}


def assert_same(got: Column, expected: Column) -> None:
    assert type(got) is type(expected)
    names = ("values", "valid") if isinstance(expected, DenseColumn) else ("values", "offsets", "weights", "valid")
    for name in names:
        a, b = getattr(got, name), getattr(expected, name)
        assert (a is None) == (b is None), name
        if b is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b)


def segment_bytes(blocks: dict[str, Column], signer: BlockSigner = PLAIN, split: str = SPLIT) -> bytes:
    return b"".join(encode_segment(split, blocks, signer))


def segment_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.seg"))


@pytest.fixture
def store(tmp_path) -> Iterator[BlockStore]:
    s = BlockStore(str(tmp_path / "cache"), PLAIN)
    yield s
    s.close()


# -- the format ----------------------------------------------------------------------


def test_segment_round_trip_every_shape():
    data = segment_bytes(COLUMNS)
    footer = read_footer(data, len(data), "mem")
    assert set(footer.blocks) == set(COLUMNS)
    for key, desc in footer.blocks.items():
        assert all(a.offset % 64 == 0 for a in desc.arrays)
        got = decode_block(footer, key, memoryview(data)[desc.start:desc.end], PLAIN)
        assert_same(got, COLUMNS[key])
        assert not got.values.flags.writeable  # a view of the fetched bytes, not a copy


def test_bad_blocks_are_refused_at_encode():
    with pytest.raises(ValueError, match="cannot be cached"):
        encode_segment(SPLIT, {"k": DenseColumn(np.array(["x"], dtype=object))}, PLAIN)
    with pytest.raises(ValueError, match="invalid block key"):
        encode_segment(SPLIT, {"../x": COLUMNS["sparse"]}, PLAIN)
    with pytest.raises(ValueError, match="invalid split key"):
        encode_segment("..", {"k": COLUMNS["sparse"]}, PLAIN)


def _key_positions(data: bytes, keys) -> set[int]:
    """Byte positions of the block keys' names in the footer: a flip there renames a block."""
    positions = set()
    for key in keys:
        at = data.rfind(f'"key":"{key}"'.encode()) + len('"key":"')
        positions.update(range(at, at + len(key)))
    return positions


def test_a_flipped_byte_never_decodes_to_a_wrong_column():
    blocks = {k: COLUMNS[k] for k in ("dense-f64-valid", "sparse-weights-valid", "dense-i64-2d")}
    data = segment_bytes(blocks)
    original = read_footer(data, len(data), "mem")
    renames = _key_positions(data, blocks)
    data_end = len(data) - original.nbytes
    array_bytes = {p for d in original.blocks.values() for a in d.arrays for p in range(a.offset, a.offset + a.length)}
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x01  # the smallest edit: a flip that keeps the footer's JSON valid most often
        bad = bytes(bad)
        try:
            footer = read_footer(bad, len(bad), "mem")
        except CorruptBlock:
            continue
        refused = 0
        for key in set(blocks) & footer.blocks.keys():
            desc = footer.blocks[key]
            try:
                got = decode_block(footer, key, memoryview(bad)[desc.start:desc.end], PLAIN)
            except CorruptBlock:
                refused += 1
                continue
            assert_same(got, blocks[key])  # a flip in alignment padding changes nothing
        # Only a flip in the padding, or one renaming a block (its old key then simply
        # misses), goes unrefused.
        if pos in array_bytes or (pos >= data_end and pos not in renames):
            assert refused, pos


# -- lookups -------------------------------------------------------------------------


def test_store_round_trip_and_segments_union(store):
    first = {k: COLUMNS[k] for k in ("dense-f32", "sparse", "sparse-zero-rows")}
    second = {k: COLUMNS[k] for k in ("dense-i64-2d", "sparse-weights-valid")}
    assert store.write(SPLIT, first) > 0
    assert store.write(SPLIT, second) > 0
    io = IOStats()
    got = store.lookup(SPLIT, [*first, *second, "absent"], io=io)
    assert got.found.keys() == first.keys() | second.keys() and got.missing == {"absent"}
    for key, column in {**first, **second}.items():
        assert_same(got.found[key], column)
    assert (got.hits, got.misses, got.corrupt, got.faults) == (5, 1, 0, 0)
    assert io.requests == 2 and got.bytes_read == io.bytes_requested > 0  # small segments: one tail read each
    again = store.lookup(SPLIT, list(first))  # footers cached: only the blocks' ranges
    assert again.hits == 3 and again.bytes_read < got.bytes_read
    assert store.lookup("ef34", ["x"]).missing == {"x"}  # no such split: a plain miss
    counts = store.counters.to_dict()
    assert counts["hits"] == 8 and counts["misses"] == 2 and counts["puts"] == 2 and counts["corrupt"] == 0


def test_the_newest_segment_wins(store):
    store.write(SPLIT, {"k": COLUMNS["dense-f32"]})
    time.sleep(0.002)
    store.write(SPLIT, {"k": DenseColumn(np.ones(3))})
    assert_same(store.lookup(SPLIT, ["k"]).found["k"], DenseColumn(np.ones(3)))


def test_a_flipped_byte_in_a_stored_segment_is_a_counted_miss(store, tmp_path):
    blocks = {k: COLUMNS[k] for k in ("dense-f64-valid", "sparse-weights-valid")}
    store.write(SPLIT, blocks)
    (path,) = segment_files(tmp_path)
    data = path.read_bytes()
    renames = _key_positions(data, blocks)
    path.unlink()
    for i, pos in enumerate(range(0, len(data), 7)):
        bad = bytearray(data)
        bad[pos] ^= 0x04
        target = path.with_name(f"{i:015d}-flip.seg")  # a new name: footers are cached by path
        target.write_bytes(bad)
        got = store.lookup(SPLIT, list(blocks))
        for key, column in got.found.items():
            assert_same(column, blocks[key])
        if got.missing and pos not in renames:
            assert got.corrupt >= 1, pos
        target.unlink()
    assert store.counters.corrupt > 0 and store.counters.faults == 0


def test_keyed_and_plain_signers(tmp_path):
    root = str(tmp_path)
    keyed, plain = BlockStore(root, BlockSigner.keyed(b"cluster secret")), BlockStore(root, PLAIN)
    other = BlockStore(root, BlockSigner.keyed(b"another cluster"))
    block = {"k": COLUMNS["sparse"]}
    plain.write("plain1", block)
    keyed.write("keyed1", block)
    rejected = keyed.lookup("plain1", ["k"])
    assert rejected.missing == {"k"} and rejected.corrupt == 1  # written without the key
    unchecked = plain.lookup("keyed1", ["k"])
    assert unchecked.missing == {"k"} and (unchecked.unverifiable, unchecked.corrupt) == (1, 0)
    assert other.lookup("keyed1", ["k"]).unverifiable == 1
    assert_same(keyed.lookup("keyed1", ["k"]).found["k"], block["k"])
    report = keyed.verify()
    assert len(report.corrupt) == 1 and "without the cluster key" in report.corrupt[0][1]
    assert len(plain.verify().unverifiable) == 1 and not plain.verify().corrupt
    with pytest.raises(Unverifiable):  # the keyed segment, read with another key
        data = segment_bytes(block, BlockSigner.keyed(b"cluster secret"))
        footer = read_footer(data, len(data), "m")
        decode_block(footer, "k", data[footer.blocks["k"].start:footer.blocks["k"].end], other.signer)
    for s in (keyed, plain, other):
        s.close()


def test_a_segment_deleted_mid_read_is_a_counted_miss(store, tmp_path, monkeypatch):
    store.write(SPLIT, {"k": COLUMNS["dense-f32"]})
    listing = BlockStore._list

    def list_then_delete(self, directory):
        split = listing(self, directory)
        for path in segment_files(tmp_path):
            path.unlink()
        return split

    monkeypatch.setattr(BlockStore, "_list", list_then_delete)
    got = store.lookup(SPLIT, ["k"])
    assert got.missing == {"k"} and got.faults == 1 and store.counters.faults == 1


def test_a_timeout_is_a_counted_miss(tmp_path):
    BlockStore(str(tmp_path), PLAIN).write(SPLIT, {"k": COLUMNS["dense-f32"]})
    slow = BlockStore(f"slow+file://{tmp_path}?latency_ms=1000&mbps=100", PLAIN, timeout_s=0.2)
    start = time.perf_counter()
    got = slow.lookup(SPLIT, ["k"])
    assert time.perf_counter() - start < 0.9  # the listing alone takes 1 s
    assert got.missing == {"k"} and got.faults == 1 and slow.counters.faults == 1
    patient = BlockStore(f"slow+file://{tmp_path}?latency_ms=1&mbps=100", PLAIN)
    assert patient.lookup(SPLIT, ["k"]).hits == 1
    slow.close()
    patient.close()


def test_temp_files_of_killed_writers_are_ignored_and_collected(store, tmp_path):
    store.write(SPLIT, {"k": COLUMNS["dense-f32"]})
    (path,) = segment_files(tmp_path)
    temp = path.with_name(".tmp-999999999999999-dead.seg")
    temp.write_bytes(path.read_bytes()[:100])  # a killed writer's half segment
    got = store.lookup(SPLIT, ["k"])
    assert got.hits == 1 and got.corrupt == 0
    assert store.gc(1 << 30).deleted_temps == 0  # a young temp file may be a live writer's
    old = time.time() - 2 * 3600
    os.utime(temp, (old, old))
    assert store.gc(1 << 30).deleted_temps == 1 and not temp.exists() and path.exists()


def test_used_marker_is_touched_once_per_interval(store, tmp_path, monkeypatch):
    store.write(SPLIT, {"k": COLUMNS["dense-f32"]})
    store.lookup(SPLIT, ["k"])
    (marker,) = tmp_path.rglob("used")
    old = time.time() - 7200
    os.utime(marker, (old, old))
    store.lookup(SPLIT, ["k"])
    assert marker.stat().st_mtime == pytest.approx(old)  # within the interval: no write
    monkeypatch.setattr(store_module, "TOUCH_INTERVAL_S", 0.0)
    store.lookup(SPLIT, ["k"])
    assert marker.stat().st_mtime > old + 3600


def _age(root: Path, split: str, seconds_ago: float) -> None:
    """Makes every file of ``split`` look last used ``seconds_ago``."""
    when = time.time() - seconds_ago
    for f in root.rglob("*"):
        if f.is_file() and f.parent.name == split:
            os.utime(f, (when, when))


def test_gc_deletes_least_recently_used_first(store, tmp_path):
    splits = ["aa01", "bb02", "cc03", "dd04"]
    for split in splits:
        store.write(split, {"k": COLUMNS["sparse-weights-valid"]})
    store.lookup("cc03", ["k"])  # writes cc03's used marker
    for split, age in zip(splits, (400, 100, 900, 300)):
        _age(tmp_path, split, age)
    entries = {e.split_key: e for e in store.entries()}
    assert set(entries) == set(splits) and all(e.segments == e.blocks == 1 for e in entries.values())
    total = sum(e.bytes for e in entries.values())
    one = entries["bb02"].bytes
    result = store.gc(total - 1)  # one split must go: the least recently used
    assert result.deleted_splits == 1 and {e.split_key for e in store.entries()} == {"aa01", "bb02", "dd04"}
    result = store.gc(one + entries["dd04"].bytes)  # aa01 (400 s) goes, then dd04 (300 s) would not need to
    assert {e.split_key for e in store.entries()} == {"bb02", "dd04"} and result.remaining_bytes <= one * 2
    assert store.gc(0).remaining_bytes == 0 and store.entries() == []


def test_verify_finds_and_deletes_a_flipped_byte(store, tmp_path):
    store.write(SPLIT, {"k": COLUMNS["dense-f64-valid"]})
    store.write("ef56", {"k": COLUMNS["sparse"]})
    assert store.verify() .corrupt == [] and store.verify().blocks == 2
    (path,) = [p for p in segment_files(tmp_path) if p.parent.name == SPLIT]
    data = bytearray(path.read_bytes())
    data[70] ^= 1
    path.write_bytes(data)
    report = store.verify()
    assert [p for p, _ in report.corrupt] == [str(path)] and "MAC mismatch" in report.corrupt[0][1]
    assert store.verify(delete=True).deleted == [str(path)] and not path.exists()
    assert store.verify().corrupt == [] and store.verify().segments == 1


# -- the background writer -----------------------------------------------------------


def test_writer_writes_in_the_background_and_drops_past_its_bound(store, monkeypatch):
    writer = BlockWriter(store, max_pending_bytes=10_000)
    assert writer.submit(SPLIT, {"k": COLUMNS["sparse"]})
    assert writer.flush(5.0) and store.lookup(SPLIT, ["k"]).hits == 1
    big = {"big": DenseColumn(np.zeros(2000))}  # 16 000 bytes
    assert not writer.submit(SPLIT, big) and store.counters.dropped == 1

    def fail(split_key, blocks):
        raise OSError("disk full")

    monkeypatch.setattr(store, "write", fail)
    assert writer.submit(SPLIT, {"x": COLUMNS["dense-f32"]})
    assert writer.flush(5.0) and store.counters.faults == 1 and writer.pending_bytes == 0
    assert writer.close(5.0) and not writer.submit(SPLIT, {"x": COLUMNS["dense-f32"]})


# -- the command line ----------------------------------------------------------------


def test_cli_ls_gc_verify(tmp_path, capsys):
    root = tmp_path / "cache"
    s = BlockStore(str(root), PLAIN)
    s.write("aa01", {"k": COLUMNS["sparse"], "j": COLUMNS["dense-f32"]})
    s.write("bb02", {"k": COLUMNS["sparse"]})
    s.close()
    assert cli.main(["cache", "ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "aa01" in out and "bb02" in out and "2 splits, 2 segments, 3 blocks" in out
    assert cli.main(["cache", "verify", str(root)]) == 0
    assert "2 segments, 3 blocks verified; 0 corrupt" in capsys.readouterr().out
    path = next(p for p in segment_files(root) if p.parent.name == "bb02")
    data = bytearray(path.read_bytes())
    data[3] ^= 1
    path.write_bytes(data)
    assert cli.main(["cache", "verify", str(root)]) == 1 and "CORRUPT" in capsys.readouterr().out
    assert cli.main(["cache", "verify", str(root), "--delete"]) == 1 and not path.exists()
    assert cli.main(["cache", "verify", str(root)]) == 0
    assert cli.main(["cache", "gc", str(root), "--max-bytes", "1K"]) == 0
    assert "deleted 1 splits" in capsys.readouterr().out and not (root / "v1" / "aa" / "aa01").exists()


def test_cli_verify_with_auth(tmp_path, capsys, monkeypatch):
    from remoteloader.protocol import auth

    monkeypatch.delenv(auth.ENV_AUTH, raising=False)
    keys = auth.keygen(tmp_path / "keys")
    root = tmp_path / "cache"
    s = BlockStore(str(root), BlockSigner.for_credentials(auth.load(keys)))
    s.write("aa01", {"k": COLUMNS["sparse"]})
    s.close()
    assert cli.main(["cache", "verify", str(root)]) == 0
    assert "1 unverifiable (pass --auth DIR" in capsys.readouterr().out
    assert cli.main(["cache", "verify", str(root), "--auth", keys]) == 0
    assert "1 blocks verified; 0 corrupt, 0 unverifiable" in capsys.readouterr().out


# -- an S3-protocol server -----------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[object, str]]:
    pytest.importorskip("moto.moto_server.werkzeug_app")
    from tests.test_storage_s3 import moto_s3

    with moto_s3("cache") as (server, query):
        yield server, f"s3://cache/blocks?{query}"


def test_s3_store(s3, monkeypatch):
    server, uri = s3
    store = BlockStore(uri, BlockSigner.keyed(b"secret"))
    blocks = {k: COLUMNS[k] for k in ("dense-f32-2d-valid", "sparse-weights-valid")}
    store.write(SPLIT, blocks)
    store.write(SPLIT, {"more": COLUMNS["sparse"]})
    store.write("ef56", {"k": COLUMNS["dense-f32"]})
    server.reset()
    got = store.lookup(SPLIT, [*blocks, "more", "absent"])
    assert got.found.keys() == {*blocks, "more"} and got.missing == {"absent"}
    for key, column in blocks.items():
        assert_same(got.found[key], column)
    assert server.range_gets() == 2  # one tail read per small segment: footer and blocks together
    assert [e.split_key for e in store.entries()] == [SPLIT, "ef56"]
    assert store.verify().blocks == 4
    # A flipped byte: a miss, counted; verify finds it, then deletes it.
    fs, path = pafs.FileSystem.from_uri(uri)
    (seg,) = [i.path for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
              if "/ef56/" in i.path and i.path.endswith(".seg")]
    data = bytearray(fs.open_input_file(seg).read())
    data[5] ^= 1
    with fs.open_output_stream(seg.replace(".seg", "0.seg")) as out:  # a new name: footers are cached by path
        out.write(bytes(data))
    fs.delete_file(seg)
    bad = store.lookup("ef56", ["k"])
    assert bad.missing == {"k"} and bad.corrupt == 1
    assert len(store.verify(delete=True).deleted) == 1
    # Deleted between listing and reading: a miss, counted.
    listing = store._list

    def list_then_delete(directory):
        split = listing(directory)
        fs.delete_dir(directory)
        return split

    monkeypatch.setattr(store, "_list", list_then_delete)
    got = store.lookup(SPLIT, ["more"])
    assert got.missing == {"more"} and got.faults == 2  # both segments gone
    monkeypatch.undo()
    store.write("aa01", {"k": COLUMNS["dense-f32"]})
    assert store.gc(0).deleted_splits >= 1 and store.entries() == []
    store.close()
