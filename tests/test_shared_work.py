"""Shared work between a shared fleet's jobs (issue 39, item 4), in process: the worker's memo
of blocks (core/cache/memo.py) with its bounds, the pieces a job makes from another job's
blocks (byte for byte those it makes alone, and never of another file version), and the
master's choice of which job's next split a worker gets (master/shared_work.py)."""
from __future__ import annotations

import dataclasses
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from remoteloader.columns import DenseColumn
from remoteloader.core.binding import bind
from remoteloader.core.cache.job import JobCache, job_block_keys
from remoteloader.core.cache.memo import TTL_S, BlockMemo
from remoteloader.core.plan import make_task, plan_epoch
from remoteloader.core.processor import SplitProcessor
from remoteloader.core.sampling import plan_job_splits
from remoteloader.formats.table import posix_identity
from remoteloader.master.service import MasterConfig, MasterService
from remoteloader.master.share import JobShares
from remoteloader.master.shared_work import DEFER_S, Candidate, SharedWork
from remoteloader.spec import DatasetSpec
from tests.conftest import spec_dict
from tests.test_fleet import start
from tests.test_master_service import Clock, call, register


class Tick:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def held(**keys: set) -> dict:
    """Jobs as the memo is told them: each with its block keys."""
    return {job: SimpleNamespace(block_keys=frozenset(k)) for job, k in keys.items()}


def block(n: int) -> DenseColumn:
    return DenseColumn(np.zeros(n, np.float64))  # 8n bytes


# -- the memo ---------------------------------------------------------------------------
def test_the_memo_keeps_only_blocks_another_held_job_reads():
    memo = BlockMemo(1 << 20)
    memo.set_jobs(held(a={"k1", "k2"}, b={"k1", "k3"}))
    assert memo.shared(["k1", "k2", "k3"]) == {"k1"}
    memo.put("split", {"k1": block(10), "k2": block(10)})
    assert len(memo) == 1 and memo.counters.puts == 1
    assert list(memo.take("split", ["k1", "k2"])) == ["k1"]
    # Every other job that shares it (one here) has read it: dropped, not counted as expired.
    assert len(memo) == 0 and memo.counters.held_bytes == 0 and memo.counters.expired == 0
    assert memo.take("split", ["k1"]) == {} and memo.counters.hits == 1 and memo.counters.hit_bytes == 80


def test_a_block_shared_by_three_jobs_stays_until_both_others_read_it():
    memo = BlockMemo(1 << 20)
    memo.set_jobs(held(a={"k"}, b={"k"}, c={"k"}))
    memo.put("split", {"k": block(4)})
    assert memo.take("split", ["k"]) and len(memo) == 1
    assert memo.take("split", ["k"]) and len(memo) == 0


def test_the_memo_holds_at_most_its_bytes_dropping_the_oldest_first():
    memo = BlockMemo(max_bytes=250)
    memo.set_jobs(held(a={"k"}, b={"k"}))
    for split in ("s1", "s2", "s3"):
        memo.put(split, {"k": block(10)})  # 80 bytes each
    memo.put("s4", {"k": block(10)})
    assert memo.counters.held_bytes <= 250 and memo.counters.expired == 1
    assert memo.take("s1", ["k"]) == {} and memo.take("s4", ["k"])
    memo.put("huge", {"k": block(100)})  # larger than the whole memo: never kept
    assert memo.take("huge", ["k"]) == {} and memo.counters.held_bytes <= 250


def test_a_block_is_shared_only_within_its_time_to_live():
    clock = Tick()
    memo = BlockMemo(1 << 20, ttl_s=30.0, clock=clock)
    memo.set_jobs(held(a={"k"}, b={"k"}))
    memo.put("old", {"k": block(1)})
    clock.now = 31.0
    memo.put("new", {"k": block(1)})
    assert memo.take("old", ["k"]) == {} and memo.counters.expired == 1
    assert memo.take("new", ["k"])


def test_a_memo_of_no_bytes_shares_nothing():
    memo = BlockMemo(0)
    memo.set_jobs(held(a={"k"}, b={"k"}))
    assert memo.shared(["k"]) == set()


# -- a job's pieces from another job's blocks -------------------------------------------
def jobs_sharing(table, **extra) -> tuple[DatasetSpec, DatasetSpec]:
    """Jobs sharing the dense features and sparse feature ``s1`` (the same closure under
    another name in B), each with a feature of its own, other batch sizes."""
    a = spec_dict(table, batch_size=100, **extra)
    b = spec_dict(table, batch_size=64, **extra)
    b["features"]["sparse"] = [{"name": "hashed", "column": "idlist_1",
                                "transforms": [{"op": "sigrid_hash", "salt": 5, "max_value": 1000}]},
                               {"name": "own", "column": "idlist_2", "transforms": [{"op": "firstx", "x": 2}]}]
    return DatasetSpec.from_dict(a), DatasetSpec.from_dict(b)


@pytest.fixture
def two_jobs(tables) -> tuple[DatasetSpec, DatasetSpec]:
    return jobs_sharing(tables["orc"])


def processors(specs, memo):
    out = []
    for spec in specs:
        bound = bind(spec)
        out.append(SplitProcessor(bound, cache=None if memo is None else JobCache(None, None, bound, memo)))
    if memo is not None:
        memo.set_jobs({str(i): p.cache for i, p in enumerate(out)})
    return out


def pieces(processor: SplitProcessor, task) -> list[dict]:
    return [{k: v.copy() for k, v in p.arrays.items()} for p in processor.pieces(task)]


def tasks(spec: DatasetSpec, world_size: int, epoch: int = 1) -> list:
    bound = bind(spec)
    base = plan_job_splits(bound)
    return [make_task(bound.files, base[s.base], s, epoch)
            for s in plan_epoch(base, epoch, spec.seed, spec.shuffle, world_size, spec.batch_size, spec.drop_last,
                                spec.even_batches)]


@pytest.mark.parametrize("world_size, sampling", [(1, None), (2, None), (1, {"rate": 0.5, "seed": 1, "weight": True})])
def test_a_job_reading_another_jobs_blocks_makes_the_pieces_it_makes_alone(tables, world_size, sampling):
    """Job B's splits after job A's, on one worker: B takes the shared blocks (its label,
    row ids, dense features and the hashed feature; with weighted sampling, the weights)
    from the memo, and the column of its own feature that A's split read along, so it reads
    no table at all; its pieces are byte for byte those B makes alone, whole splits and
    (2 ranks) parts of splits alike."""
    two_jobs = jobs_sharing(tables["orc"], **({"sampling": sampling} if sampling else {}))
    memo = BlockMemo()
    pa, pb = processors(two_jobs, memo)
    _, alone = processors(two_jobs, None)
    for ta, tb in zip(tasks(two_jobs[0], 1), tasks(two_jobs[1], world_size)):
        pieces(pa, ta)
        got, want = pieces(pb, tb), pieces(alone, tb)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.keys() == w.keys() and all(np.array_equal(g[k], w[k]) and g[k].dtype == w[k].dtype for k in g)
    assert memo.counters.hits > 0
    assert pb.io.splits == 0 and pb.io.requests == 0 and alone.io.requests > 0
    assert pa.cache.read_along() == {"idlist_2": 1} and pb.cache.read_along() == {"idlist_0": 1}
    assert pa.cache.block_keys & pb.cache.block_keys == job_block_keys(bind(two_jobs[0])) & pb.cache.block_keys
    # B's own feature is no block of A's, A's own (firstx on idlist_0) none of B's.
    assert len(pa.cache.block_keys - pb.cache.block_keys) == 1 and len(pb.cache.block_keys - pa.cache.block_keys) == 1


def test_blocks_of_another_file_version_are_never_taken(tables, tmp_path):
    """A split of the same path, units and size whose file is another version (rewritten in
    place after job A's split read it: another identity) is another split key: nothing A
    computed is taken. (The shared tables stay untouched: the file rewritten is a copy's.)"""
    specs = jobs_sharing(shutil.copytree(tables["orc"], tmp_path / "orc"))
    memo = BlockMemo()
    pa, pb = processors(specs, memo)
    ta, tb = tasks(specs[0], 1)[0], tasks(specs[1], 1)[0]
    pieces(pa, ta)
    path = tb.file.path
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the same bytes, a new version
    rewritten = dataclasses.replace(tb, file=dataclasses.replace(tb.file, identity=posix_identity(os.stat(path))))
    assert rewritten.file.identity != tb.file.identity
    pieces(pb, rewritten)
    assert memo.counters.hits == 0


# -- the master's choice ----------------------------------------------------------------
def work(**kwargs) -> SharedWork:
    shared = SharedWork(**kwargs)
    shared.add_job("a", frozenset({"k"}))
    shared.add_job("b", frozenset({"k"}))
    shared.add_job("c", frozenset({"other"}))
    return shared


def alive(worker: str) -> bool:
    return True


def test_a_split_given_to_another_worker_for_a_sharing_job_is_left_to_it():
    shared = work()
    shared.handed("a", ("x",), "w1", epoch=0, split_id=0, now=0.0)
    b_x, a_y = Candidate("b", ("x",), {"w1", "w2"}), Candidate("a", ("y",), {"w1", "w2"})
    assert shared.pick("w2", [b_x, a_y], 0.1, alive) == 1  # w2 takes A's next; B's x waits for w1
    assert shared.pick("w1", [b_x, a_y], 0.1, alive) == 0  # w1 holds x's blocks: it takes B's x
    assert shared.counters.deferred == 1


def test_a_split_is_not_left_to_a_worker_that_cannot_take_it_or_to_a_job_sharing_nothing():
    shared = work()
    shared.handed("a", ("x",), "w1", epoch=0, split_id=0, now=0.0)
    a_y = Candidate("a", ("y",), {"w1", "w2"})
    assert shared.pick("w2", [Candidate("b", ("x",), {"w2"}), a_y], 0.1, alive) == 0  # w1 does not serve B's rank
    assert shared.pick("w2", [Candidate("b", ("x",), {"w1", "w2"}), a_y], 0.1, lambda w: w != "w1") == 0  # lost
    assert shared.pick("w2", [Candidate("c", ("x",), {"w1", "w2"}), a_y], 0.1, alive) == 0  # c shares no block
    assert shared.pick("w2", [Candidate("b", ("x",), {"w1", "w2"}), a_y], DEFER_S + 0.5, alive) == 0  # after DEFER_S


def test_a_job_trailing_another_by_seconds_still_leaves_its_splits_to_their_holder():
    """Two jobs read flat out seconds apart (one started first, or read ahead into the epoch):
    the trailing job's split of a base split given to w1 for the leading job seconds ago is
    still left to w1, whose memo keeps the blocks (for ``TTL_S``), while w2 has other work."""
    shared = work()
    shared.handed("a", ("x",), "w1", epoch=0, split_id=0, now=0.0)
    shared.produced("a", 0, 0)
    b_x, a_y = Candidate("b", ("x",), {"w1", "w2"}), Candidate("a", ("y",), {"w1", "w2"})
    assert shared.pick("w2", [b_x, a_y], 4.0, alive) == 1  # 4 s behind: w2 takes A's next
    assert shared.pick("w1", [b_x, a_y], 4.1, alive) == 0
    assert 4.0 < DEFER_S < TTL_S  # the holder takes it while its memo still holds the blocks


def test_with_nothing_else_a_worker_waits_for_a_split_in_flight_elsewhere_but_not_for_long():
    shared = work()
    shared.handed("a", ("x",), "w1", epoch=0, split_id=0, now=0.0)
    b_x = Candidate("b", ("x",), {"w1", "w2"})
    assert shared.pick("w2", [b_x], 0.5, alive) is None  # in flight on w1: wait
    assert shared.pick("w2", [b_x], 1.5, alive) == 0  # past WAIT_S: compute it
    shared.produced("a", 0, 0)
    assert shared.pick("w2", [b_x], 0.5, alive) == 0  # produced: w2 computes it rather than idle
    assert shared.counters.waited == 1


def test_a_passed_over_job_keeps_its_turns():
    shares = JobShares()
    assert shares.order({"a": 1.0, "b": 1.0}) == ["a", "b"]
    shares.served("a", 100)
    assert shares.order({"a": 1.0, "b": 1.0}) == ["b", "a"]
    shares.served("a", 100, behind=["b"])  # b's next split was left to another worker
    shares.served("a", 100, behind=["b"])
    assert shares.order({"a": 1.0, "b": 1.0}) == ["b", "a"]
    shares.served("b", 100)
    shares.served("b", 100)
    assert shares.order({"a": 1.0, "b": 1.0})[0] == "b"  # still owed: 3 splits of a's to its 2


def test_the_master_sends_two_jobs_splits_of_one_base_split_to_one_worker(two_jobs):
    """Two jobs of one table and seed on two workers: the second job's split of a base split
    goes to the worker given the first job's, and the other worker takes other work meanwhile."""
    service = MasterService(MasterConfig(max_jobs=2), None, Clock())
    w1, w2 = register(service, 2)
    start(service, two_jobs[0], "a", 1)
    start(service, two_jobs[1], "b", 1)
    got = [(w, call(service, "get_split", worker_id=w)[1]["split"]) for w in (w1, w2, w1, w2)]
    where = {}
    for w, task in got:
        where.setdefault(task["base"], set()).add(w)
    assert all(len(workers) == 1 for workers in where.values()), got
    assert len({task["fingerprint"] for _, task in got}) == 2
    assert service.status()["shared_work"]["deferred"] >= 1
