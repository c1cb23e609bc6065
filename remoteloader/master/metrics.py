"""Rates from heartbeats, and the same status as Prometheus metrics.

Workers and clients report cumulative counters (rows produced, seconds spent waiting);
``RateWindow`` turns them into rates over a sliding window, which is what the status
page, the metrics endpoint and the autoscaler read. This is measurement, not job state:
it lives beside ``JobState`` and is rebuilt from the next heartbeats after a restart.
"""
from __future__ import annotations

import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional


class RateWindow:
    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: dict[str, deque] = {}

    def update(self, key: str, time: float, counters: dict) -> None:
        samples = self._samples.setdefault(key, deque())
        if samples and time <= samples[-1][0]:
            return  # a repeated or reordered report carries nothing new
        samples.append((time, counters))
        while len(samples) > 2 and time - samples[1][0] >= self.window_s:
            samples.popleft()

    def rate(self, key: str, counter: str) -> float:
        """Increase of ``counter`` per second over the window (0 until two samples exist)."""
        samples = self._samples.get(key)
        if not samples or len(samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = samples[0], samples[-1]
        return max(0.0, (c1.get(counter, 0) - c0.get(counter, 0)) / (t1 - t0))

    def forget(self, live: set) -> None:
        for key in [k for k in self._samples if k not in live]:
            del self._samples[key]


def prometheus_text(status: dict) -> str:
    """The status dict in Prometheus' text exposition format."""
    lines = []

    def metric(name: str, help_: str, kind: str, samples: list) -> None:
        lines.append(f"# HELP remoteloader_{name} {help_}")
        lines.append(f"# TYPE remoteloader_{name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"remoteloader_{name}{{{label_text}}} {float(value)}" if label_text
                         else f"remoteloader_{name} {float(value)}")

    workers = status.get("workers", [])
    metric("workers", "Live workers.", "gauge", [({}, len(workers))])
    metric("worker_buffered_batches", "Batches in a worker's buffer.", "gauge",
           [({"worker": w["id"]}, w["buffered"]) for w in workers])
    metric("worker_rows_per_second", "Rows a worker produced per second (window).", "gauge",
           [({"worker": w["id"]}, w.get("rows_per_s", 0.0)) for w in workers])
    metric("worker_cpu_utilization", "CPU utilization of a worker process (0..1).", "gauge",
           [({"worker": w["id"]}, w.get("cpu", 0.0)) for w in workers])
    metric("worker_rows_total", "Rows a worker produced since it started.", "counter",
           [({"worker": w["id"]}, w.get("rows", 0)) for w in workers])
    metric("worker_read_requests_total", "Storage read requests a worker issued.", "counter",
           [({"worker": w["id"]}, w.get("io", {}).get("requests", 0)) for w in workers])
    metric("worker_bytes_read_total", "Bytes a worker requested from storage.", "counter",
           [({"worker": w["id"]}, w.get("io", {}).get("bytes_requested", 0)) for w in workers])
    clients = status.get("clients", [])
    metric("client_stall_fraction", "Share of time a trainer waited for batches (window).", "gauge",
           [({"client": c["id"], "rank": c["rank"]}, c.get("stall", 0.0)) for c in clients])
    metric("client_batches_per_second", "Batches a trainer consumed per second (window).", "gauge",
           [({"client": c["id"], "rank": c["rank"]}, c.get("batches_per_s", 0.0)) for c in clients])
    ranks = status.get("ranks", {})
    metric("rank_splits_done", "Splits of the rank's current epoch fully consumed.", "gauge",
           [({"rank": r, "epoch": v["epoch"]}, v["done"]) for r, v in ranks.items()])
    metric("rank_splits_total", "Splits of the rank's current epoch.", "gauge",
           [({"rank": r, "epoch": v["epoch"]}, v["splits"]) for r, v in ranks.items()])
    metric("errors_total", "Failed or skipped splits and files.", "counter", [({}, len(status.get("errors", [])))])
    return "\n".join(lines) + "\n"


class MetricsServer:
    """``GET /metrics`` on a port, serving the status the master loop last published."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self._status: dict = {}
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                with outer._lock:
                    body = prometheus_text(outer._status).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        self._thread: Optional[threading.Thread] = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def publish(self, status: dict) -> None:
        with self._lock:
            self._status = status

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
