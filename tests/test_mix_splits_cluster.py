"""Batches that mix splits (spec ``mix_splits: 4``) through the loader: every rank's batch
sequence is the same with 1, 2 and 4 workers (in-process clusters), through a worker
SIGKILLed mid-epoch (real processes), through a state_dict() loaded into a new loader (each
rank's own part, and the job's position as DCP saves it) and a resume onto another world size, and from LocalDataset whatever its DataLoader workers;
every row exactly once across 2 ranks, and every full batch holds rows of 4 splits."""
from __future__ import annotations

import bisect
import os
import random
import signal
from types import SimpleNamespace

import pytest

from remoteloader import LocalDataset, RemoteDataLoader
from remoteloader.client import local, resume
from remoteloader.core.binding import bind
from remoteloader.core.plan import plan_base_splits
from remoteloader.spec import DatasetSpec
from tests.conftest import ROWS, spec_dict
from tests.test_order import consume, digest, sequences, stopped_mid_epoch

pytestmark = pytest.mark.slow
LANES = 4


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """The tests' rows in row groups of 100, so splits of 200 rows are far shorter than a
    rank's lanes (about 625 rows): a full batch then holds rows of 4 distinct splits."""
    from remoteloader.tools.datagen import generate_table

    path = tmp_path_factory.mktemp("mix") / "t"
    generate_table(str(path), rows=ROWS, partitions=2, dense=4, sparse=4, format="parquet", seed=7,
                   row_group_rows=100, files_per_partition=2, progress=False)
    return path


def mix_spec(table) -> dict:
    return spec_dict(table, shuffle=True, seed=5, split_rows=200, mix_splits=LANES, order={"deterministic": True})


def base_of(table):
    """Which base split a row id is in (row ids are canonical positions)."""
    spec = DatasetSpec.from_dict(mix_spec(table))
    starts = [s.position for s in plan_base_splits(bind(spec).files, spec.split_rows)]
    return lambda row: bisect.bisect_right(starts, row) - 1


def run(addr, spec, world, on_batch=None, check=None):
    loaders = [RemoteDataLoader(spec, master=addr, rank=r, world_size=world, timeout=90) for r in range(world)]
    try:
        per_rank = consume(loaders, on_batch)
        if check is not None:
            check(per_rank)
        return sequences(per_rank)
    finally:
        for x in loaders:
            x.close()


@pytest.fixture(scope="module")
def reference(table):
    """Each rank's sequence on 2 ranks with 2 in-process workers; checks its batches mix."""
    from tests.cluster import InProcessCluster

    split_of = base_of(table)

    def mixed(per_rank):
        assert len({len(b) for b in per_rank}) == 1  # equal batch counts on the ranks (even_batches)
        for batches in per_rank:
            assert all(len({split_of(r) for r in b.passthrough["row_id"].tolist()}) >= LANES
                       for b in batches if len(b) == 256)

    cluster = InProcessCluster(2)
    try:
        return run(cluster.addr, mix_spec(table), 2, check=mixed)
    finally:
        cluster.stop()


@pytest.mark.parametrize("workers", [1, 4])
def test_the_mixed_sequence_is_the_same_whatever_the_number_of_workers(table, inprocess, reference, workers):
    assert run(inprocess(workers).addr, mix_spec(table), 2) == reference


def test_a_worker_sigkilled_mid_epoch_changes_nothing(table, cluster, reference):
    master = cluster.master(workers=2)
    victim = master.started_worker_pids(2)[0]
    # Early, while the victim still holds pieces the ranks have no credit for yet (each rank
    # has about 10 batches): they are lost with it and must be produced again, in their lanes.
    at, killed = random.randrange(1, 3), []

    def kill(rank, i):
        if rank == 0 and i == at:
            os.kill(victim, signal.SIGKILL)
            killed.append(at)

    assert run(master.addr, mix_spec(table), 2, kill) == reference, f"killed at batch {at}"
    assert killed


def test_a_state_dict_continues_the_same_sequence_and_a_resume_elsewhere_is_exactly_once(table, inprocess,
                                                                                        reference):
    master = inprocess(2)
    spec = mix_spec(table)
    first, parts = stopped_mid_epoch(spec, master.addr, [3, 4])  # ranks stop at other batches
    def resumed_from(state: dict) -> list:
        again = [RemoteDataLoader(spec, master=master.addr, rank=r, world_size=2, timeout=90) for r in range(2)]
        for x in again:
            x.load_state_dict(state)
        rest = consume(again)
        for x in again:
            x.close()
        return [[digest(b) for b in f + r] for f, r in zip(first, rest)]

    # Each rank's own part, in a new loader: the same sequence goes on.
    assert resumed_from(parts) == reference
    # The job's position (what DCP saves under torch.distributed), on the same world size: in
    # place, each rank's consumed rows named back in its own lanes' splits, the same sequence.
    assert resumed_from(resume.job_position(resume.rank_parts(parts))) == reference
    # Every old rank's part, on one rank: the rest of the epoch replanned into new lanes, each row once.
    loader = RemoteDataLoader(spec, master=master.addr, rank=0, world_size=1, timeout=90)
    loader.load_state_dict(parts)
    expected = len(loader)
    elsewhere = list(loader)
    loader.close()
    assert len(elsewhere) == expected
    sequences([first[0] + first[1] + elsewhere])  # every row exactly once


def test_local_dataset_yields_the_same_sequence_whatever_its_dataloader_workers(table, reference, monkeypatch):
    spec = mix_spec(table)
    single = [[digest(b) for b in LocalDataset(spec, rank=r, world_size=2)] for r in range(2)]
    assert single == reference
    for shards in (2, 3):
        per_rank = []
        for r in range(2):
            batches = []
            for shard in range(shards):  # what each DataLoader worker would yield, in turn
                monkeypatch.setattr(local, "get_worker_info", lambda s=shard, n=shards: SimpleNamespace(id=s, num_workers=n))
                batches += list(LocalDataset(spec, rank=r, world_size=2))
            per_rank.append(batches)
        assert sequences(per_rank) == reference
