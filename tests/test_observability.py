"""No silent waits, seen from outside (issue 22): a master with no way to get workers says
so at start, the numba cache is set for every entry point, and the metrics show a rank
that gets no batches and the pieces workers throw away."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from remoteloader.core.procs import stop
from remoteloader.master.metrics import MasterMetrics, RateWindow
from remoteloader.master.service import MasterService
from remoteloader.protocol.wire import DISCARD_REASONS
from tests.wire_helpers import ask

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "XDG_CACHE_HOME"))}
    return dict(env, PYTHONPATH=REPO, **extra)


# ----------------------------------------------------------------------------- start-up warning

@pytest.mark.slow
def test_a_master_that_starts_no_workers_says_how_to_start_them():
    proc = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_clean_env())
    try:
        addr = proc.stdout.readline().rsplit(" ", 1)[-1].strip()  # "remoteloader-master listening on ADDR"
        assert addr.startswith("tcp://127.0.0.1:")
    finally:
        stop(proc)
    err = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    (line,) = [x for x in err.splitlines() if "starts no workers" in x]
    assert "WARNING" in line and f"remoteloader-worker --master {addr}" in line


# ----------------------------------------------------------------------------- numba cache

def _numba_cache_dir(env: dict[str, str]) -> str:
    """What numba itself will use, in a fresh process that imported only the package."""
    code = ("import sys, remoteloader; assert 'numba' not in sys.modules; "
            "import numba; print(numba.config.CACHE_DIR)")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, cwd=REPO).stdout.strip()


@pytest.mark.slow
def test_importing_the_package_puts_numba_s_cache_in_the_user_cache(tmp_path):
    assert _numba_cache_dir(_clean_env(XDG_CACHE_HOME=str(tmp_path))) == str(tmp_path / "remoteloader" / "numba")


@pytest.mark.slow
def test_a_user_s_numba_cache_dir_is_kept(tmp_path):
    assert _numba_cache_dir(_clean_env(NUMBA_CACHE_DIR=str(tmp_path / "mine"))) == str(tmp_path / "mine")


@pytest.mark.slow
def test_a_trainer_and_the_cli_never_load_numba():
    """numba costs a process 0.3-0.5 s to import: a trainer reading from workers, and
    ``remoteloader status``, never load it, not even to merge pieces (numpy's concatenate)."""
    code = ("import sys\n"
            "import remoteloader.client, remoteloader.tools.cli\n"
            "from remoteloader import RemoteDataLoader\n"
            "assert 'numba' not in sys.modules\n"
            "import numpy as np\n"
            "from remoteloader import jagged\n"
            "piece = jagged.Jagged(1, 2, np.array([1, 2], np.int32), np.arange(3))\n"
            "merged = jagged.concat_rows([(piece, 1, 2), (piece, 0, 1)])\n"
            "assert merged.values.tolist() == [1, 2, 0] and 'numba' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


# ----------------------------------------------------------------------------- metrics

def test_rate_window_knows_how_long_a_counter_has_not_moved():
    w = RateWindow()
    assert w.unchanged_for("c:a", "batches", 10.0) is None and w.last_report("c:a") is None
    w.update("c:a", 1.0, {"batches": 0})
    w.update("c:a", 2.0, {"batches": 5})
    w.update("c:a", 3.0, {"batches": 5, "queued": 2})
    assert w.unchanged_for("c:a", "batches", 10.0) == 8.0
    assert w.last_report("c:a") == (3.0, {"batches": 5, "queued": 2})
    w.forget(set())
    assert w.unchanged_for("c:a", "batches", 10.0) is None


def _value(metrics: MasterMetrics, name: str, **labels) -> float:
    text = generate_latest(metrics.registry).decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _join(service: MasterService, rank: int, world_size: int) -> tuple[str, int]:
    spec = service.spec
    t, welcome = ask(service, {"t": "hello", "rank": rank, "world_size": world_size, "spec": spec.to_dict(),
                                 "fingerprint": spec.fingerprint()})
    assert t == "welcome", welcome
    session = welcome["session"]
    t, epoch = ask(service, {"t": "start_epoch", "session": session, "epoch": 0})
    assert t == "epoch", epoch
    return session, epoch["seq"]


def _client_heartbeat(service: MasterService, session: str, seq: int, stats: dict) -> None:
    t, reply = ask(service, {"t": "client_heartbeat", "session": session, "seq": seq, "acks": [], "stats": stats})
    assert t == "membership", reply


def test_last_batch_age_per_rank_from_what_clients_report_or_from_their_batch_count(service):
    metrics = MasterMetrics(service, process_metrics=False)
    reporting, seq0 = _join(service, 0, 2)
    silent, seq1 = _join(service, 1, 2)   # an older client: no since_batch_s in its stats
    _client_heartbeat(service, reporting, seq0, {"batches": 3, "since_batch_s": 4.0})
    _client_heartbeat(service, silent, seq1, {"batches": 3})
    service.now[0] += 2
    _client_heartbeat(service, silent, seq1, {"batches": 3})   # no batch since the last report
    service.now[0] += 1
    assert _value(metrics, "remoteloader_client_last_batch_age_seconds", rank="0") == 4.0 + 3
    assert _value(metrics, "remoteloader_client_last_batch_age_seconds", rank="1") == 3.0
    _client_heartbeat(service, silent, seq1, {"batches": 4})
    assert _value(metrics, "remoteloader_client_last_batch_age_seconds", rank="1") == 0.0


def test_discarded_pieces_are_counted_by_reason_through_worker_restarts(service):
    metrics = MasterMetrics(service, process_metrics=False)
    for reason in DISCARD_REASONS:
        assert _value(metrics, "remoteloader_worker_pieces_discarded_total", reason=reason) == 0

    def worker(port: int) -> str:
        t, reply = ask(service, {"t": "register", "addr": f"tcp://127.0.0.1:{port}", "pid": port,
                                   "fingerprint": service.spec.fingerprint()})
        assert t == "registered", reply
        return reply["worker_id"]

    def heartbeat(worker_id: str, discarded: dict) -> None:
        service.now[0] += 1
        t, _ = ask(service, {"t": "heartbeat", "worker_id": worker_id, "token": service.keys.worker_token(worker_id),
                               "buffered": 0,
                               "stats": {"discarded": discarded}})
        assert t == "heartbeat_ok"

    a, b = worker(7000), worker(7001)
    heartbeat(a, {"stale_run": 2})
    heartbeat(a, {"stale_run": 5, "session_gone": 1})
    heartbeat(b, {"stale_run": 1, "yielded": 4})
    ask(service, {"t": "bye", "worker_id": a, "token": service.keys.worker_token(a)})
    service.tick()                                    # a is forgotten: what it counted stays
    heartbeat(b, {"stale_run": 1, "yielded": 6})
    assert _value(metrics, "remoteloader_worker_pieces_discarded_total", reason="stale_run") == 6
    assert _value(metrics, "remoteloader_worker_pieces_discarded_total", reason="session_gone") == 1
    assert _value(metrics, "remoteloader_worker_pieces_discarded_total", reason="yielded") == 6
    assert _value(metrics, "remoteloader_worker_pieces_discarded_total", reason="silent") == 0
