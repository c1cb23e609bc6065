"""Credit, push, release and the epoch loop through a real master, workers and loaders, all
in this process (tests/cluster.py): the fast tier's end-to-end tests."""
from __future__ import annotations

import time

from tests.conftest import ROWS, spec_dict
from tests.test_end_to_end import assert_same, collect, read_reference


def rows_of(batches) -> list[int]:
    return [r for b in batches for r in b.passthrough["row_id"].tolist()]


def test_every_row_once_with_its_values_in_epochs_0_1_0_of_one_loader(tables, inprocess):
    cluster = inprocess(workers=2)
    expected = read_reference(tables["parquet"])
    loader = cluster.loader(spec_dict(tables["parquet"]))
    for epoch in (0, 1, 0):
        loader.set_epoch(epoch)
        got, sizes = collect(loader)
        assert_same(got, expected)
        assert sizes[:-1] == [256] * (len(sizes) - 1) and sum(sizes) == ROWS


def test_the_window_grows_while_a_worker_holds_pieces_the_loop_waits_for(tables, inprocess):
    cluster = inprocess(workers=1, buffer_batches=32)
    # One piece of credit and 18 pieces per split: the worker holds pieces it may not send.
    loader = cluster.loader(spec_dict(tables["orc"], batch_size=50), inflight=1)
    rows = rows_of(loader)
    assert sorted(rows) == list(range(ROWS))
    assert loader.credit.grown >= 1


def test_a_silent_rank_s_pieces_are_released_and_produced_again_when_it_reads(tables, inprocess):
    cluster = inprocess(workers=1, buffer_batches=8, client_timeout_s=1.0)
    spec = spec_dict(tables["orc"], batch_size=50, split_rows=500)
    reader = cluster.loader(spec, rank=0, world_size=2)
    sleeper = cluster.loader(spec, rank=1, world_size=2)
    asleep = iter(sleeper)
    rows1 = rows_of([next(asleep)])  # rank 1 starts its epoch, then stops reading
    rows0 = rows_of(reader)  # rank 0 is served meanwhile
    assert len(rows0) == len(set(rows0)) == ROWS // 2
    buffer = cluster.workers[0].worker.buffer
    deadline = time.monotonic() + 10  # released about a second after it went silent
    while not buffer.discarded().get("silent") and time.monotonic() < deadline:
        time.sleep(0.05)  # the worker's own clock decides when rank 1 is silent
    assert buffer.discarded().get("silent"), "the worker kept what it held for a silent rank"
    rows1 += rows_of(asleep)
    assert len(rows1) == len(set(rows1)) == ROWS // 2
    assert sorted(rows0 + rows1) == list(range(ROWS))
