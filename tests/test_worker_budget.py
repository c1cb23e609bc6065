"""A worker's held data bounded in bytes (issue 25): the size estimate and the planner's
cap, read-ahead only with room, busy time that excludes waiting, and real processes
holding no more than their --buffer-bytes whatever the split and batch size."""
from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from remoteloader import RemoteDataLoader
from remoteloader.core.binding import bind
from remoteloader.core.plan import EpochSplit, make_task, plan_base_splits
from remoteloader.core.processor import SplitProcessor
from remoteloader.core.sizing import ESTIMATE_MARGIN, parse_size, row_bytes, split_nbytes, split_rows_within
from remoteloader.master.journal import Journal
from remoteloader.protocol import messages as M
from remoteloader.protocol.rpc import RpcClient
from remoteloader.spec import DatasetSpec
from remoteloader.tools.datagen import generate_table
from remoteloader.worker.buffer import STORED
from remoteloader.worker.producer import Producer
from remoteloader.worker.runs import Run
from tests.conftest import spec_dict
from tests.test_master_service import Clock, call, hello, make_service, register, session, spec  # noqa: F401 (a fixture)


def test_sizes_take_suffixes_in_powers_of_1024():
    assert parse_size("268435456") == 256 << 20
    assert [parse_size(s) for s in ("256M", "256MiB", "1g", "64k", "2T")] == [256 << 20, 256 << 20, 1 << 30,
                                                                              64 << 10, 2 << 40]
    for bad in ("", "-1", "0", "1.5G", "12X", "M"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize("fmt", ["orc", "parquet"])
def test_the_estimate_from_a_sample_is_what_splits_cost(tables, fmt):
    bound = bind(DatasetSpec.from_dict(spec_dict(tables[fmt])))
    estimate = row_bytes(bound)
    processor = SplitProcessor(bound)
    nbytes = rows = 0
    for s in plan_base_splits(bound.files, 900):
        split = processor.transform(make_task(bound.files, s, EpochSplit(0, 0, s.id, 0, s.rows), epoch=0))
        nbytes, rows = nbytes + split_nbytes(split.tensors), rows + split.rows
    # The synthetic table's rows are alike: the first unit stands for all of them.
    assert 0.8 < estimate / (nbytes / rows) < 1.25
    assert split_rows_within(1 << 20, estimate) * estimate <= 1 << 19


def test_the_planner_cuts_smaller_splits_when_one_would_exceed_half_the_budget(tables, caplog):
    # Files of 1,250 rows in row groups of 700 and 550: one split a file.
    spec = DatasetSpec.from_dict(spec_dict(tables["parquet"], split_rows=5000))
    per_row = row_bytes(bind(spec))
    generous = make_service(spec, Clock())
    assert [s.raw_rows for s in generous.state.job.splits] == [1250] * 4
    budget = int(2 * 800 * ESTIMATE_MARGIN * per_row)  # half of it holds 800 rows (and the margin): a row group
    with caplog.at_level(logging.WARNING, logger="remoteloader.master.service"):
        small = make_service(spec, Clock(), buffer_bytes=budget)
    (warning,) = [r.getMessage() for r in caplog.records if "split_rows" in r.getMessage()]
    cap = split_rows_within(budget, per_row)
    assert 750 <= cap <= 800
    assert "split_rows 5000" in warning and "1250 rows" in warning and "--buffer-bytes" in warning and f"at most {cap} rows" in warning
    splits = small.state.job.splits
    assert max(s.raw_rows for s in splits) <= cap and len(splits) > len(generous.state.job.splits)
    assert sum(s.rows for s in splits) == generous.state.job.total_rows
    assert small.state.job.plan_fingerprint != generous.state.job.plan_fingerprint  # the clients see another plan
    # Workers hear the estimate of the largest split with the spec: within half the budget.
    t, reply = call(small, "get_spec")
    assert t == "spec" and 0 < reply["split_bytes"] <= budget // 2
    assert small.status()["job"]["split_bytes"] == reply["split_bytes"]
    # A unit larger than the cap cannot be cut: it stays one split, and the warning says so.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remoteloader.master.service"):
        tiny = make_service(spec, Clock(), buffer_bytes=int(2 * 100 * ESTIMATE_MARGIN * per_row))
    assert [s.raw_rows for s in tiny.state.job.splits] == [u.num_rows for f in bind(spec).files for u in f.units]
    assert "cannot be cut smaller" in caplog.text


def test_a_replayed_job_keeps_its_journaled_splits_whatever_the_budget(tables, tmp_path):
    spec = DatasetSpec.from_dict(spec_dict(tables["parquet"], split_rows=5000))
    budget = int(2 * 800 * ESTIMATE_MARGIN * row_bytes(bind(spec)))
    first = make_service(spec, Clock(), Journal(str(tmp_path)), buffer_bytes=budget)
    plan = first.state.job.plan_fingerprint
    first.journal.close()
    again = make_service(spec, Clock(), Journal(str(tmp_path)))  # another budget: the journal's splits hold
    assert again.state.job.plan_fingerprint == plan and again.split_bytes is None  # not estimated again
    again.journal.close()


def test_the_master_reads_ahead_only_for_a_worker_with_room(spec):
    service = make_service(spec, Clock())
    (w,) = register(service)
    hello(service, spec)
    call(service, "start_epoch", session=session(service, "c0"), epoch=0)
    while (reply := call(service, "get_split", worker_id=w, read_ahead=False))[0] == "split":
        assert reply[1]["split"]["epoch"] == 0  # current work needs no room to read ahead
    assert service.state.prefetched == {}  # no room: nothing of epoch 1 started
    t, reply = call(service, "get_split", worker_id=w)  # room for one split read ahead
    assert t == "split" and reply["split"]["epoch"] == 1
    assert call(service, "get_split", worker_id=w)[0] == "no_split"  # one at a time, as before


def test_held_bytes_and_busy_in_the_status(spec):
    clock = Clock()
    service = make_service(spec, clock)
    (w,) = register(service)
    for step in range(1, 4):
        clock.now += 1
        call(service, "heartbeat", worker_id=w, buffered=2,
             stats={"busy_s": 0.25 * step, "held_bytes": 3000, "ahead_bytes": 1000, "budget_bytes": 8000})
    (worker,) = service.status()["workers"]
    assert (worker["held_bytes"], worker["ahead_bytes"], worker["budget_bytes"], worker["busy"]) == \
        (3000, 1000, 8000, 0.25)


def test_busy_time_counts_producing_not_waiting_for_room():
    """A split of 4 pieces: each costs 1 s to make, and the buffer keeps the producer
    waiting 10 s for room before taking it: busy is the 4 s of work."""
    clock = Clock()
    split = SimpleNamespace(tensors={"labels": np.zeros(8, np.float32)})

    def pieces(task):
        for i in range(4):
            clock.now += 1.0  # reading, transforming, cutting
            yield SimpleNamespace(source=split, rows=2, index=i)

    class Buffer:
        finished_with = None

        def put(self, run, piece, stop):
            clock.now += 10.0  # a full share, or no room in the budget
            return STORED

        def held(self, run):
            return 2

        def finished(self, s):
            self.finished_with = s

    buffer = Buffer()
    producer = Producer(SimpleNamespace(stop=threading.Event()), None, buffer, None, None, None,
                        SimpleNamespace(before_piece=lambda stop: None), clock=clock)
    session = SimpleNamespace(processor=SimpleNamespace(pieces=pieces))
    producer.stats.producing = [0, 0, 0]  # as _process sets it
    outcome, failure = producer._produce(session, None, Run("s", 0, rank=0, epoch=0), None)
    assert (outcome, failure) == (STORED, None)
    assert producer.stats.busy_s == 4.0 and producer.stats.rows == 8 and buffer.finished_with is split


# -- real processes: a master and a worker, 20,000-row splits at batch 64 ---------------------
ROWS = 80_000


@pytest.fixture(scope="module")
def wide_splits(tmp_path_factory):
    """One Parquet file of 80,000 rows in row groups of 1,000: 20,000-row splits, or smaller."""
    path = tmp_path_factory.mktemp("budget") / "t"
    generate_table(str(path), rows=ROWS, partitions=1, dense=4, sparse=4, format="parquet", seed=11,
                   row_group_rows=1000, files_per_partition=1, progress=False)
    return path


class StatusPoller:
    """Reads the master's status every 50 ms on a thread: the workers' heartbeat stats."""

    def __init__(self, addr: str) -> None:
        self.samples: list[dict] = []
        self.status: dict = {}
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._rpc = RpcClient(self._ctx, addr, 5.0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.status = self._rpc.call(M.Status()).status
            self.samples += [w for w in self.status["workers"] if "held_bytes" in w]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._rpc.close()
        self._ctx.term()


@pytest.mark.parametrize("budget", ["256M", "3M"])
def test_a_worker_holds_no_more_than_its_budget_and_every_row_comes_once(wide_splits, cluster, budget):
    spec = spec_dict(wide_splits, batch_size=64, split_rows=20_000)
    per_row = row_bytes(bind(DatasetSpec.from_dict(spec)))
    budget_bytes = parse_size(budget)
    split_bytes = 20_000 * per_row
    assert (split_bytes < budget_bytes / 2) == (budget == "256M")  # the small budget holds less than one split
    master = cluster.master("--buffer-bytes", budget, workers=0)
    cluster.workers(master.addr, 1, "--buffer-bytes", budget)
    poller = StatusPoller(master.addr)
    try:
        with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
            for _ in range(2):  # two epochs: the second is read ahead while the first ends
                ids = []
                for batch in loader:
                    ids.append(batch.passthrough["row_id"].numpy().copy())
                    time.sleep(0.002)  # a trainer slower than the worker: its buffer fills up
                assert np.array_equal(np.sort(np.concatenate(ids)), np.arange(ROWS))  # each row once
    finally:
        poller.stop()
    job = poller.status["job"]
    if budget == "3M":
        assert job["splits"] > ROWS // 20_000  # the planner cut smaller splits, within half the budget
        assert job["split_bytes"] <= budget_bytes // 2
    else:
        assert job["splits"] == ROWS // 20_000
    held = [w["held_bytes"] for w in poller.samples]
    assert poller.samples and all(w["budget_bytes"] == budget_bytes for w in poller.samples)
    assert max(held) > 0  # it did hold splits while the trainer read
    assert max(held) <= budget_bytes, f"held {max(held):,} bytes, budget {budget_bytes:,}"
    assert all(w["ahead_bytes"] <= w["held_bytes"] for w in poller.samples)
