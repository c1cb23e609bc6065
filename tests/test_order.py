"""Deterministic order: a rank's per-batch digest sequence is the same with 1, 2 or 4
workers, through a worker SIGKILLed mid-epoch, a master SIGKILLed and restarted on its
journal, workers added and drained mid-epoch (what the autoscaler does), and a state_dict()
loaded into a new process; every row exactly once, per rank on 2 ranks. The reference runs
on real processes, as do the tests that kill or start them; the others run in-process
clusters (tests/cluster.py), which must match the reference too.
The real autoscaler growing and shrinking a fleet under a deterministic job is
tests/test_scaling.py's autoscaler test, whose batches are checked against LocalDataset's."""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from remoteloader import RemoteDataLoader
from tests.conftest import ROWS, spec_dict

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def order_spec(tables, **overrides) -> dict:
    return spec_dict(tables["orc"], shuffle=True, seed=5, order={"deterministic": True, "cycle": 3}, **overrides)


def digest(batch) -> str:
    kjt = batch.sparse_features
    parts = (batch.dense_features, batch.labels, batch.passthrough["row_id"], kjt.values(), kjt.lengths())
    return hashlib.sha1(b"".join(t.numpy().tobytes() for t in parts)).hexdigest()[:16]


def stopped_mid_epoch(spec: dict, addr: str, stops: list[int]) -> tuple[list[list], dict]:
    """A job of ``len(stops)`` ranks checkpointed mid-epoch: rank r takes ``stops[r]`` batches;
    then (its batches per rank, every rank's ``state_dict()`` part together), the loaders closed."""
    world = len(stops)
    loaders = [RemoteDataLoader(spec, master=addr, rank=r, world_size=world, timeout=90) for r in range(world)]
    its = [iter(x) for x in loaders]
    first = [[next(it) for _ in range(n)] for n, it in zip(stops, its)]
    parts = {k: v for x in loaders for k, v in x.state_dict().items()}
    for x in loaders:
        x.close()
    return first, parts


def consume(loaders, on_batch=None) -> list[list]:
    """Every rank's batches, the ranks taking turns (as under DDP); ``on_batch(rank, i)`` after each."""
    its, out, done = [iter(x) for x in loaders], [[] for _ in loaders], [False] * len(loaders)
    while not all(done):
        for r, it in enumerate(its):
            if done[r]:
                continue
            try:
                out[r].append(next(it))
            except StopIteration:
                done[r] = True
                continue
            if on_batch is not None:
                on_batch(r, len(out[r]) - 1)
    return out


def sequences(per_rank) -> list[list[str]]:
    rows = [r for batches in per_rank for b in batches for r in b.passthrough["row_id"].tolist()]
    assert sorted(rows) == list(range(ROWS)), "every row exactly once"
    return [[digest(b) for b in batches] for batches in per_rank]


def run(addr: str, spec: dict, world: int = 1, on_batch=None) -> list[list[str]]:
    loaders = [RemoteDataLoader(spec, master=addr, rank=r, world_size=world, timeout=90) for r in range(world)]
    try:
        return sequences(consume(loaders, on_batch))
    finally:
        for x in loaders:
            x.close()


@pytest.fixture(scope="module")
def reference(tables, tmp_path_factory):
    """The sequences on 1 and on 2 ranks, with 2 workers and nothing going wrong."""
    from tests.conftest import Cluster

    cluster = Cluster()
    try:
        master = cluster.master(workers=2)
        return {world: run(master.addr, order_spec(tables), world) for world in (1, 2)}
    finally:
        cluster.stop()


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("world", [1, 2])
def test_the_sequence_is_the_same_whatever_the_number_of_workers(tables, inprocess, reference, workers, world):
    master = inprocess(workers)  # the reference ran on real processes: threads change nothing either
    assert run(master.addr, order_spec(tables), world) == reference[world]


def test_a_worker_sigkilled_at_a_random_batch_changes_nothing(tables, cluster, reference):
    master = cluster.master(workers=2)
    victim = master.started_worker_pids(2)[0]
    at = random.randrange(1, len(reference[2][0]) - 1)

    def kill(rank, i):
        if rank == 0 and i == at:
            os.kill(victim, signal.SIGKILL)

    assert run(master.addr, order_spec(tables), 2, kill) == reference[2], f"killed at batch {at}"


def test_a_master_sigkilled_and_restarted_on_its_journal_changes_nothing(tables, cluster, reference, tmp_path):
    args = ("--journal", str(tmp_path / "journal"), "--heartbeat-timeout", "3")
    master = cluster.master(*args, workers=0)
    cluster.workers(master.addr, 2)

    def restart(rank, i):
        if rank == 0 and i == 6:
            master.kill()
            time.sleep(0.5)
            cluster.master(*args, workers=0, bind=master.addr)

    assert run(master.addr, order_spec(tables), 2, restart) == reference[2]


def test_workers_added_and_drained_mid_epoch_change_nothing(tables, cluster, reference):
    """What the autoscaler does to a running epoch: new workers join the partition, others drain."""
    master = cluster.master(workers=1)
    added: list = []

    def scale(rank, i):
        if rank == 0 and i == 2:
            added.extend(cluster.workers(master.addr, 2))
        if rank == 0 and i == 8:
            added[0].send_signal(signal.SIGTERM)  # scale-down: it drains and leaves

    assert run(master.addr, order_spec(tables), 2, scale) == reference[2]


RESUME = """
import json, sys, torch
from remoteloader import RemoteDataLoader
from tests.test_order import digest
spec, addr, state_path, world = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
states = torch.load(state_path)
out = []
for rank in range(world):
    loader = RemoteDataLoader(spec, master=addr, rank=rank, world_size=world, timeout=90)
    loader.load_state_dict(states[rank])
    out.append([digest(b) for b in loader])
    loader.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("world", [1, 2])
def test_a_state_dict_loaded_in_a_new_process_continues_the_same_sequence(tables, cluster, reference, tmp_path,
                                                                          world):
    master = cluster.master(workers=2)
    spec = order_spec(tables)
    loaders = [RemoteDataLoader(spec, master=master.addr, rank=r, world_size=world, timeout=90) for r in range(world)]
    its = [iter(x) for x in loaders]
    first = [[digest(next(it)) for _ in range(4 + r)] for r, it in enumerate(its)]  # ranks stop at other batches
    state_path = tmp_path / "state.pt"
    torch.save([x.state_dict() for x in loaders], state_path)
    for x in loaders:
        x.close()
    child = subprocess.run([sys.executable, "-c", RESUME, json.dumps(spec), master.addr, str(state_path), str(world)],
                           capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert child.returncode == 0, child.stderr[-3000:]
    rest = json.loads(child.stdout.strip().splitlines()[-1])
    assert [f + r for f, r in zip(first, rest)] == reference[world]


def test_local_dataset_yields_the_same_sequence(tables, reference):
    from remoteloader import LocalDataset

    per_rank = [list(LocalDataset(order_spec(tables), rank=r, world_size=2)) for r in range(2)]
    assert sequences(per_rank) == reference[2]


def test_a_resume_onto_another_world_size_is_exactly_once_and_itself_deterministic(tables, inprocess):
    master = inprocess(2)
    spec = order_spec(tables)
    first, state = stopped_mid_epoch(spec, master.addr, [3, 3])  # state: every old rank's part
    before = first[0] + first[1]
    rests = []
    for _ in range(2):  # the same saved position, resumed twice on one rank
        loader = RemoteDataLoader(spec, master=master.addr, rank=0, world_size=1, timeout=90)
        loader.load_state_dict(state)
        rests.append(list(loader))
        loader.close()
    assert [digest(b) for b in rests[0]] == [digest(b) for b in rests[1]]
    sequences([before + rests[0]])  # every row exactly once


def test_splits_far_larger_than_split_rows_do_not_hang(tmp_path, inprocess):
    """A split is whole stripes: with stripes of 40 pieces and split_rows of 4, a cycle of
    4 splits is 160 pieces a rank, which the workers and the client must hold between them."""
    from remoteloader.tools.datagen import generate_table

    table = tmp_path / "t"
    generate_table(str(table), rows=12_800, partitions=1, dense=2, sparse=2, format="orc", seed=4,
                   stripe_rows=2560, progress=False)
    spec = spec_dict(table, batch_size=64, split_rows=256, shuffle=True, order={"deterministic": True, "cycle": 4})
    results = []
    for workers in (1, 2):
        master = inprocess(workers)
        loader = RemoteDataLoader(spec, master=master.addr, timeout=60)
        try:
            batches = list(loader)
        finally:
            loader.close()
        rows = sorted(r for b in batches for r in b.passthrough["row_id"].tolist())
        assert rows == list(range(12_800))
        results.append([digest(b) for b in batches])
        master.stop()
    assert results[0] == results[1]


DCP_SCRIPT = """
import hashlib, json, os, sys
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from remoteloader import RemoteDataLoader

table, store, ckpt, out, stop_at, resume = sys.argv[1:7]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
spec = {"table": {"path": table}, "batch_size": 100, "shuffle": True, "seed": 2, "split_rows": 500,
        "order": {"deterministic": True, "cycle": 3},
        "features": {"label": "label", "dense": ["float_0"], "sparse": ["idlist_0"], "passthrough": ["row_id"]}}
loader = RemoteDataLoader(spec, num_workers=2, timeout=120)
if resume == "1":
    dcp.load({"loader": loader}, checkpoint_id=ckpt)
digests = []
for batch in loader:
    kjt = batch.sparse_features
    parts = (batch.dense_features, batch.labels, batch.passthrough["row_id"], kjt.values(), kjt.lengths())
    digests.append(hashlib.sha1(b"".join(t.numpy().tobytes() for t in parts)).hexdigest()[:16])
    if len(digests) == int(stop_at):
        dcp.save({"loader": loader}, checkpoint_id=ckpt)
        break
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"digests": digests}, f)
dist.barrier()
loader.close()
dist.destroy_process_group()
"""


def test_a_dcp_checkpoint_on_the_same_world_size_continues_the_same_sequence(tmp_path):
    """Under torch.distributed the state is the job's position (row ranges); on the same
    world size and batch size it resumes in place: each rank's sequence goes on unchanged."""
    from remoteloader.tools.datagen import generate_table
    from tests.test_ddp import run_script_job

    table = tmp_path / "table"
    generate_table(str(table), rows=4_000, partitions=1, dense=1, sparse=1, format="orc", seed=5,
                   stripe_rows=500, progress=False)
    # Independent jobs (own ranks, store and embedded cluster; only "saved" writes the
    # checkpoint): they run side by side.
    with ThreadPoolExecutor(2) as pool:
        whole, saved = pool.map(lambda a: run_script_job(tmp_path, DCP_SCRIPT, table, 2, *a),
                                [("whole", 0, False), ("saved", 5, False)])
    rest = run_script_job(tmp_path, DCP_SCRIPT, table, 2, "rest", 0, True)
    for r in range(2):
        assert saved[r]["digests"] + rest[r]["digests"] == whole[r]["digests"], f"rank {r}"
