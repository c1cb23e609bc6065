"""Rates from heartbeat counters, and the Prometheus endpoint."""
from __future__ import annotations

import urllib.request

from remoteloader.master.metrics import MetricsServer, RateWindow, prometheus_text


def test_rate_window_turns_counters_into_rates():
    w = RateWindow(window_s=10)
    assert w.rate("a", "rows") == 0.0
    for t in range(0, 30):
        w.update("a", float(t), {"rows": 100 * t, "wait_s": 0.25 * t})
    assert w.rate("a", "rows") == 100.0
    assert w.rate("a", "wait_s") == 0.25
    w.update("a", 5.0, {"rows": 0})  # reordered report: ignored
    assert w.rate("a", "rows") == 100.0
    w.forget(set())
    assert w.rate("a", "rows") == 0.0


STATUS = {
    "workers": [{"id": "w-1", "buffered": 3, "rows_per_s": 1500.0, "cpu": 0.5, "rows": 9000,
                 "io": {"requests": 12, "bytes_requested": 4096}}],
    "clients": [{"id": "c-1", "rank": 0, "stall": 0.02, "batches_per_s": 20.0}],
    "ranks": {"0": {"epoch": 1, "done": 4, "splits": 8}},
    "errors": [],
}


def test_prometheus_text_and_endpoint():
    text = prometheus_text(STATUS)
    assert 'remoteloader_worker_rows_per_second{worker="w-1"} 1500.0' in text
    assert 'remoteloader_client_stall_fraction{client="c-1",rank="0"} 0.02' in text
    assert "# TYPE remoteloader_worker_rows_total counter" in text
    server = MetricsServer(0)
    try:
        server.publish(STATUS)
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
        assert body == text
    finally:
        server.close()
