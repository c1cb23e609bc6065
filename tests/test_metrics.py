"""Rates and totals from heartbeat counters, and the Prometheus endpoint (prometheus_client)."""
from __future__ import annotations

import functools
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from remoteloader.master.metrics import MasterMetrics, RateWindow, SlotTable, _Constant, families
from remoteloader.master.service import MasterService
from remoteloader.protocol.wire import MASTER_REQUESTS
from tests.wire_helpers import ask

# Every label a remoteloader metric may carry: none of them takes a random id or an epoch.
STABLE_LABELS = {"slot", "rank", "state", "outcome", "type", "code", "fingerprint", "version", "le", "reason", "job_key"}
SECRET_TABLE = "s3://ads-bucket-7/t?endpoint_override=h:9000&secret_key=NOT-FOR-METRICS"


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


def test_rate_window_totals_never_go_down():
    """Workers come and go, a reporter may restart its count: the group's total only grows."""
    w = RateWindow(window_s=10)
    w.update("w:a", 1.0, {"rows": 100, "cpu": 0.9, "io": {"requests": 4}})
    w.update("w:b", 1.0, {"rows": 50})
    w.update("w:a", 2.0, {"rows": 300, "cpu": 0.1, "io": {"requests": 6}})
    assert w.group_totals()["w"] == {"rows": 350, "io.requests": 6}  # gauges (cpu) are not summed
    w.forget({"w:b"})  # a left: what it produced stays counted
    assert w.group_totals()["w"]["rows"] == 350
    w.update("w:b", 2.0, {"rows": 20})  # b's count restarted (below its last value): all 20 are new
    assert w.group_totals()["w"]["rows"] == 370
    w.forget(set())
    assert w.group_totals()["w"] == {"rows": 370, "io.requests": 6}


def test_slots_are_stable_and_bounded():
    slots = SlotTable()
    assert slots.assign(["w-a", "w-b", "w-c"]) == {"w-a": 0, "w-b": 1, "w-c": 2}
    assert slots.assign(["w-a", "w-c"]) == {"w-a": 0, "w-c": 2}  # nobody moves when b leaves
    assert slots.assign(["w-a", "w-c", "w-d"])["w-d"] == 1  # the lowest free slot is reused
    for i in range(100):  # churn: ids are new every time, slots are not
        assert set(slots.assign([f"x-{i}", f"y-{i}"]).values()) == {0, 1}


SNAPSHOT = {
    "job": {"fingerprint": "abc123", "table": SECRET_TABLE, "files": 4, "splits": 8, "rows": 5000, "world_size": 2},
    "workers": [(0, {"id": "w-1f3a", "buffered": 3, "capacity": 16, "assigned": 1, "rows_per_s": 1500.0,
                     "cpu": 0.5, "mem": 1e8, "last_seen_s": 0.2, "draining": False, "held_bytes": 3 << 20,
                     "ahead_bytes": 1 << 20, "budget_bytes": 256 << 20, "busy": 0.75}),
                (1, {"id": "w-88c0", "buffered": 0, "capacity": 16, "assigned": 0, "rows_per_s": 0.0,
                     "cpu": 0.0, "mem": 9e7, "last_seen_s": 0.1, "draining": True})],
    "worker_totals": {"rows": 9000, "batches": 40, "busy_s": 3.5, "io.requests": 12, "io.bytes_requested": 4096,
                      "discarded.stale_run": 7},
    "clients": {(0, "abc123"): {"stall": 0.02, "batches_per_s": 20.0, "queued": 2, "last_batch_age_s": 0.4},
                (1, "abc123"): {"stall": 0.0, "batches_per_s": 0.0, "queued": 0, "last_batch_age_s": None}},
    "client_totals": {(0, "abc123"): {"wait_s": 1.5, "starved_s": 0.5, "batches": 120, "rows": 30000, "wait_buckets.0": 100, "wait_buckets.1": 15,
                          "wait_buckets.2": 5}},
    "client_wait_le": {(0, "abc123"): [0.01, 0.1]},
    "ranks": {"0": {"epoch": 3, "splits": 8, "done": 4, "pending": 2, "finished": False}},
    "errors": {"failed": 0, "skipped": 2},
    "age_s": 0.05,
}


def _parse(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _exposition(reading: dict) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Constant(families(reading)))
    return generate_latest(registry).decode()


def _check_conventions(parsed: dict) -> None:
    for name, family in parsed.items():
        for sample in family.samples:
            assert set(sample.labels) <= STABLE_LABELS | {"generation", "implementation", "major", "minor",
                                                          "patchlevel"}, (name, sample.labels)
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created")), sample.name
            else:
                assert not sample.name.endswith("_total"), sample.name
        if name.startswith("remoteloader_"):
            assert "cpu" not in name or name.endswith("_ratio"), name
            assert not any(unit in name for unit in ("_ms", "_milliseconds", "_percent", "_kb", "_mb")), name


def test_families_follow_the_naming_conventions():
    text = _exposition(SNAPSHOT)
    parsed = _parse(text)
    _check_conventions(parsed)
    expected = {  # name (as the parser reports it, counters without _total) -> type, label names
        "remoteloader_job_info": ("gauge", {"fingerprint"}),  # the text format has no info type
        "remoteloader_job_rows": ("gauge", set()),
        "remoteloader_workers": ("gauge", {"state"}),
        "remoteloader_worker_buffered_batches": ("gauge", {"slot"}),
        "remoteloader_worker_rows_per_second": ("gauge", {"slot"}),
        "remoteloader_worker_cpu_ratio": ("gauge", {"slot"}),
        "remoteloader_worker_resident_memory_bytes": ("gauge", {"slot"}),
        "remoteloader_worker_held_bytes": ("gauge", {"slot"}),
        "remoteloader_worker_ahead_bytes": ("gauge", {"slot"}),
        "remoteloader_worker_budget_bytes": ("gauge", {"slot"}),
        "remoteloader_worker_busy_ratio": ("gauge", {"slot"}),
        "remoteloader_worker_rows": ("counter", set()),
        "remoteloader_worker_busy_seconds": ("counter", set()),
        "remoteloader_worker_read_bytes": ("counter", set()),
        "remoteloader_worker_pieces_discarded": ("counter", {"reason"}),
        "remoteloader_client_stall_ratio": ("gauge", {"rank", "job_key"}),
        "remoteloader_client_last_batch_age_seconds": ("gauge", {"rank", "job_key"}),
        "remoteloader_client_wait_seconds": ("counter", {"rank", "job_key"}),
        "remoteloader_client_starved_seconds": ("counter", {"rank", "job_key"}),
        "remoteloader_client_batches": ("counter", {"rank", "job_key"}),
        "remoteloader_client_batch_wait_seconds": ("histogram", {"rank", "job_key"}),
        "remoteloader_rank_epoch": ("gauge", {"rank"}),
        "remoteloader_rank_splits": ("gauge", {"rank", "state"}),
        "remoteloader_errors": ("counter", {"outcome"}),
    }
    for name, (kind, labels) in expected.items():
        family = parsed[name]
        assert family.type == kind, (name, family.type)
        got = {label for s in family.samples for label in s.labels if label != "le"}
        assert got == labels, (name, got)
    assert "remoteloader_rank_splits_total" not in text  # the old gauge named like a counter
    assert "epoch=" not in text and "w-1f3a" not in text  # no epoch label, no random worker ids

    def value(name: str, **labels) -> float:
        return next(s.value for f in parsed.values() for s in f.samples
                    if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("remoteloader_worker_rows_total") == 9000
    assert value("remoteloader_client_wait_seconds_total", rank="0") == 1.5
    assert value("remoteloader_client_starved_seconds_total", rank="0") == 0.5
    assert value("remoteloader_worker_cpu_ratio", slot="0") == 0.5
    assert value("remoteloader_worker_held_bytes", slot="0") == 3 << 20
    assert value("remoteloader_worker_ahead_bytes", slot="0") == 1 << 20
    assert value("remoteloader_worker_budget_bytes", slot="0") == 256 << 20
    assert value("remoteloader_worker_busy_ratio", slot="0") == 0.75
    assert [s.labels["slot"] for s in parsed["remoteloader_worker_held_bytes"].samples] == ["0"]  # 1 reports none
    assert value("remoteloader_workers", state="draining") == 1
    assert value("remoteloader_rank_epoch", rank="0") == 3
    assert [value("remoteloader_rank_splits", rank="0", state=s) for s in ("pending", "in_progress", "done")] \
        == [2, 2, 4]
    assert value("remoteloader_errors_total", outcome="skipped") == 2
    assert value("remoteloader_worker_pieces_discarded_total", reason="stale_run") == 7
    assert value("remoteloader_worker_pieces_discarded_total", reason="yielded") == 0
    assert [s.labels["rank"] for s in parsed["remoteloader_client_last_batch_age_seconds"].samples] == ["0"]
    assert [value("remoteloader_client_batch_wait_seconds_bucket", rank="0", le=le)
            for le in ("0.01", "0.1", "+Inf")] == [100, 115, 120]
    assert value("remoteloader_client_batch_wait_seconds_count", rank="0", job_key="abc123") == 120


def test_the_metrics_name_no_table():
    """The endpoint is unauthenticated and a table URI may hold a credential (red team finding 2)."""
    text = _exposition(SNAPSHOT)
    assert "ads-bucket-7" not in text and "NOT-FOR-METRICS" not in text
    (sample,) = _parse(text)["remoteloader_job_info"].samples
    assert sample.labels == {"fingerprint": "abc123"}


def _report(service: MasterService) -> list[str]:
    """Two workers and a client report through the service, as over the socket."""
    now, spec = service.now, service.spec
    call = functools.partial(ask, service)
    ids = [call({"t": "register", "addr": f"tcp://127.0.0.1:{7000 + i}", "pid": 10 + i,
                 "fingerprint": spec.fingerprint()})[1]["worker_id"] for i in range(2)]
    for step in range(1, 4):
        now[0] += 1
        for wid in ids:
            call({"t": "heartbeat", "worker_id": wid, "token": service.keys.worker_token(wid), "buffered": step,
                  "stats": {"rows": 100 * step, "batches": step, "busy_s": 0.5 * step, "cpu": 0.25,
                            "capacity": 16, "io": {"requests": step, "bytes_requested": 1000 * step},
                            "held_bytes": 5000 * step, "ahead_bytes": 1000, "budget_bytes": 1 << 20}})
    t, reply = call({"t": "hello", "rank": 0, "world_size": 1, "spec": spec.to_dict(),
                     "fingerprint": spec.fingerprint()})
    assert t == "welcome"
    service.session = reply["session"]  # the client's, for tests that report as it
    call({"t": "start_epoch", "session": service.session, "epoch": 0})
    for step in range(1, 4):
        now[0] += 1
        call({"t": "client_heartbeat", "session": service.session, "seq": 0, "acks": [],
              "stats": {"wait_s": 0.5 * step, "starved_s": step / 6, "batches": 10 * step, "rows": 1000 * step, "queued": 1}})
    call({"t": "get_split", "worker_id": "w-nobody", "token": ""})  # answered with an error (unknown_worker)
    return ids


def _leave(service: MasterService, worker_id: str) -> None:
    ask(service, {"t": "bye", "worker_id": worker_id, "token": service.keys.worker_token(worker_id)})
    service.tick()  # forgets the worker that left


def _drive(service: MasterService) -> None:
    _leave(service, _report(service)[0])


def test_master_metrics_read_the_service(service):
    metrics = MasterMetrics(service)
    ids = _report(service)
    generate_latest(metrics.registry)  # a scrape while both workers live: slots 0 and 1
    _leave(service, ids[0])
    parsed = _parse(generate_latest(metrics.registry).decode())
    _check_conventions(parsed)

    def value(name: str, **labels) -> float:
        return next(s.value for f in parsed.values() for s in f.samples
                    if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("remoteloader_workers", state="active") == 1
    assert value("remoteloader_worker_rows_total") == 600  # the worker that left still counts
    assert value("remoteloader_worker_read_bytes_total") == 6000
    assert value("remoteloader_worker_busy_seconds_total") == 3.0
    assert value("remoteloader_worker_cpu_ratio", slot="1") == 0.25  # the remaining worker keeps its slot
    assert value("remoteloader_worker_held_bytes", slot="1") == 15000  # its last report
    assert value("remoteloader_worker_ahead_bytes", slot="1") == 1000
    assert value("remoteloader_worker_budget_bytes", slot="1") == 1 << 20
    assert value("remoteloader_worker_busy_ratio", slot="1") == 0.5  # 0.5 s busy a second
    assert value("remoteloader_client_wait_seconds_total", rank="0") == 1.5
    assert value("remoteloader_client_starved_seconds_total", rank="0") == 0.5
    assert value("remoteloader_client_batches_total", rank="0") == 30
    assert value("remoteloader_rank_epoch", rank="0") == 0
    assert value("remoteloader_job_rows") == service.state.job.total_rows
    assert value("remoteloader_master_request_seconds_count", type="heartbeat") == 6
    assert value("remoteloader_master_request_seconds_count", type="hello") == 1
    assert value("remoteloader_master_request_errors_total", type="get_split", code="unknown_worker") == 1
    assert value("remoteloader_build_info") == 1
    assert {s.labels["type"] for s in parsed["remoteloader_master_request_seconds"].samples} == set(MASTER_REQUESTS)
    assert "process_cpu_seconds" in parsed and "python_info" in parsed  # process metrics, this registry only


class FakeLoop:
    """The master's loop: runs its periodic duties every 50 ms on its own thread."""

    def __init__(self) -> None:
        self.periodic: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            for duty in self.periodic:
                duty()


def test_endpoint_serves_a_reading_taken_on_the_loop(service):
    _drive(service)
    metrics = MasterMetrics(service, max_wait_s=2.0)
    loop = FakeLoop()
    metrics.attach(loop)
    loop.thread.start()
    port = metrics.serve(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            body = response.read().decode()
    finally:
        metrics.close()
        loop.stop.set()
    parsed = _parse(body)
    _check_conventions(parsed)
    assert next(s.value for s in parsed["remoteloader_worker_rows"].samples) == 600
    assert next(s.value for s in parsed["remoteloader_metrics_reading_age_seconds"].samples) < 2.0


def test_a_busy_loop_does_not_hang_the_scrape(service):
    metrics = MasterMetrics(service, max_wait_s=0.2)
    metrics.attach(FakeLoop())  # never runs: the master is stuck in a long request
    parsed = _parse(generate_latest(metrics.registry).decode())
    assert "remoteloader_build_info" in parsed and "remoteloader_workers" not in parsed


def test_endpoint_answers_only_metrics_and_names_no_table(service):
    """Red team finding 7: the unauthenticated endpoint answered any path."""
    metrics = MasterMetrics(service, process_metrics=False)  # not attached: the scrape reads the state itself
    port = metrics.serve(0, "127.0.0.1")
    try:
        for path in ("/", "/favicon.ico", "/metrics/", "/debug/vars"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
            assert refused.value.code == 404, path
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            body = response.read().decode()
    finally:
        metrics.close()
    assert "remoteloader_job_info{" in body and service.spec.table.path not in body


def test_client_wait_histogram_from_what_the_loader_reports(service):
    from remoteloader.client.stats import WAIT_BUCKETS_S, ClientStats
    from remoteloader.protocol import wire
    from remoteloader.protocol.messages import ClientHeartbeat

    metrics = MasterMetrics(service)
    _report(service)
    stats = ClientStats(wait_s=0.2, batches=7, rows=700)
    stats.wait_buckets[0], stats.wait_buckets[4] = 5, 2                # 5 waits <= 1 ms, 2 <= 100 ms
    for _ in range(2):
        service.now[0] += 1
        request, _ = wire.decode(wire.encode(ClientHeartbeat(session=service.session, seq=0, acks=[],
                                                             stats=stats.to_wire(0))))   # what goes over the socket
        service.handle(request)
    parsed = _parse(generate_latest(metrics.registry).decode())
    samples = {(s.name, s.labels.get("le")): s.value for s in parsed["remoteloader_client_batch_wait_seconds"].samples}
    assert samples[("remoteloader_client_batch_wait_seconds_count", None)] == 7
    assert samples[("remoteloader_client_batch_wait_seconds_bucket", str(WAIT_BUCKETS_S[0]))] == 5
    assert samples[("remoteloader_client_batch_wait_seconds_bucket", "+Inf")] == 7


def test_worker_rates_drop_with_the_job_run_when_the_last_client_leaves(service):
    """Issue 38, finding 2: after the trainer left, per-worker ``rows_per_second`` (and the
    busy share) went on showing the run's rate. When the last client session ends, each
    worker's rate window starts afresh: 0 at once, then only what the worker did since."""
    metrics = MasterMetrics(service, process_metrics=False)
    ids = _report(service)

    def gauges() -> dict[tuple[str, str], float]:
        parsed = _parse(generate_latest(metrics.registry).decode())
        return {(name, s.labels["slot"]): s.value for name in ("remoteloader_worker_rows_per_second",
                                                               "remoteloader_worker_busy_ratio")
                for s in parsed[name].samples}

    during = gauges()
    assert during[("remoteloader_worker_rows_per_second", "0")] == 100.0 and during[
        ("remoteloader_worker_busy_ratio", "1")] == 0.5
    ask(service, {"t": "goodbye", "session": service.session})
    service.tick()                       # the master's periodic duties: the run has ended
    assert set(gauges().values()) == {0.0}, "no trainer, no rate: not the run's last value"
    # A worker finishing the piece it was cutting: what it does from now on counts, as a rate.
    service.now[0] += 2
    for wid, rows, busy in ((ids[0], 400, 2.0), (ids[1], 300, 1.5)):
        ask(service, {"t": "heartbeat", "worker_id": wid, "token": service.keys.worker_token(wid), "buffered": 0,
                      "stats": {"rows": rows, "batches": 3, "busy_s": busy, "cpu": 0.25, "capacity": 16}})
    after = gauges()   # from its last report of the run (3 s before the client's last, 5 s ago)
    assert after[("remoteloader_worker_rows_per_second", "0")] == 20.0      # 100 rows in 5 s
    assert after[("remoteloader_worker_busy_ratio", "0")] == 0.1            # 0.5 s busy in 5 s
    assert after[("remoteloader_worker_rows_per_second", "1")] == 0.0
    assert service.rates.group_totals()["w"]["rows"] == 700, "totals keep counting through the restart"
