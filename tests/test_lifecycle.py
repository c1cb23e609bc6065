"""A standing cluster outlives its jobs: a `remoteloader-master` with 2 workers serves any
sequence of epochs, jobs one after another in new processes (another world size included),
the resume of an older checkpoint after a crash, and a master restart between epochs; every
time each row exactly once, and nothing waits for the loaders' timeout. The sequence of epochs
and the refused second job are the master service's logic, run on in-process clusters."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from remoteloader import RemoteDataLoader
from tests.conftest import ROWS, spec_dict

ROOT = str(Path(__file__).parent.parent)

# Far above what any of these jobs needs: a job that waits on it fails its process's
# wait below instead (JOB_WAIT_S), so a hang fails the test rather than passing slowly.
LOADER_TIMEOUT_S = 120
JOB_WAIT_S = 90

JOB = """
import json, os, sys
import torch
from remoteloader import RemoteDataLoader

master, spec, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
rank, world, epochs = int(sys.argv[4]), int(sys.argv[5]), json.loads(sys.argv[6])
ckpt_at, crash_at = map(int, sys.argv[7:9])  # checkpoint after ckpt_at batches of the first epoch, die
                                             # (no close) crash_at batches into the next; -1: never
loader = RemoteDataLoader(spec, master=master, rank=rank, world_size=world, timeout=%d)
if os.path.exists(out + ".state"):
    loader.load_state_dict(torch.load(out + ".state", weights_only=True))
seen = []
for epoch in epochs:
    loader.set_epoch(epoch)
    rows = []
    for i, batch in enumerate(loader):
        keep = torch.ones(len(batch), dtype=torch.bool) if batch.padding is None else ~batch.padding
        rows += batch.passthrough["row_id"][keep].tolist()
        if i + 1 == ckpt_at and not seen:
            torch.save(loader.state_dict(), out + ".ckpt")
            json.dump(rows, open(out + ".before", "w"))
        if seen and i + 1 == crash_at:
            os._exit(3)   # a crash: no close, no goodbye
    seen.append(rows)
json.dump(seen, open(out, "w"))
loader.close()
""" % LOADER_TIMEOUT_S


def run_job(tmp_path: Path, master: str, spec: dict, name: str, world: int = 1, epochs: tuple = (0,),
            ckpt_at: int = -1, crash_at: int = -1, expect: int = 0) -> list[list[list[int]]]:
    """One job in new processes (one per rank); each rank's rows of each epoch."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    procs = [subprocess.Popen([sys.executable, str(script), master, json.dumps(spec), str(tmp_path / f"{name}.{r}"),
                               str(r), str(world), json.dumps(list(epochs)), str(ckpt_at), str(crash_at)],
                              env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
             for r in range(world)]
    try:
        assert [p.wait(timeout=JOB_WAIT_S) for p in procs] == [expect] * world
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if expect:
        return []
    return [json.loads((tmp_path / f"{name}.{r}").read_text()) for r in range(world)]


def exactly_once(rows_per_rank: list[list[int]]) -> None:
    rows = [r for rank in rows_per_rank for r in rank]
    assert sorted(rows) == list(range(ROWS)), (len(rows), len(set(rows)))


@pytest.mark.slow
def test_epochs_0_1_0_in_one_loader(tables, inprocess):
    """Workers used to keep a per-rank maximum epoch and drop the second epoch 0's pieces."""
    master = inprocess(2)
    spec = spec_dict(tables["orc"], shuffle=True)
    with RemoteDataLoader(spec, master=master.addr, timeout=LOADER_TIMEOUT_S) as loader:
        runs = []
        for epoch in (0, 1, 0, 2, 1):
            loader.set_epoch(epoch)
            runs.append([r for b in loader for r in b.passthrough["row_id"].tolist()])
    for rows in runs:
        exactly_once([rows])
    assert runs[0] != runs[1]  # another epoch, another order: these really were other epochs


def test_jobs_one_after_another_in_new_processes(tables, cluster, tmp_path):
    """Job A (1 rank, epochs 0 and 1), then job B (2 ranks, epoch 0), then job C (1 rank, epoch 0),
    each in new processes, on the same master and workers."""
    master = cluster.master(workers=2)
    spec = spec_dict(tables["orc"], shuffle=True)
    (a,) = run_job(tmp_path, master.addr, spec, "a", epochs=(0, 1))
    for epoch_rows in a:
        exactly_once([epoch_rows])
    b = run_job(tmp_path, master.addr, spec, "b", world=2)
    exactly_once([b[0][0], b[1][0]])
    assert len(b[0][0]) and len(b[1][0])
    (c,) = run_job(tmp_path, master.addr, spec, "c")
    exactly_once([c[0]])


@pytest.mark.slow
def test_a_second_job_while_one_is_live_is_refused(tables, inprocess):
    master = inprocess(2)
    spec = spec_dict(tables["orc"])
    with RemoteDataLoader(spec, master=master.addr, timeout=LOADER_TIMEOUT_S) as live:
        len(live)  # joined
        with pytest.raises(RuntimeError, match="world size 1"):
            len(RemoteDataLoader(spec, master=master.addr, rank=0, world_size=2, timeout=LOADER_TIMEOUT_S))


def test_resume_of_an_epoch_0_checkpoint_after_the_crashed_trainer_reached_epoch_1(tables, cluster, tmp_path):
    master = cluster.master(workers=2)
    spec = spec_dict(tables["orc"], shuffle=True)
    # Checkpoint after 5 batches of epoch 0, finish it, die 3 batches into epoch 1.
    run_job(tmp_path, master.addr, spec, "crashed", epochs=(0, 1), ckpt_at=5, crash_at=3, expect=3)
    before = json.loads((tmp_path / "crashed.0.before").read_text())
    state = tmp_path / "resumed.0.state"
    state.write_bytes((tmp_path / "crashed.0.ckpt").read_bytes())
    (resumed,) = run_job(tmp_path, master.addr, spec, "resumed")
    exactly_once([before, resumed[0]])


def test_master_restart_without_journal_between_two_epochs(tables, cluster):
    """The next iter() used to raise 'unknown client' at once: starting an epoch did not rejoin."""
    master = cluster.master("--heartbeat-timeout", "3", workers=0)
    cluster.workers(master.addr, 2)
    spec = spec_dict(tables["orc"], batch_size=100)
    with RemoteDataLoader(spec, master=master.addr, timeout=LOADER_TIMEOUT_S) as loader:
        exactly_once([[r for b in loader for r in b.passthrough["row_id"].tolist()]])
        master.kill()
        cluster.master("--heartbeat-timeout", "3", workers=0, bind=master.addr)
        exactly_once([[r for b in loader for r in b.passthrough["row_id"].tolist()]])
