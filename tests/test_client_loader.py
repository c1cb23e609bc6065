"""The loader's front, in process: a replaced iterator raises; the torchrun meeting point (the
multi-host refusal, the close count) on an in-process store."""
from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from remoteloader import RemoteDataLoader
from remoteloader.client import ranks
from remoteloader.client.loader import EpochIterator
from remoteloader.client.ranks import MultiHostError, RankStore
from remoteloader.spec import load_spec

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


def test_a_rank_on_another_host_than_the_embedded_master_refuses_at_construction(group, monkeypatch):
    fingerprint = load_spec(SPEC).fingerprint()
    monkeypatch.setattr(socket, "gethostname", lambda: "host-a")
    group.publish_master("tcp://127.0.0.1:5555", fingerprint, "/tmp/rank0-private-keys")
    monkeypatch.setattr(socket, "gethostname", lambda: "host-b")
    monkeypatch.delenv("REMOTELOADER_MASTER", raising=False)
    with pytest.raises(MultiHostError) as err:
        RemoteDataLoader(SPEC, rank=1, world_size=2, connect_timeout=5)
    message = str(err.value)
    assert "\n" not in message
    for needed in ("host-b", "host-a", "REMOTELOADER_MASTER", "remoteloader-master --bind tcp://0.0.0.0:PORT --auth DIR",
                   "REMOTELOADER_AUTH"):
        assert needed in message


def test_the_owner_waits_until_every_rank_counted_itself_out(group):
    store = group
    published = store.publish_master("tcp://127.0.0.1:5555", "f", None)
    store.count_closed(published.token)
    assert not store.wait_closed(published.token, world_size=2, timeout=0.2)  # bounded: gives up, logged
    store.count_closed(published.token)
    assert store.wait_closed(published.token, world_size=2, timeout=ranks.CLOSE_WAIT_S)
    again = store.publish_master("tcp://127.0.0.1:5555", "f", None)  # the same port later: a count of its own
    assert not store.wait_closed(again.token, world_size=1, timeout=0.1)
