"""One standing fleet for many concurrent jobs (issue 39), on real processes: a master
started with --allow-table (a shared fleet) and 2 launched workers serve three loaders of
different specs on the same table at once, one of 2 ranks, one in deterministic order;
each job reads every row exactly once, the deterministic one in its LocalDataset order,
while they share work (a split taking blocks another job's split computed), also through
a worker SIGKILLed and the master restarted on its journal mid-epoch; a job whose table
cannot be read fails alone."""
from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from remoteloader import LocalDataset, RemoteDataLoader
from remoteloader.spec import DatasetSpec, SpecError
from tests.conftest import BIN, ROWS, master_status, spec_dict
from tests.test_order import consume, digest, order_spec

pytestmark = pytest.mark.slow


def rows_of(per_rank) -> list[int]:
    return sorted(r for batches in per_rank for b in batches for r in b.passthrough["row_id"].tolist())


def run_job(addr: str, spec: dict, world: int, on_batch=None, job=None) -> list[list]:
    """Every rank's batches of one epoch, the ranks taking turns (as under DDP); ``on_batch(rank, i)`` after each."""
    loaders = [RemoteDataLoader(spec, master=addr, rank=r, world_size=world, timeout=90, job=job) for r in range(world)]
    try:
        return consume(loaders, on_batch)
    finally:
        for x in loaders:
            x.close()


def test_three_concurrent_jobs_share_one_fleet_each_exactly_once(tables, cluster):
    master = cluster.master(workers=2)
    sparse_only = spec_dict(tables["orc"], batch_size=100)
    sparse_only["features"]["dense"] = ["float_0"]  # another projection of the same table
    jobs = {"plain": (spec_dict(tables["orc"], batch_size=128), 1),
            "two ranks": (sparse_only, 2),
            "deterministic": (order_spec(tables), 1)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        running = {name: pool.submit(run_job, master.addr, spec, world) for name, (spec, world) in jobs.items()}
        got = {name: f.result(timeout=240) for name, f in running.items()}
    for name, per_rank in got.items():
        assert rows_of(per_rank) == list(range(ROWS)), f"{name}: every row exactly once"
    assert [len(b) for b in got["two ranks"]] == [len(b) for b in reversed(got["two ranks"])]  # equal steps
    assert [digest(b) for b in got["deterministic"][0]] == \
        [digest(b) for b in LocalDataset(order_spec(tables), rank=0, world_size=1)]
    # The jobs share blocks (label, row ids, float_0, s0, s1): a job's split took blocks another
    # job computed on the same worker, as heartbeats report (within a few heartbeats of the end).
    deadline = time.monotonic() + 30
    while (status := master_status(master.addr))["shared_work"].get("hits", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert status["shared_work"]["hits"] > 0 and status["shared_work"]["hit_bytes"] > 0, status["shared_work"]
    assert sorted((j["world_size"], j["clients"]) for j in status["jobs"]) == [(None, 0)] * 3  # all ended their runs
    assert len(status["workers"]) == 2 and status["max_jobs"] == 8
    text = subprocess.run([str(BIN / "remoteloader"), "status", "--master", master.addr], capture_output=True,
                          text=True, check=True, timeout=30).stdout
    assert "jobs: 3 of at most 8" in text and text.count("\n  job ") == 3, text
    assert "shared work: " in text and "shared work: 0 blocks" not in text, text


def test_two_jobs_of_one_spec_under_two_names_each_read_every_row_once(tables, cluster):
    """A sweep's two trials of the same spec: two jobs by their names, side by side, sharing blocks."""
    master = cluster.master(workers=2)
    spec = spec_dict(tables["orc"], batch_size=128)
    with ThreadPoolExecutor(2) as pool:
        running = {name: pool.submit(run_job, master.addr, spec, 1, job=name) for name in ("trial-1", "trial-2")}
        got = {name: f.result(timeout=120) for name, f in running.items()}
    for name, per_rank in got.items():
        assert rows_of(per_rank) == list(range(ROWS)), f"{name}: every row exactly once"
    fingerprint = DatasetSpec.from_dict(spec).fingerprint()
    deadline = time.monotonic() + 30
    while (status := master_status(master.addr))["shared_work"].get("hits", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sorted((j["job"], j["name"]) for j in status["jobs"]) == \
        [(f"{fingerprint}/trial-1", "trial-1"), (f"{fingerprint}/trial-2", "trial-2")]
    assert status["shared_work"]["hits"] > 0, status["shared_work"]  # the same blocks: one trial took the other's


def test_a_worker_sigkilled_and_the_master_restarted_mid_epoch_under_three_jobs(tables, cluster, tmp_path):
    """The same three jobs, on a master with a journal and 2 stand-alone workers: one worker
    is SIGKILLed, then the master is SIGKILLed and restarted on its journal (same address),
    while the jobs read; each still reads every row exactly once, and the deterministic one
    its LocalDataset sequence."""
    args = ("--journal", str(tmp_path / "journal"), "--heartbeat-timeout", "3")
    master = cluster.master(*args, workers=0)
    cluster.workers(master.addr, 2)
    sparse_only = spec_dict(tables["orc"], batch_size=100)
    sparse_only["features"]["dense"] = ["float_0"]

    jobs = {"plain": (spec_dict(tables["orc"], batch_size=128), 1),
            "two ranks": (sparse_only, 2),
            "deterministic": (order_spec(tables), 1)}
    read = {name: 0 for name in jobs}
    lock, done = threading.Lock(), []

    def counted(name: str):
        """After each batch of job ``name``: once every job has read 2 batches (each reads 20
        or more), the worker is killed, and 3 batches of it later the master."""
        def on_batch(rank: int, i: int) -> None:
            with lock:
                read[name] += 1
                if not done and min(read.values()) >= 2:
                    done.append(read[name])
                    cluster.worker_procs[0].kill()
                elif len(done) == 1 and read[name] >= done[0] + 3:
                    done.append(read[name])
                    master.kill()
                    cluster.master(*args, workers=0, bind=master.addr)
        return on_batch

    with ThreadPoolExecutor(len(jobs)) as pool:
        running = {name: pool.submit(run_job, master.addr, spec, world, counted(name))
                   for name, (spec, world) in jobs.items()}
        got = {name: f.result(timeout=300) for name, f in running.items()}
    for name, per_rank in got.items():
        assert rows_of(per_rank) == list(range(ROWS)), f"{name}: every row exactly once"
    assert [digest(b) for b in got["deterministic"][0]] == \
        [digest(b) for b in LocalDataset(order_spec(tables), rank=0, world_size=1)]
    assert len(done) == 2  # both happened
    assert len(master_status(master.addr)["jobs"]) == 3  # the restarted master holds every job


def test_a_job_whose_table_cannot_be_read_fails_alone(tables, cluster, tmp_path_factory):
    master = cluster.master(workers=2)
    broken = tmp_path_factory.mktemp("broken")
    (broken / "part-00000.orc").write_bytes(b"not an orc file" * 100)
    bad = spec_dict(broken)
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(run_job, master.addr, spec_dict(tables["orc"], batch_size=128), 1)
        loader = RemoteDataLoader(bad, master=master.addr, timeout=60)
        try:
            with pytest.raises(SpecError, match="part-00000.orc"):
                len(loader)
        finally:
            loader.close()
        assert rows_of(good.result(timeout=180)) == list(range(ROWS))
    assert [j["fingerprint"] for j in master_status(master.addr)["jobs"]] == [
        DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=128)).fingerprint()]
