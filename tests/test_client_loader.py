"""The loader's front, in process: a replaced iterator raises; a waiting client says what it
waits for; the torchrun meeting point (the close count) on an in-process store."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from remoteloader import RemoteDataLoader
from remoteloader.client import ranks, stream
from remoteloader.client.loader import EpochIterator
from remoteloader.client.ranks import RankStore

from .test_client_session import JOB, FakeMaster

SPEC = {"table": {"path": "/nonexistent"}, "batch_size": 2, "features": {"label": "label", "dense": ["x"]}}


def test_an_iterator_replaced_by_a_newer_iter_raises_saying_so():
    # A master address nobody answers at: nothing is called before the first batch is asked for.
    with RemoteDataLoader(SPEC, master="tcp://127.0.0.1:9", rank=0, world_size=1) as loader:
        first = iter(loader)
        iter(loader)
        with pytest.raises(RuntimeError, match="replaced by a newer iter"):
            next(first)


def test_a_replaced_iterator_stops_its_epoch():
    closed = []

    def batches():
        try:
            yield 1
            yield 2
        finally:
            closed.append(True)

    it = EpochIterator(batches(), epoch=4)
    assert next(it) == 1
    it.replace()
    assert closed == [True]
    with pytest.raises(RuntimeError, match="iterator of epoch 4 was replaced"):
        next(it)


@pytest.fixture
def group():
    """A one-process group on an in-process store, standing in for a torchrun job's."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield RankStore(ranks.default_store())
    dist.destroy_process_group()


def test_the_owner_waits_until_every_rank_counted_itself_out(group):
    store = group
    published = store.publish_master("tcp://127.0.0.1:5555", "f", None)
    store.count_closed(published.token)
    assert not store.wait_closed(published.token, world_size=2, timeout=0.2)  # bounded: gives up, logged
    store.count_closed(published.token)
    assert store.wait_closed(published.token, world_size=2, timeout=ranks.CLOSE_WAIT_S)
    again = store.publish_master("tcp://127.0.0.1:5555", "f", None)  # the same port later: a count of its own
    assert not store.wait_closed(again.token, world_size=1, timeout=0.1)


def test_a_waiting_client_says_what_it_waits_for_and_its_timeout_is_one_line(monkeypatch, caplog):
    answers = {"hello": ("welcome", {"session": "s-1", "token": "t", "job": dict(JOB, rank_rows=10)}),
               "start_epoch": ("epoch", {"epoch": 0, "seq": 0, "splits": [[0, 10, 0, 0, False]]}),
               "client_heartbeat": ("membership", {"workers": [], "errors": []}),  # no worker, ever
               "status": ("status_reply", {"status": {"workers": {}}}),
               "goodbye": ("ok", {})}
    fake = FakeMaster(lambda h: answers[h["t"]])
    monkeypatch.setattr(stream, "WAIT_LOG_S", 0.15)
    try:
        with caplog.at_level("WARNING", logger="remoteloader.client.stream"):
            with RemoteDataLoader(SPEC, master=fake.addr, rank=0, world_size=1, timeout=0.5) as loader:
                with pytest.raises(TimeoutError) as err:
                    next(iter(loader))
        message = str(err.value)
        assert "\n" not in message and "no worker registered in this rank's partition" in message
        assert "0 of 10 rows received" in message and "status" not in message
        waits = [r.getMessage() for r in caplog.records if "no batch for" in r.getMessage()]
        assert waits and "no worker registered" in waits[0]
        assert any("master status at the timeout" in r.getMessage() for r in caplog.records)
        assert fake.types()[-1] == "goodbye"
    finally:
        fake.close()
