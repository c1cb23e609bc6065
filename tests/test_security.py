"""Hostile clients against a real worker: a forged far-off epoch and a client that never reads."""
from __future__ import annotations

import json
import signal
import subprocess
import time

import msgpack
import zmq

from remoteloader import RemoteDataLoader
from tests.conftest import BIN, ROWS, spec_dict


def status(addr: str) -> dict:
    out = subprocess.run([str(BIN / "remoteloader"), "status", "--master", addr, "--json"],
                         capture_output=True, text=True, check=True, timeout=30)
    return json.loads(out.stdout)


def get_batch(rank: int, epoch: int) -> list:
    return [msgpack.packb({"v": 2, "t": "get_batch", "rank": rank, "epoch": epoch})]


def test_worker_survives_forged_epochs_and_a_client_that_never_reads(tables, cluster):
    master = cluster.master(workers=0)
    (worker,) = cluster.workers(master.addr, 1, "--buffer-batches", "64", "--drain-timeout", "5")
    spec = spec_dict(tables["orc"], batch_size=1, split_rows=2500)      # thousands of one-row pieces
    ctx = zmq.Context.instance()
    with RemoteDataLoader(spec, master=master.addr, rank=0, world_size=2, timeout=120) as loader:
        len(loader)                                                      # the job exists, with 2 ranks
        deadline = time.monotonic() + 60
        while not status(master.addr)["workers"] and time.monotonic() < deadline:
            time.sleep(0.2)
        addr = status(master.addr)["workers"][0]["addr"]
        hostile = ctx.socket(zmq.DEALER)
        hostile.setsockopt(zmq.LINGER, 0)
        hostile.setsockopt(zmq.RCVHWM, 10)
        hostile.connect(addr)
        hostile.send_multipart(get_batch(0, 2**62))                      # would discard rank 0's epoch
        for _ in range(5000):                                            # takes rank 1's pieces, reads none
            hostile.send_multipart(get_batch(1, 0))
        rows = [int(r) for b in loader for r in b.passthrough["row_id"].tolist()]
        assert len(rows) == len(set(rows)) == ROWS // 2
        seen = status(master.addr)["workers"][0]["last_seen_s"]
        assert seen < 5                                                  # still heartbeating
        hostile.close()
    # SIGTERM drains; rank 1's pieces are never consumed, so it leaves at its drain timeout.
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) is not None
