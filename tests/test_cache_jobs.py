"""The block cache with real processes: jobs on a standing master and its workers share
blocks through a cache directory, and whatever the cache holds (another job's blocks,
flipped bytes, a rewritten source file, a killed writer's leftovers, blocks written
without the cluster key), every rank gets the rows the uncached path computes, each once."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import zmq

from remoteloader import LocalDataset, RemoteDataLoader
from remoteloader.protocol import auth
from remoteloader.protocol import messages as M
from remoteloader.protocol.rpc import RpcClient
from remoteloader.tools.datagen import generate_table
from tests.conftest import BIN, master_status, spec_dict

pytestmark = pytest.mark.slow
WORLD = 2


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch):
    for name in (auth.ENV_AUTH, "REMOTELOADER_CACHE", "REMOTELOADER_ALLOW_CACHE"):
        monkeypatch.delenv(name, raising=False)


def job_spec(table: Path, mode: str = "write-all", salt: int = 5, extra: bool = False) -> dict:
    spec = spec_dict(table, shuffle=True, seed=11, cache={"mode": mode})
    spec["features"]["sparse"][1]["transforms"][0]["salt"] = salt
    if extra:
        spec["features"]["sparse"].append({"name": "s2", "column": "idlist_2", "transforms": [{"op": "firstx", "x": 2}]})
    return spec


def row_values(batches) -> dict[int, tuple]:
    """row_id -> (label, dense bytes, each sparse feature's ids), each row at most once."""
    rows: dict[int, tuple] = {}
    for b in batches:
        sparse = {k: [t.tolist() for t in jt.to_dense()] for k, jt in b.sparse_features.to_dict().items()}
        dense = b.dense_features.numpy()
        for i, rid in enumerate(b.passthrough["row_id"].tolist()):
            assert rid not in rows, f"row {rid} delivered twice"
            rows[rid] = (float(b.labels[i]), dense[i].tobytes(), tuple((k, tuple(v[i])) for k, v in sorted(sparse.items())))
    return rows


def uncached(spec: dict) -> dict[int, tuple]:
    return row_values(LocalDataset(dict(spec, cache={"mode": "off"})))


def run_ranks(addr: str, spec: dict, keys: str | None = None) -> dict[int, tuple]:
    """One epoch on WORLD ranks consumed in lockstep; the ranks' rows, checked disjoint."""
    loaders = [RemoteDataLoader(spec, master=addr, rank=r, world_size=WORLD, timeout=60, auth=keys)
               for r in range(WORLD)]
    try:
        its, per_rank, done = [iter(x) for x in loaders], [[] for _ in range(WORLD)], [False] * WORLD
        while not all(done):
            for r in range(WORLD):
                if not done[r]:
                    try:
                        per_rank[r].append(next(its[r]))
                    except StopIteration:
                        done[r] = True
        rows: dict[int, tuple] = {}
        for r in range(WORLD):
            assert len(per_rank[r]) == len(loaders[r])
            mine = row_values(per_rank[r])
            assert not mine.keys() & rows.keys(), "a row on two ranks"
            rows.update(mine)
        return rows
    finally:
        for x in loaders:
            x.close()


def settled_counters(addr: str, keys: str | None = None, timeout: float = 15.0) -> dict:
    """The cache counters once two status readings agree and every worker heartbeated between
    them (every worker reported what it did since the first reading)."""
    rpc = RpcClient(zmq.Context.instance(), addr, 10, auth=auth.load(keys) if keys else None)
    try:
        deadline, last, last_at = time.monotonic() + timeout, None, 0.0
        while time.monotonic() < deadline:
            asked = time.monotonic()
            status = rpc.call(M.Status()).status
            counters = (status.get("cache") or {}).get("counters", {})
            # The master heard each worker last_seen_s before it answered, so no earlier than
            # ``asked - last_seen_s``: after the reading that first saw these counters if past ``last_at``.
            heard_since = status["workers"] and all(asked - w["last_seen_s"] > last_at for w in status["workers"])
            if counters and counters == last and heard_since:
                return counters
            if counters != last:
                last, last_at = counters, time.monotonic()
            time.sleep(0.1)
    finally:
        rpc.close()
    raise AssertionError(f"cache counters never settled: {last}")


def test_a_second_job_reads_the_first_jobs_blocks_and_faults_change_nothing(tables, cluster, tmp_path):
    cache = str(tmp_path / "cache")
    first = job_spec(tables["orc"], "write-all")
    master = cluster.master("--cache", cache, workers=2)
    assert run_ranks(master.addr, first) == uncached(first)
    written = settled_counters(master.addr)
    assert written["puts"] > 0 and written["corrupt"] == 0
    master.stop()

    # A second job: one feature's parameter changed (s1's salt), one feature added; the rest,
    # the label and row_id come from the first job's blocks.
    second = job_spec(tables["orc"], "read", salt=6, extra=True)
    expected = uncached(second)
    master = cluster.master("--cache", cache, workers=2)
    assert run_ranks(master.addr, second) == expected
    read = settled_counters(master.addr)
    assert read["puts"] == 0 and read["corrupt"] == 0
    # Every lookup wants 7 blocks (float_0, f1, s0, s1, s2, label, row_id) and misses exactly s1 and s2.
    assert read["hits"] > 0 and read["hits"] * 2 == read["misses"] * 5, read
    text = subprocess.run([str(BIN / "remoteloader"), "status", "--master", master.addr], capture_output=True,
                          text=True, timeout=30).stdout
    assert f"cache: {cache}  mode read  hits {read['hits']:,.0f}" in text, text
    master.stop()

    # A flipped byte in every segment: the same rows, the bad blocks counted and computed again.
    segments = sorted(Path(cache).rglob("*.seg"))
    rng = np.random.default_rng(1)
    for seg in segments:
        data = bytearray(seg.read_bytes())
        data[int(rng.integers(0, len(data) - 64))] ^= 0x01
        seg.write_bytes(bytes(data))
    master = cluster.master("--cache", cache, workers=2)
    assert run_ranks(master.addr, second) == expected
    assert settled_counters(master.addr)["corrupt"] > 0


def test_a_rewritten_source_file_misses_for_its_splits(tmp_path, cluster):
    table = tmp_path / "t"
    generate_table(str(table), rows=3000, partitions=1, dense=4, sparse=4, format="orc", seed=1,
                   stripe_size=64 << 10, files_per_partition=2, progress=False)
    cache = str(tmp_path / "cache")
    spec = job_spec(table, "write-all")
    master = cluster.master("--cache", cache, workers=2)
    run_ranks(master.addr, spec)
    master.stop()
    # The same table written with other values: one of its files replaces the original.
    other = tmp_path / "other"
    generate_table(str(other), rows=3000, partitions=1, dense=4, sparse=4, format="orc", seed=2,
                   stripe_size=64 << 10, files_per_partition=2, progress=False)
    victim = sorted(table.rglob("*.orc"))[0]
    shutil.copyfile(sorted(other.rglob("*.orc"))[0], victim)
    reading = job_spec(table, "read")
    master = cluster.master("--cache", cache, workers=2)
    assert run_ranks(master.addr, reading) == uncached(reading)
    counters = settled_counters(master.addr)
    assert counters["misses"] > 0 and counters["hits"] > 0  # the rewritten file's splits miss, the other's hit


def test_a_worker_killed_mid_write_leaves_the_next_jobs_rows_identical(tables, cluster, tmp_path):
    cache = str(tmp_path / "cache")
    spec = job_spec(tables["parquet"], "write-all")
    expected = uncached(spec)
    master = cluster.master("--cache", cache, workers=2)
    loaders = [RemoteDataLoader(spec, master=master.addr, rank=r, world_size=WORLD, timeout=60) for r in range(WORLD)]
    try:
        its = [iter(x) for x in loaders]
        batches = [next(its[0]), next(its[1])]
        os.kill(master.worker_pids()[0], signal.SIGKILL)  # it was producing and writing
        for it in its:
            batches.extend(it)
        assert row_values(batches) == expected  # the master re-queued its splits: exactly once
    finally:
        for x in loaders:
            x.close()
    master.stop()
    master = cluster.master("--cache", cache, workers=2)
    assert run_ranks(master.addr, job_spec(tables["parquet"], "read")) == expected


def test_with_auth_blocks_written_without_the_key_are_refused(tables, cluster, tmp_path):
    cache = str(tmp_path / "cache")
    spec = job_spec(tables["orc"], "write-all")
    master = cluster.master("--cache", cache, workers=2)
    run_ranks(master.addr, spec)
    master.stop()
    keys = auth.keygen(tmp_path / "keys")
    reading = job_spec(tables["orc"], "read")
    master = cluster.master("--cache", cache, "--auth", keys, workers=2)
    assert run_ranks(master.addr, reading, keys) == uncached(reading)
    counters = settled_counters(master.addr, keys)
    assert counters["hits"] == 0 and counters["corrupt"] > 0


@pytest.mark.parametrize("program", ["remoteloader-master", "remoteloader-worker"])
def test_a_cache_outside_allow_cache_is_refused_at_start(tmp_path, program):
    args = [str(BIN / program), "--cache", str(tmp_path / "cache"), "--allow-cache", str(tmp_path / "elsewhere")]
    args += ["--bind", "tcp://127.0.0.1:0", "--workers", "0"] if program == "remoteloader-master" else \
        ["--master", "tcp://127.0.0.1:9"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--allow-cache" in proc.stderr and not (tmp_path / "cache").exists()
    assert not [c for c in psutil.Process().children(recursive=True) if c.name().startswith("remoteloader")]
