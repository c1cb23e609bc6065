"""Hostile clients against a real worker: a forged far-off epoch and a client that never reads."""
from __future__ import annotations

import json
import signal
import subprocess
import time

import msgpack
import pytest
import zmq

from remoteloader import RemoteDataLoader
from remoteloader.protocol.wire import PROTOCOL_VERSION
from tests.conftest import BIN, ROWS, master_status, spec_dict


def credit(rank: int, epoch: int) -> list:
    """One piece of credit for (rank, epoch), as a client grants it."""
    return [msgpack.packb({"v": PROTOCOL_VERSION, "t": "credit", "rank": rank, "epoch": epoch, "batches": 1,
                           "bytes": 1 << 30})]


def test_worker_survives_forged_epochs_and_a_client_that_never_reads(tables, cluster):
    master = cluster.master(workers=0)
    (worker,) = cluster.workers(master.addr, 1, "--buffer-batches", "64", "--drain-timeout", "5")
    spec = spec_dict(tables["orc"], batch_size=1, split_rows=2500)      # thousands of one-row pieces
    ctx = zmq.Context.instance()
    with RemoteDataLoader(spec, master=master.addr, rank=0, world_size=2, timeout=120) as loader:
        len(loader)                                                      # the job exists, with 2 ranks
        deadline = time.monotonic() + 60
        while not master_status(master.addr)["workers"] and time.monotonic() < deadline:
            time.sleep(0.2)
        addr = master_status(master.addr)["workers"][0]["addr"]
        hostile = ctx.socket(zmq.DEALER)
        hostile.setsockopt(zmq.LINGER, 0)
        hostile.setsockopt(zmq.RCVHWM, 10)
        hostile.connect(addr)
        hostile.send_multipart(credit(0, 2**62))                      # would discard rank 0's epoch
        for _ in range(5000):                                            # takes rank 1's pieces, reads none
            hostile.send_multipart(credit(1, 0))
        rows = [int(r) for b in loader for r in b.passthrough["row_id"].tolist()]
        assert len(rows) == len(set(rows)) == ROWS // 2
        seen = master_status(master.addr)["workers"][0]["last_seen_s"]
        assert seen < 5                                                  # still heartbeating
        hostile.close()
    # SIGTERM drains; rank 1's pieces are never consumed, so it leaves at its drain timeout.
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) is not None


@pytest.mark.parametrize("client_timeout, silent_s", [
    ("60", 1.0),  # rank 1 is never silent long enough: its share and the producer's yield keep rank 0 fed
    ("1", 2.0),   # rank 1 goes silent: what the worker held for it is released, then produced again
])
def test_a_rank_that_stops_reading_does_not_starve_another(tables, cluster, client_timeout, silent_s):
    master = cluster.master(workers=0)
    cluster.workers(master.addr, 1, "--buffer-batches", "8", "--client-timeout", client_timeout)
    spec = spec_dict(tables["orc"], batch_size=50, split_rows=500)
    with RemoteDataLoader(spec, master=master.addr, rank=0, world_size=2, timeout=30) as reader, \
            RemoteDataLoader(spec, master=master.addr, rank=1, world_size=2, timeout=30) as sleeper:
        asleep = iter(sleeper)
        rows1 = next(asleep).passthrough["row_id"].tolist()   # rank 1 starts its epoch, then stops reading
        rows0 = [r for b in reader for r in b.passthrough["row_id"].tolist()]
        assert len(rows0) == len(set(rows0)) == ROWS // 2
        time.sleep(silent_s)
        rows1 += [r for b in asleep for r in b.passthrough["row_id"].tolist()]
    assert len(rows1) == len(set(rows1)) == ROWS // 2
    assert sorted(rows0 + rows1) == list(range(ROWS))


def test_a_worker_refuses_a_job_outside_its_allowlist(tables, cluster, tmp_path):
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec_dict(tables["orc"])))
    master = cluster.master("--spec", str(spec_path), workers=0)
    elsewhere = tmp_path / "other-tables"
    elsewhere.mkdir()
    refused = subprocess.run([str(BIN / "remoteloader-worker"), "--master", master.addr,
                              "--allow-table", str(elsewhere)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "outside this worker's --allow-table" in refused.stderr and str(tables["orc"]) in refused.stderr
    # Launched workers get the master's own tables: the job is served.
    cluster.workers(master.addr, 1, "--allow-table", str(tables["orc"]))
    with RemoteDataLoader(spec_dict(tables["orc"]), master=master.addr, timeout=60) as loader:
        assert sum(len(b) for b in loader) == ROWS


@pytest.mark.slow
def test_a_master_refuses_a_percent_encoded_traversal_as_it_refuses_a_missing_table(tmp_path):
    """The red team read 1,000 of 1,000 rows of a mode-0600 table through
    ``file://ALLOWED/%2e%2e/secret/t``, and told existing from missing paths apart."""
    from remoteloader.spec import SpecError
    from remoteloader.tools.datagen import generate_table
    from tests.conftest import wait_gone

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    generate_table(str(tmp_path / "secret" / "t"), rows=1000, dense=1, sparse=1, seed=3, progress=False)
    for f in (tmp_path / "secret" / "t").rglob("*.orc"):
        f.chmod(0o600)
    proc = subprocess.Popen([str(BIN / "remoteloader-master"), "--bind", "tcp://127.0.0.1:0", "--workers", "0",
                             "--allow-table", str(allowed)], stdout=subprocess.PIPE, text=True)
    try:
        addr = proc.stdout.readline().rsplit(" ", 1)[1].strip()
        answers = []
        for table in ("secret/t", "missing/t"):
            spec = {"table": f"file://{allowed}/%2e%2e/{table}", "features": {"label": "label"}}
            with pytest.raises(SpecError) as refused:
                len(RemoteDataLoader(spec, master=addr, timeout=30))
            answers.append(str(refused.value))
        assert answers[0] == answers[1]
        assert "this master does not serve that table" in answers[0]
    finally:
        proc.kill()
        proc.wait()
        wait_gone([proc.pid])
