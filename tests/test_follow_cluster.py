"""Following a growing table with real processes (spec ``table.follow``): partitions landed
while the job trains are read exactly once, window by window, with equal batch counts on
the ranks; the same through a master SIGKILLed and restarted on its journal between two
landings, and through a DCP checkpoint taken mid-stream and resumed on another world size;
a file rewritten after it was listed is reported and none of its rows are read."""
from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest

from remoteloader import RemoteDataLoader
from tests.conftest import master_status
from tests.follow_tables import follow_spec, land_partition, rows_of
from tests.test_ddp import run_script_job
from tests.test_order import consume

pytestmark = pytest.mark.slow
MAX_WINDOWS = 6  # the streams below end after 2 or 3 windows: more means the end was never seen


def follow_windows(loaders, on_batch=None) -> list[list[list]]:
    """Every window's batches per rank (the ranks taking turns, as under DDP), until a window
    yields nothing: the stream has ended."""
    windows = []
    while len(windows) < MAX_WINDOWS:
        per_rank = consume(loaders, None if on_batch is None else lambda r, i: on_batch(len(windows), r, i))
        if not any(per_rank):
            return windows
        windows.append(per_rank)
    raise AssertionError(f"the stream did not end after {MAX_WINDOWS} windows")


def wait_for_files(addr: str, files: int, timeout: float = 60.0) -> None:
    """Until the master's job lists ``files`` files (a growth is journaled)."""
    deadline = time.monotonic() + timeout
    while master_status(addr)["job"]["files"] < files:
        assert time.monotonic() < deadline, f"the master never listed {files} files"
        time.sleep(0.1)


def exactly_once(windows, total: int) -> None:
    rows = Counter(r for per_rank in windows for batches in per_rank for r in rows_of(batches))
    assert sorted(rows) == list(range(total)) and max(rows.values()) == 1, "every row of every partition once"
    for per_rank in windows:
        assert len({len(b) for b in per_rank}) == 1, "equal batch counts on the ranks, window by window"


def test_partitions_landed_while_training_are_read_exactly_once(tmp_path, cluster):
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 1000, files=2)
    master = cluster.master(workers=2)
    spec = follow_spec(table, until="ds=3")
    landed, lengths = [], {}

    def land(window: int, rank: int, i: int) -> None:
        if i == 0:  # len() once the window has started: the rank's batches of it
            lengths[window, rank] = len(loaders[rank])
        if window == 0 and not landed:  # while the first window is read: a partition of 2 files
            landed.append(land_partition(table, "ds=2", 1000, 700, files=2))
        elif window == 1 and len(landed) == 1:  # while the second is read: the last partition (until)
            landed.append(land_partition(table, "ds=3", 1700, 500))

    loaders = [RemoteDataLoader(spec, master=master.addr, rank=r, world_size=2, timeout=90) for r in range(2)]
    try:
        with pytest.raises(TypeError, match="follows its table"):
            len(loaders[0])  # the next window is not fixed yet
        windows = follow_windows(loaders, land)
    finally:
        for x in loaders:
            x.close()
    assert len(landed) == 2
    exactly_once(windows, 2200)
    assert lengths == {(w, r): len(batches) for w, per_rank in enumerate(windows) for r, batches in enumerate(per_rank)}
    follow = master_status(master.addr)["jobs"][0]["follow"]
    assert follow["ended"] and follow["watermark"] == "ds=3" and follow["windows"] == len(windows) + 1


def test_a_master_sigkilled_between_two_landings_neither_loses_nor_repeats_one(tmp_path, cluster):
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 800)
    args = ("--journal", str(tmp_path / "journal"))
    master = cluster.master(*args, workers=2)
    spec = follow_spec(table, until="ds=3")
    events = []

    def land(window: int, rank: int, i: int) -> None:
        if window == 0 and not events:
            land_partition(table, "ds=2", 800, 600, files=2)
            wait_for_files(master.addr, 3)  # journaled: the growth the restarted master must keep
            master.kill()
            events.append(cluster.master(*args, workers=2, bind=master.addr))
            land_partition(table, "ds=3", 1400, 400)  # listed by the restarted master only

    loaders = [RemoteDataLoader(spec, master=master.addr, rank=r, world_size=2, timeout=90) for r in range(2)]
    try:
        windows = follow_windows(loaders, land)
    finally:
        for x in loaders:
            x.close()
    assert events
    exactly_once(windows, 1800)
    assert master_status(master.addr)["job"]["files"] == 4  # 1 + 2 + 1: no growth journaled twice


DCP_SCRIPT = """
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from remoteloader import RemoteDataLoader
from tests.follow_tables import land_partition

table, store, ckpt, out, stop_at, resume, master, spec, land = sys.argv[1:10]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
loader = RemoteDataLoader(json.loads(spec), master=master, timeout=120)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
if resume == "1":
    dcp.load({"model": model, "loader": loader}, checkpoint_id=ckpt)
rows, steps, windows = [], 0, []
stop = int(stop_at) or None  # 0: read to the stream's end
while len(windows) < 6 and steps != stop:
    n = 0
    for batch in loader:
        keep = torch.ones(len(batch), dtype=torch.bool) if batch.padding is None else ~batch.padding
        model(batch.dense_features).sum().backward()   # an all-reduce: a rank with a batch less would hang
        rows += batch.passthrough["row_id"][keep].tolist()
        steps, n = steps + 1, n + 1
        if rank == 0 and steps == 1 and land:  # a partition lands while the first window is read
            name, first, count = land.split(":")
            land_partition(Path(table), name, int(first), int(count), files=2)
        if steps == stop:
            dcp.save({"model": model, "loader": loader}, checkpoint_id=ckpt)
            break
    windows.append(n)
    if n == 0:
        break
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rows": rows, "steps": steps, "windows": windows}, f)
dist.barrier()
loader.close()
dist.destroy_process_group()
"""


def test_a_dcp_checkpoint_taken_mid_stream_resumes_exactly_once_on_another_world_size(tmp_path, cluster):
    """2 ranks read window 0 (ds=1; ds=2 lands meanwhile) and save 2 batches into window 1
    (ds=2); ds=3 lands; 1 rank loads the checkpoint and read the rest of window 1, then
    window 2 (ds=3, until), then an empty window: the stream's end."""
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 1000, files=2)
    master = cluster.master(workers=2)
    spec = json.dumps(follow_spec(table, until="ds=3"))

    def job(world: int, name: str, stop_at: int, resume: bool, land: str = "") -> list[dict]:
        return run_script_job(tmp_path, DCP_SCRIPT, table, world, name, stop_at, resume, master.addr, spec, land)

    first = job(2, "save", 6, False, land="ds=2:1000:900")
    assert [o["windows"] for o in first] == [[4, 2]] * 2  # 500 rows a rank in window 0, then 2 batches
    land_partition(table, "ds=3", 1900, 500)
    rest = job(1, "load", 0, True)
    assert rest[0]["windows"][-1] == 0  # it read to the stream's end (an empty window)
    rows = Counter(r for o in first + rest for r in o["rows"])
    assert sorted(rows) == list(range(2400)) and max(rows.values()) == 1


def test_a_file_rewritten_after_it_was_listed_is_reported_and_none_of_its_rows_read(tmp_path, cluster):
    """One of ds=1's two files is rewritten (other rows, another size) after the job listed
    it: its split fails at the worker, which checks the file's identity, and the re-listing
    reports it; the job (on_error: skip) reads the other file's rows, none of either version
    of the rewritten one."""
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 1000, files=2)
    master = cluster.master(workers=2)
    loader = RemoteDataLoader(follow_spec(table, on_error="skip"), master=master.addr, timeout=90)
    try:
        assert loader.sparse_keys == ["s0"]  # hello: the master lists the table
        victim = table / "ds=1" / "part-00001.parquet"
        staged = tmp_path / "staged"
        land_partition(staged, "ds=1", 5000, 300)  # rows of another version: ids 5000..5299
        os.replace(staged / "ds=1" / "part-00000.parquet", victim)
        rows = [r for b in loader for r in rows_of([b])]
        assert sorted(rows) == list(range(500))  # the untouched file's rows, once
        assert any("part-00001.parquet" in w and "changed after it was listed" in w for w in loader.warnings)
    finally:
        loader.close()
    deadline = time.monotonic() + 30
    while not any("part-00001.parquet: changed after it was listed" in e["message"]
                  for e in master_status(master.addr)["errors"]):  # the re-listing reports it too
        assert time.monotonic() < deadline, master_status(master.addr)["errors"]
        time.sleep(0.1)
