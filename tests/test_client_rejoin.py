"""The client's one rejoin path with real processes: a master restarted without a journal
between two epochs (defect 7: the next iter() raised ``unknown client``); the next epoch
completes exactly once. And a loader's close says goodbye: the master forgets it at once."""
from __future__ import annotations

from remoteloader import RemoteDataLoader

from .conftest import ROWS, master_status, spec_dict


def row_ids(batches) -> list[int]:
    return sorted(r for b in batches for r in b.passthrough["row_id"].tolist())


def test_a_master_restarted_without_journal_between_epochs_is_rejoined_by_the_next_epoch(tables, cluster):
    master = cluster.master("--heartbeat-timeout", "3", workers=0)
    cluster.workers(master.addr, 2)
    with RemoteDataLoader(spec_dict(tables["orc"], batch_size=100), master=master.addr, timeout=120) as loader:
        assert row_ids(loader) == list(range(ROWS))
        master.kill()
        cluster.master("--heartbeat-timeout", "3", workers=0, bind=master.addr)
        assert row_ids(loader) == list(range(ROWS))


def test_a_closed_loader_is_forgotten_at_once(tables, cluster):
    master = cluster.master(workers=1)
    with RemoteDataLoader(spec_dict(tables["orc"]), master=master.addr, timeout=60) as loader:
        next(iter(loader))
        assert len(master_status(master.addr)["clients"]) == 1
    assert master_status(master.addr)["clients"] in ([], {})
