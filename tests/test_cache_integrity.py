"""The block cache against unlucky and hostile contents (issue 37, findings 2, 3 and 4), in
process: a file rewritten in place with the same size and tail is never served from its old
blocks; a table column named like an internal block (``weights``) is just a column; planted
segments with huge footers are refused from their trailer or footer MAC, unparsed, and
remembered, and the footer cache's budget holds what its footers take in memory."""
from __future__ import annotations

import gc
import hashlib
import json
import os
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.orc as po
import pytest

from remoteloader import LocalDataset
from remoteloader.columns import DenseColumn, SparseColumn
from remoteloader.core.binding import bind
from remoteloader.core.cache import segments
from remoteloader.core.cache import store as store_module
from remoteloader.core.cache.segments import BlockSigner
from remoteloader.core.cache.store import BlockStore
from remoteloader.core.processor import SplitProcessor
from remoteloader.core.sampling import plan_job_splits
from remoteloader.spec import DatasetSpec

from .test_cache_processor import Cache, everything, produce, tasks

TAIL = 64 << 10  # what DataFile.tail_digest covers


# -- finding 2: a rewrite in place that keeps size and tail ------------------------------------------------
def _write_orc(path: Path, rows: int, seed: int) -> None:
    """Uncompressed ORC, so a float64 column's values lie raw in its stripe's data stream."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, rows)
    ids = rng.integers(0, 1000, int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    table = pa.table({
        "row_id": pa.array(np.arange(rows) + seed * rows, pa.int64()),
        "label": pa.array(np.round(rng.random(rows), 6) + 0.5, pa.float64()),  # no two equal
        "float_0": pa.array(rng.random(rows, dtype=np.float32)),
        "idlist_0": pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(ids, pa.int64())),
    })
    po.write_table(table, str(path), stripe_size=64 << 10, compression="uncompressed")


def _rewrite_swapping_labels(path: Path, rows: tuple[int, int]) -> tuple[float, float]:
    """Rows ``rows`` of the first stripe get each other's label, in place: the same size,
    the same last 64 KiB (stripe statistics do not change when values are permuted), the
    same inode. Returns the two labels as they were."""
    labels = po.ORCFile(str(path)).read(columns=["label"]).column("label").to_numpy()
    a, b = rows
    data = path.read_bytes()
    run = struct.pack(f"<{b - a + 1}d", *labels[a:b + 1])  # the labels of rows a..b, back to back
    at = data.find(run)
    assert at > 0 and data.find(run, at + 1) < 0 and at + len(run) < len(data) - TAIL
    swapped = list(labels[a:b + 1])
    swapped[0], swapped[-1] = swapped[-1], swapped[0]
    with open(path, "r+b") as f:  # in place: the same inode, as a writer that rewrites its file
        f.seek(at)
        f.write(struct.pack(f"<{b - a + 1}d", *swapped))
    return float(labels[a]), float(labels[b])


def _labels_by_row(pieces, bound) -> dict[int, float]:
    out = {}
    for _split, _index, arrays in pieces:
        ids = np.frombuffer(arrays["pt.row_id"][2], np.dtype(arrays["pt.row_id"][0]))
        labels = np.frombuffer(arrays["labels"][2], np.dtype(arrays["labels"][0]))
        out.update(zip(ids.tolist(), labels.tolist()))
    return out


def test_a_file_rewritten_in_place_with_the_same_size_and_tail_is_never_served_stale(tmp_path):
    table = tmp_path / "t"
    table.mkdir()
    for i in range(2):
        _write_orc(table / f"part-{i}.orc", 12_000, i)
    victim = table / "part-0.orc"
    spec = {"table": {"path": str(table)}, "shuffle": True, "seed": 3, "batch_size": 512, "split_rows": 4096,
            "features": {"label": "label", "dense": ["float_0"], "sparse": [{"name": "s0", "column": "idlist_0"}],
                         "passthrough": ["row_id"]}}
    cache = Cache(tmp_path / "cache")
    try:
        bound = bind(DatasetSpec.from_dict(spec))
        base = plan_job_splits(bound)
        produce(cache.processor(bound), tasks(bound, base, 0, everything(bound)))  # write-all: every block
        cache.flush()
        before = victim.stat()
        tail = hashlib.blake2b(victim.read_bytes()[-TAIL:]).digest()
        time.sleep(0.05)  # past the clock's tick: the rewrite comes later than the listing
        old = _rewrite_swapping_labels(victim, (0, 2))
        # ... and its modification time set back, as `cp -p` or `rsync -t` would leave it.
        os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = victim.stat()
        assert (after.st_size, after.st_ino, after.st_mtime_ns) == (before.st_size, before.st_ino, before.st_mtime_ns)
        assert hashlib.blake2b(victim.read_bytes()[-TAIL:]).digest() == tail

        # A later job lists the table again and reads what the first job cached.
        bound2 = bind(DatasetSpec.from_dict(spec))
        base2 = plan_job_splits(bound2)
        expected = produce(SplitProcessor(bound2), tasks(bound2, base2, 1))
        hits = cache.store.counters.hits
        reading = cache.processor(bound2)
        got = produce(reading, tasks(bound2, base2, 1, everything(bound2, write=False)))
        labels = _labels_by_row(got, bound2)
        assert (labels[0], labels[2]) == pytest.approx((old[1], old[0]))  # the new values, not the cached ones
        assert got == expected
        assert cache.store.counters.hits > hits  # the untouched file's splits still come from the cache
        assert reading.io.bytes_requested > 0  # the rewritten file's splits are read again
    finally:
        cache.close()


def test_the_listing_takes_each_files_identity_once_and_the_split_key_names_it(tmp_path):
    from dataclasses import replace

    from remoteloader.core.cache.keys import split_key
    from remoteloader.formats import list_table

    path = tmp_path / "a.orc"
    _write_orc(path, 3000, 0)
    (f,) = list_table(str(path))
    st = path.stat()
    assert f.identity == f"posix:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    assert split_key(f, 0, 1, 0, None) != split_key(replace(f, identity=f"posix:{st.st_ino + 1}:1:1"), 0, 1, 0, None)
    time.sleep(0.02)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same bytes and mtime: only the change time moves
    (g,) = list_table(str(path))
    assert g.tail_digest == f.tail_digest and g.identity != f.identity
    assert split_key(g, 0, 1, 0, None) != split_key(f, 0, 1, 0, None)


# -- finding 3: a column named like an internal block ----------------------------------------------------
@pytest.fixture(scope="module")
def weights_table(tmp_path_factory) -> Path:
    """A table with a float column named ``weights``."""
    root = tmp_path_factory.mktemp("weights") / "t"
    root.mkdir()
    rng = np.random.default_rng(9)
    rows = 3000
    lengths = rng.integers(0, 4, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    po.write_table(pa.table({
        "row_id": pa.array(np.arange(rows), pa.int64()),
        "label": pa.array(rng.integers(0, 2, rows).astype(np.float32)),
        "weights": pa.array(rng.random(rows, dtype=np.float32) * 7),
        "float_0": pa.array(rng.random(rows, dtype=np.float32)),
        "idlist_0": pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                             pa.array(rng.integers(0, 500, int(offsets[-1])), pa.int64())),
    }), str(root / "part-0.orc"), stripe_size=16 << 10)
    return root


def _batches(dataset) -> list[tuple]:
    out = []
    for b in dataset:
        out.append((b.dense_features.numpy().tobytes(), b.labels.numpy().tobytes(),
                    b.sparse_features.values().numpy().tobytes(), b.sparse_features.lengths().numpy().tobytes(),
                    {k: v.numpy().tobytes() for k, v in sorted(b.passthrough.items())},
                    None if b.weights is None else b.weights.numpy().tobytes()))
    return out


@pytest.mark.parametrize("mode", ["auto", "write-all"])
@pytest.mark.parametrize("layout", ["label", "passthrough and sampling weights"])
def test_a_column_named_weights_reads_cached_splits_correctly(weights_table, tmp_path, mode, layout):
    features = {"dense": ["float_0"], "sparse": [{"name": "s0", "column": "idlist_0"}]}
    if layout == "label":
        spec = {"features": {**features, "label": "weights", "passthrough": ["row_id"]}}
    else:  # a passthrough column `weights` beside the sampling weights (batch.weights)
        spec = {"features": {**features, "label": "label", "passthrough": ["row_id", "weights"]},
                "sampling": {"rate": 0.7, "seed": 1, "weight": True}}
    spec.update(table={"path": str(weights_table)}, shuffle=True, seed=5, batch_size=256, split_rows=1000,
                cache={"mode": mode, "expected_epochs": 2})
    location = tmp_path / "cache"
    for epoch in (0, 1):  # the first writes every block, the second reads them
        plain = LocalDataset(dict(spec, cache={"mode": "off"}), epoch=epoch)
        cached = LocalDataset(spec, cache=str(location), epoch=epoch)
        assert _batches(cached) == _batches(plain)
        assert list(location.rglob("*.seg"))


# -- finding 4: planted footers ----------------------------------------------------------------------------
SPLIT = "5b" * 16


def _legit_blocks(n: int = 4) -> dict:
    rng = np.random.default_rng(1)
    blocks = {}
    for i in range(n):
        offsets = np.arange(0, 2001, 2, dtype=np.int64)
        blocks[f"{i:032x}"] = (DenseColumn(rng.random(1000, dtype=np.float32)) if i % 2 else
                               SparseColumn(rng.integers(0, 1 << 40, 2000), offsets))
    return blocks


def _planted(legit: bytes, footer_bytes: int, scheme: str) -> bytes:
    """What a user without the key writes: a copy of a real segment's data with a footer of
    about ``footer_bytes`` of well-formed entries, naming the cluster's scheme and key id
    (``scheme="keyed"``, copied from the real one) or plain checksums, and a MAC it made up."""
    old = legit.endswith(b"RLSEG001")
    if old:
        (length,) = struct.unpack("<I", legit[-12:-8])
        real = json.loads(legit[-12 - length:-12])
        data = legit[:-12 - length]
    else:  # RLSEG002: u32 length, u32 blocks, scheme, 3 zero bytes, key id, footer MAC, magic
        length, _blocks, _code, key_id, _mac = struct.unpack("<IIB3x8s16s", legit[-44:-8])
        real = json.loads(legit[-44 - length:-44])
        data = legit[:-44 - length]
    entry = dict(real["blocks"][0], mac="0" * 32)
    one = len(json.dumps(entry, separators=(",", ":"))) + 1
    entries = [dict(entry, key=f"{i:032x}") for i in range(max(1, footer_bytes // one))]
    footer = dict(real, blocks=entries)
    if scheme == "plain":
        footer.update(mac="crc32", key_id=None)
    raw = json.dumps(footer, sort_keys=True, separators=(",", ":")).encode()
    if old:
        return data + raw + struct.pack("<I", len(raw)) + b"RLSEG001"
    code, kid = (1, bytes(8)) if scheme == "plain" else (2, key_id)
    return data + raw + struct.pack("<IIB3x8s16s", len(raw), min(len(entries), 4096), code, kid,
                                    os.urandom(16)) + b"RLSEG002"


class _CountingJson:
    """``json`` for ``segments``: records the size of every text it parses."""

    def __init__(self):
        self.parsed: list[int] = []

    def loads(self, text, *args, **kwargs):
        self.parsed.append(len(text))
        return json.loads(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(json, name)


def test_planted_huge_footers_are_refused_unparsed_in_bounded_time_and_memory(tmp_path, monkeypatch):
    signer = BlockSigner.keyed(b"cluster secret")
    blocks = _legit_blocks()
    clean = BlockStore(str(tmp_path / "clean"), signer)
    attacked = BlockStore(str(tmp_path / "attacked"), signer)
    try:
        for store in (clean, attacked):
            store.write(SPLIT, blocks)
        (legit,) = (tmp_path / "attacked").rglob("*.seg")
        data = legit.read_bytes()
        # Three planted segments, newer than the real one: 15 MB footers under the cluster's
        # key id and under plain checksums, and one within the size bound (under 4 MiB).
        for name, size, scheme in [("15-keyed", 15 << 20, "keyed"), ("15-plain", 15 << 20, "plain"),
                                   ("4-keyed", (4 << 20) - (64 << 10), "keyed")]:
            (legit.parent / f"999999999999999-{name}.seg").write_bytes(_planted(data, size, scheme))
        clean_lookup = clean.lookup(SPLIT, list(blocks))
        assert clean_lookup.hits == len(blocks)

        counting = _CountingJson()
        monkeypatch.setattr(segments, "json", counting)
        gc.collect()
        tracemalloc.start()
        try:
            start = time.perf_counter()
            first = attacked.lookup(SPLIT, list(blocks))
            first_s = time.perf_counter() - start
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert first.found.keys() == blocks.keys()  # the real blocks, verified
        assert first.corrupt >= 3 and attacked.counters.corrupt >= 3  # each planted segment refused, counted
        assert max(counting.parsed, default=0) < 64 << 10  # no planted footer reached the JSON parser
        assert peak < 12 << 20, f"{peak / 2**20:.1f} MiB at peak"  # the 4 MiB footer once, nothing parsed
        assert first_s < 2.0, first_s

        # Refused once per process: later lookups read the real segment only.
        for _ in range(3):
            again = attacked.lookup(SPLIT, list(blocks))
            assert again.found.keys() == blocks.keys() and again.corrupt >= 3
            assert again.bytes_read <= clean.lookup(SPLIT, list(blocks)).bytes_read
    finally:
        clean.close()
        attacked.close()


def test_the_footer_cache_budget_counts_the_memory_footers_take(tmp_path, monkeypatch):
    budget = 1 << 20
    cache = type(store_module.FOOTERS)(budget)
    monkeypatch.setattr(store_module, "FOOTERS", cache)
    store = BlockStore(str(tmp_path / "cache"), BlockSigner.plain())
    try:
        blocks = {f"{i:032x}": DenseColumn(np.zeros(2, np.float32)) for i in range(40)}
        splits = [f"{i:04x}" + "0" * 28 for i in range(120)]
        for split in splits:
            store.write(split, blocks)
        for split in splits[:2]:  # the lookup path's own allocations, before counting
            store.lookup(split, list(blocks))
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for split in splits[2:]:
                assert store.lookup(split, list(blocks)).hits == len(blocks)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        # 118 footers of 40 blocks: about 3.2 MB of objects, 1.1 MB of JSON. What stays is
        # the budget's worth (and the store's small per-split bookkeeping), not 3x it.
        assert held < budget * 1.3, f"{held / 2**20:.2f} MiB held for a {budget / 2**20:.0f} MiB budget"
    finally:
        store.close()
