"""Rates and totals from heartbeats, and the master's Prometheus metrics.

Workers and clients report cumulative counters (rows produced, seconds spent waiting);
``RateWindow`` turns them into rates over a sliding window, which is what the status
page, the metrics endpoint and the autoscaler read, and into totals that only grow,
through worker and client restarts, which is what Prometheus counters need. This is
measurement, not job state: it lives beside ``JobState`` and starts from zero when the
master restarts (a counter reset, which Prometheus' ``rate()`` handles).

``MasterMetrics`` exposes them with ``prometheus_client``: one registry per master
(never the global default one), a collector that reads the master's state at scrape time
on the master's own loop (the state has no locks, so the scrape thread asks the loop
for a reading), a histogram of request handling time per message type, and the
process collectors. docs/operations.md lists every metric. The endpoint is plain HTTP
that anyone who reaches it may read, so it answers ``/metrics`` only and carries no table
path (a table URI may hold a credential); the master binds it to loopback unless told
``--insecure``.
"""
from __future__ import annotations

import socket
import threading
import time
from collections import deque
from socketserver import ThreadingMixIn
from typing import Callable, Iterable, Optional, Union
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from ..protocol.messages import (
    DISCARD_REASONS,
    MASTER_REQUESTS,
    CacheStats,
    Error,
    MasterReply,
    Message,
    SharedBlockStats,
    tag,
)

# Cumulative counters in worker and client heartbeat stats (nested dicts are flattened
# with dots: ``io.requests``). ``wait_buckets.N``: per-bucket counts of per-batch waits,
# if a client reports them (with the bucket bounds in ``wait_le``).
CUMULATIVE = frozenset({"rows", "batches", "splits", "busy_s", "wait_s", "starved_s", "epoch_start_s",
                        "io.requests", "io.bytes_requested", "io.bytes_needed", "io.splits",
                        *(f"cache.{name}" for name in CacheStats.__struct_fields__),
                        *(f"shared.{name}" for name in SharedBlockStats.__struct_fields__ if name != "held_bytes")})
# ``discarded.<reason>``: pieces a worker threw away, by reason (the wire admits only
# ``DISCARD_REASONS``), exported at zero from the start so that ``rate()`` sees the first one.
_DISCARDED = frozenset(f"discarded.{reason}" for reason in DISCARD_REASONS)
# Counters whose last change time is kept (``unchanged_for``): only what a metric reads, as
# this runs for every heartbeat.
_TRACK_CHANGE = frozenset({"batches"})
REQUEST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0)


def _is_cumulative(name: str) -> bool:
    return name in CUMULATIVE or name in _DISCARDED or (name.startswith("wait_buckets.") and name[13:].isdigit())


def _flatten(stats: dict, prefix: str = "") -> Iterable[tuple[str, float]]:
    for k, v in stats.items():
        name = prefix + str(k)
        if isinstance(v, dict):
            yield from _flatten(v, name + ".")
        elif isinstance(v, list):
            yield from ((f"{name}.{i}", x) for i, x in enumerate(v)
                        if isinstance(x, (int, float)) and not isinstance(x, bool))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield name, v


def _kind(key: str) -> str:
    return key.partition(":")[0]


class RateWindow:
    """Per reporter (``key``, e.g. ``w:<worker id>``, ``c:<client id>``): rates over a
    window, and monotonic totals summed per group (``group_of(key)``, by default the
    key's kind; the metrics use the client's rank). A reporter's totals outlive it: when
    it is forgotten they stay in its group, so a group's totals never go down.

    A worker's rates are those of the job's run: when the last client goes (``forget``
    sees no client key live any more), every worker's window starts afresh, so its
    ``rows_per_s`` and busy share read 0 at once instead of the run's last rate, and then
    only what it did since (a split it was cutting). Totals are not touched."""

    def __init__(self, window_s: float = 10.0, group_of: Optional[Callable[[str], str]] = None) -> None:
        self.window_s = window_s
        self.group_of: Callable[[str], str] = group_of or _kind
        self._samples: dict[str, deque] = {}
        self._last: dict[str, dict[str, float]] = {}  # key -> last cumulative values reported
        self._totals: dict[str, dict[str, float]] = {}  # key -> increase since first seen
        self._group: dict[str, str] = {}  # key -> its group, fixed at its first report
        self._retired: dict[str, dict[str, float]] = {}  # group -> totals of forgotten keys
        self._changed: dict[str, dict[str, float]] = {}  # key -> counter -> time it last changed (or first came)
        self._clients_live = False  # a client has reported since the last ``forget`` that saw none

    def update(self, key: str, time: float, counters: dict) -> None:
        samples = self._samples.setdefault(key, deque())
        if samples and time <= samples[-1][0]:
            return  # a repeated or reordered report carries nothing new
        samples.append((time, counters))
        while len(samples) > 2 and time - samples[1][0] >= self.window_s:
            samples.popleft()
        if key not in self._group:
            self._group[key] = self.group_of(key)
            self._clients_live = self._clients_live or _kind(key) == "c"
        last, totals = self._last.setdefault(key, {}), self._totals.setdefault(key, {})
        for name, value in _flatten(counters):
            if not _is_cumulative(name):
                continue
            if name in _TRACK_CHANGE and (name not in last or value != last[name]):
                self._changed.setdefault(key, {})[name] = time
            before = last.get(name, 0.0)
            # Below the last value: the reporter restarted its count (a reset), so all of it is new.
            totals[name] = totals.get(name, 0.0) + (value - before if value >= before else value)
            last[name] = value

    def rate(self, key: str, counter: str) -> float:
        """Increase of ``counter`` per second over the window (0 until two samples exist)."""
        samples = self._samples.get(key)
        if not samples or len(samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = samples[0], samples[-1]
        return max(0.0, (c1.get(counter, 0) - c0.get(counter, 0)) / (t1 - t0))

    def last_report(self, key: str) -> Optional[tuple[float, dict]]:
        """The reporter's latest (time, report), or None if it never reported (or was forgotten)."""
        samples = self._samples.get(key)
        return samples[-1] if samples else None

    def unchanged_for(self, key: str, counter: str, now: float) -> Optional[float]:
        """Seconds since ``counter`` last changed (or was first reported); None if never reported."""
        since = self._changed.get(key, {}).get(counter)
        return None if since is None else max(0.0, now - since)

    def forget(self, live: set) -> None:
        """Drop the reporters not in ``live`` (their totals stay in their group). When no
        client is live any more where one was, the job's run has ended: the workers'
        windows restart (``restart("w")``)."""
        clients = any(_kind(k) == "c" for k in live)
        if self._clients_live and not clients:
            self.restart("w")
        self._clients_live = clients
        for key in [k for k in self._samples if k not in live]:
            del self._samples[key]
            self._last.pop(key, None)
            self._changed.pop(key, None)
            group = self._group.pop(key, None)
            totals = self._totals.pop(key, {})
            if group is not None:
                retired = self._retired.setdefault(group, {})
                for name, value in totals.items():
                    retired[name] = retired.get(name, 0.0) + value

    def restart(self, kind: str) -> None:
        """Start the window of every reporter of ``kind`` afresh from its latest report: its
        rates read 0 until it reports again, then cover only what it did since."""
        for key, samples in self._samples.items():
            if _kind(key) == kind and len(samples) > 1:
                latest = samples[-1]
                samples.clear()
                samples.append(latest)

    def drop_groups(self, ended: Callable[[str], bool]) -> None:
        """Forget the totals of the groups ``ended`` says are gone (a job's ranks, when it ends),
        so that the groups, and the series they make, stay bounded by what is held."""
        for group in [g for g in self._retired if ended(g)]:
            del self._retired[group]
        for key in [k for k, g in self._group.items() if ended(g)]:
            self._totals[key] = {}

    def group_totals(self) -> dict[str, dict[str, float]]:
        """Group -> counter -> total increase, over live and forgotten reporters."""
        out = {group: dict(totals) for group, totals in self._retired.items()}
        for key, totals in self._totals.items():
            group = out.setdefault(self._group[key], {})
            for name, value in totals.items():
                group[name] = group.get(name, 0.0) + value
        return out


class SlotTable:
    """Small stable numbers for workers: a worker keeps its slot while it lives, a new
    one takes the lowest free slot. The label's values are bounded by the largest worker
    count, unlike worker ids, which are new at every registration."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}

    def assign(self, ids: Iterable[str]) -> dict[str, int]:
        ids = list(ids)
        live = set(ids)
        self._slots = {i: s for i, s in self._slots.items() if i in live}
        used = set(self._slots.values())
        free = (s for s in range(len(ids) + 1) if s not in used)
        for i in ids:
            if i not in self._slots:
                self._slots[i] = next(free)
        return dict(self._slots)


# -- the metric families, from a reading of the state (a pure function: tests feed it directly) ---------
def families(reading: dict) -> list[Metric]:
    """The master's metrics from a reading of its state (see ``MasterMetrics.read_state`` for its keys)."""
    out: list[Metric] = []

    def gauge(name: str, doc: str, labels: Iterable[str] = (), samples: Iterable[tuple] = ()) -> None:
        g = GaugeMetricFamily(name, doc, labels=list(labels))
        for *values, v in samples:
            g.add_metric([str(x) for x in values], float(v))
        out.append(g)

    def counter(name: str, doc: str, labels: Iterable[str] = (), samples: Iterable[tuple] = ()) -> None:
        c = CounterMetricFamily(name, doc, labels=list(labels))
        for *values, v in samples:
            c.add_metric([str(x) for x in values], float(v))
        out.append(c)

    job = reading.get("job")
    if job:
        # No table label: the endpoint is unauthenticated, and `remoteloader status` names the table.
        info = InfoMetricFamily("remoteloader_job", "The job this master serves (value 1).",
                                labels=["fingerprint"])
        info.add_metric([str(job["fingerprint"])], {})
        out.append(info)
        gauge("remoteloader_job_rows", "Rows selected by the job's spec.", samples=[(job["rows"],)])
        gauge("remoteloader_job_splits", "Base splits of the job.", samples=[(job["splits"],)])
        gauge("remoteloader_job_files", "Files the job reads.", samples=[(job["files"],)])
        if job.get("world_size") is not None:
            gauge("remoteloader_job_world_size", "Trainer ranks of the job.", samples=[(job["world_size"],)])

    # A shared fleet's jobs, one series each: the `job_key` label (not `job`: Prometheus sets its own `job` on every scraped series) is the job's key, bounded
    # by the master's --max-jobs (a job that ends leaves the next scrape).
    jobs = reading.get("jobs", [])
    per_job = [
        ("remoteloader_fleet_job_clients", "Live client sessions of the job.", "clients"),
        ("remoteloader_fleet_job_progress_ratio", "Share of the splits of the job's current epoch runs done.",
         "progress"),
        ("remoteloader_fleet_job_rows_per_second", "Rows the job's trainers took per second over the rate window.",
         "rows_per_s"),
        ("remoteloader_fleet_job_share_ratio", "The job's share of the rows all jobs' trainers took.", "share"),
        ("remoteloader_fleet_job_stall_ratio", "Share of the rate window the job's most stalled rank waited.",
         "stall"),
        ("remoteloader_fleet_job_weight", "The job's fair-share weight (its spec's share.weight).", "weight"),
    ]
    for name, doc, field in per_job:
        gauge(name, doc, ["job_key"], [(j["job"], j[field]) for j in jobs
                                       if isinstance(j.get(field), (int, float))])

    # Workers: current values per slot, cumulative counts summed over every worker that reported.
    workers = reading.get("workers", [])
    draining = sum(1 for _, w in workers if w.get("draining"))
    gauge("remoteloader_workers", "Registered workers, by state.", ["state"],
          [("active", len(workers) - draining), ("draining", draining)])
    per_slot = [
        ("remoteloader_worker_buffered_batches", "Batches in the worker's buffer.", "buffered"),
        ("remoteloader_worker_buffer_capacity_batches", "Capacity of the worker's buffer.", "capacity"),
        ("remoteloader_worker_assigned_splits", "Splits the worker holds.", "assigned"),
        ("remoteloader_worker_rows_per_second", "Rows the worker produced per second over the rate window.",
         "rows_per_s"),
        ("remoteloader_worker_cpu_ratio", "CPU time of the worker process per second (1 = one core busy).", "cpu"),
        ("remoteloader_worker_resident_memory_bytes", "Resident memory of the worker process.", "mem"),
        ("remoteloader_worker_held_bytes", "Bytes of the transformed splits the worker holds.", "held_bytes"),
        ("remoteloader_worker_ahead_bytes", "Of the bytes the worker holds, those of splits of a next epoch read "
         "ahead.", "ahead_bytes"),
        ("remoteloader_worker_budget_bytes", "What the worker may hold of transformed splits (its --buffer-bytes).",
         "budget_bytes"),
        ("remoteloader_worker_busy_ratio", "Share of the rate window the worker spent producing (reading, "
         "transforming, cutting), not waiting for room or work.", "busy"),
        ("remoteloader_worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat.", "last_seen_s"),
        ("remoteloader_worker_draining", "1 while the worker drains before it exits.", "draining"),
    ]
    for name, doc, field in per_slot:
        gauge(name, doc, ["slot"], [(slot, float(w[field])) for slot, w in workers
                                    if isinstance(w.get(field), (int, float))])
    wt = reading.get("worker_totals", {})
    for name, doc, field in [
        ("remoteloader_worker_rows", "Rows produced by all workers.", "rows"),
        ("remoteloader_worker_batches", "Batch pieces produced by all workers.", "batches"),
        ("remoteloader_worker_splits", "Splits produced by all workers.", "splits"),
        ("remoteloader_worker_busy_seconds", "Seconds workers spent producing splits.", "busy_s"),
        ("remoteloader_worker_read_requests", "Storage read requests issued by workers.", "io.requests"),
        ("remoteloader_worker_read_bytes", "Bytes workers requested from storage.", "io.bytes_requested"),
        ("remoteloader_worker_needed_bytes", "Bytes the decoders needed of what was read "
         "(read_bytes / needed_bytes is the over-read).", "io.bytes_needed"),
    ]:
        counter(name, doc, samples=[(wt.get(field, 0.0),)])
    for name, doc, field in [
        ("remoteloader_cache_hits", "Cache blocks workers found (verified).", "hits"),
        ("remoteloader_cache_misses", "Cache blocks workers looked up and did not find (computed instead).", "misses"),
        ("remoteloader_cache_puts", "Cache segments workers wrote.", "puts"),
        ("remoteloader_cache_put_bytes", "Bytes of the cache segments workers wrote.", "put_bytes"),
        ("remoteloader_cache_corrupt_blocks", "Cache blocks refused for a bad checksum or MAC (also blocks "
         "written without the cluster key), computed instead.", "corrupt"),
        ("remoteloader_cache_unverifiable_blocks", "Keyed cache blocks a worker without the key could not check.",
         "unverifiable"),
        ("remoteloader_cache_faults", "Cache listings, reads or writes that failed or timed out.", "faults"),
        ("remoteloader_cache_dropped_puts", "Cache writes dropped because the background writer was full.",
         "dropped"),
        ("remoteloader_cache_read_bytes", "Bytes workers read from the cache.", "bytes_read"),
        ("remoteloader_cache_read_seconds", "Seconds workers spent reading the cache.", "read_seconds"),
        ("remoteloader_cache_write_seconds", "Seconds workers' background writers spent writing the cache.",
         "write_seconds"),
    ]:
        counter(name, doc, samples=[(wt.get("cache." + field, 0.0),)])
    for name, doc, field in [
        ("remoteloader_shared_blocks", "Blocks a job took from a worker's memo that another job computed "
         "(shared work of a shared fleet).", "hits"),
        ("remoteloader_shared_bytes", "Bytes of those blocks.", "hit_bytes"),
        ("remoteloader_shared_blocks_kept", "Blocks workers kept in their memo for another job.", "puts"),
        ("remoteloader_shared_blocks_expired", "Blocks workers kept for another job and dropped unread.",
         "expired"),
    ]:
        counter(name, doc, samples=[(wt.get("shared." + field, 0.0),)])
    counter("remoteloader_worker_pieces_discarded", "Batch pieces workers threw away instead of delivering "
            "(their splits are handed back and produced again if still needed), by reason.", ["reason"],
            [(reason, wt.get(f"discarded.{reason}", 0.0)) for reason in DISCARD_REASONS])

    # Clients, by rank and job, (rank, job key) (a rank's client is replaced when the rank restarts;
    # the rank stays): the `job_key` label is the job's key, bounded by the master's --max-jobs
    # (not `job`: Prometheus gives every series it scrapes a `job` of its own).
    clients = reading.get("clients", {})
    rank_job = ["rank", "job_key"]
    gauge("remoteloader_clients", "Connected trainer clients.", samples=[(len(clients),)])
    gauge("remoteloader_client_stall_ratio", "Share of time the rank's training loop waited for batches "
          "over the rate window.", rank_job, [(r, j, c["stall"]) for (r, j), c in sorted(clients.items())])
    gauge("remoteloader_client_batches_per_second", "Batches the rank consumed per second over the rate window.",
          rank_job, [(r, j, c["batches_per_s"]) for (r, j), c in sorted(clients.items())])
    gauge("remoteloader_client_queued_batches", "Assembled batches waiting in the rank's client.",
          rank_job, [(r, j, c["queued"]) for (r, j), c in sorted(clients.items())])
    gauge("remoteloader_client_last_batch_age_seconds", "Seconds since the rank's training loop last got a "
          "batch (it grows while the rank waits, at an epoch's start too).", rank_job,
          [(r, j, c["last_batch_age_s"]) for (r, j), c in sorted(clients.items())
           if c.get("last_batch_age_s") is not None])
    ct = reading.get("client_totals", {})
    for name, doc, field in [
        ("remoteloader_client_wait_seconds", "Seconds the rank's training loop waited for a batch "
         "mid-epoch.", "wait_s"),
        ("remoteloader_client_starved_seconds", "Of that wait, seconds while no worker of the rank's "
         "partition held a batch for it (more workers would shorten these).", "starved_s"),
        ("remoteloader_client_epoch_start_wait_seconds", "Seconds the rank waited for the first batch "
         "of an epoch.", "epoch_start_s"),
        ("remoteloader_client_batches", "Batches the rank consumed.", "batches"),
        ("remoteloader_client_rows", "Rows the rank consumed.", "rows"),
    ]:
        counter(name, doc, rank_job, [(r, j, t.get(field, 0.0)) for (r, j), t in sorted(ct.items())])
    hist = HistogramMetricFamily("remoteloader_client_batch_wait_seconds",
                                 "Per-batch wait of the rank's training loop (from clients that report buckets).",
                                 labels=rank_job)
    for (rank, job), bounds in sorted(reading.get("client_wait_le", {}).items()):
        if (rank, job) not in ct:
            continue  # a job that ended: its series went
        totals = ct[(rank, job)]
        counts = [totals.get(f"wait_buckets.{i}", 0.0) for i in range(len(bounds) + 1)]
        cumulative, running = [], 0.0
        for le, n in zip([*(repr(float(b)) for b in bounds), "+Inf"], counts):
            running += n
            cumulative.append((le, running))
        hist.add_metric([str(rank), job], cumulative, sum_value=totals.get("wait_s", 0.0))
    out.append(hist)

    # Ranks' progress through their current epoch.
    ranks = reading.get("ranks", {})
    gauge("remoteloader_rank_epoch", "The rank's current epoch.", ["rank"],
          [(r, v["epoch"]) for r, v in ranks.items()])
    gauge("remoteloader_rank_splits", "Splits of the rank's current epoch, by state (pending: no worker yet; "
          "in_progress: assigned or produced, not yet consumed; done: consumed).", ["rank", "state"],
          [s for r, v in ranks.items() for s in (
              (r, "pending", v["pending"]), (r, "in_progress", max(0, v["splits"] - v["done"] - v["pending"])),
              (r, "done", v["done"]))])
    gauge("remoteloader_rank_epoch_finished", "1 once the rank finished its current epoch.", ["rank"],
          [(r, 1 if v.get("finished") else 0) for r, v in ranks.items()])

    errors = reading.get("errors", {})
    counter("remoteloader_errors", "Failed splits and files, by outcome (skipped under on_error: skip).",
            ["outcome"], [("failed", errors.get("failed", 0)), ("skipped", errors.get("skipped", 0))])
    if "age_s" in reading:
        gauge("remoteloader_metrics_reading_age_seconds", "Age of the state these values were read from "
              "(above 1 s: the master's loop was busy at scrape time).", samples=[(reading["age_s"],)])
    return out


class _StatusCollector(Collector):
    def __init__(self, owner: "MasterMetrics") -> None:
        self.owner = owner

    def collect(self) -> Iterable[Metric]:
        reading = self.owner.current()
        return families(reading) if reading else []  # nothing read yet: nothing rather than zeros


class MasterMetrics:
    """The master's metrics on their own registry.

    ``refresh`` must run on the master's loop (``attach`` adds it to the server's periodic
    duties): a scrape asks for a reading and waits up to ``max_wait_s`` for the loop to
    take it, then uses the previous one. Without a loop attached, the scrape reads the
    state itself (tests, or a caller that owns the only thread).
    """

    def __init__(self, service, process_metrics: bool = True, max_wait_s: float = 1.0) -> None:
        from .. import __version__

        self.service = service
        self.max_wait_s = max_wait_s
        self.registry = CollectorRegistry(auto_describe=False)  # no collect() at registration
        self.request_seconds = Histogram("remoteloader_master_request_seconds",
                                         "Time the master took to handle a request, by message type.",
                                         ["type"], registry=self.registry, buckets=REQUEST_BUCKETS)
        self.request_errors = Counter("remoteloader_master_request_errors",
                                      "Requests answered with an error, by message type and error code.",
                                      ["type", "code"], registry=self.registry)
        for t in sorted(MASTER_REQUESTS):
            self.request_seconds.labels(t)
        build = InfoMetricFamily("remoteloader_build", "remoteloader's version (value 1).")
        build.add_metric([], {"version": __version__})
        self.registry.register(_Constant([build]))
        if process_metrics:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        self._slots = SlotTable()
        self._wait_le: dict[tuple[int, str], list[float]] = {}  # (rank, job key) -> its wait buckets' bounds
        self._reading: Optional[dict] = None
        self._scrape_lock = threading.Lock()
        self._wanted, self._fresh = threading.Event(), threading.Event()
        self._attached = False
        self._http = None
        self.port: Optional[int] = None
        service.rates.group_of = self._group_of
        self._instrument()
        self.registry.register(_StatusCollector(self))

    # -- on the master's loop --------------------------------------------------------------
    # What is read of the client sessions, in one place: the service keys a client's reports
    # ``c:<session>`` and its state maps each live session to its rank.
    def _group_of(self, key: str) -> str:
        """A client's group is its rank in its job, ``c:<rank>:<job key>`` (the series of the
        rank's restarted processes continue each other; ranks of two jobs are two series)."""
        kind, _, session = key.partition(":")
        if kind == "c":
            st = self.service.fleet.job_of(session)
            rank = None if st is None else st.clients.get(session)
            return f"c:{rank}:{st.job.key}" if rank is not None else "c:?"
        return kind

    def _last_batch_age(self, session: str, now: float) -> Optional[float]:
        """Seconds since the session's training loop last got a batch: what the client last
        reported (``since_batch_s``) plus that report's age; for a client that does not
        report it, since its ``batches`` count last grew. None before its first report."""
        rates, key = self.service.rates, "c:" + session
        report = rates.last_report(key)
        if report is None:
            return None
        at, stats = report
        reported = stats.get("since_batch_s")  # the wire admits only an amount (a float >= 0)
        if reported is not None:
            return reported + max(0.0, now - at)
        return rates.unchanged_for(key, "batches", now)

    def _instrument(self) -> None:
        """Time ``service.handle``; the server calls it through the service instance."""
        handle = self.service.handle

        def timed(request: Union[Message, dict]) -> MasterReply:
            t = request.get("t") if isinstance(request, dict) else tag(request)
            label = t if t in MASTER_REQUESTS else "other"
            start = time.perf_counter()
            try:
                reply = handle(request)
            except Exception:
                self.request_errors.labels(label, "exception").inc()
                raise
            finally:
                self.request_seconds.labels(label).observe(time.perf_counter() - start)
            if isinstance(reply, Error):
                self.request_errors.labels(label, reply.code.value if reply.code else "none").inc()
            return reply

        self.service.handle = timed

    def attach(self, server) -> None:
        """Read the state on ``server``'s loop (call before ``serve_forever``)."""
        self._attached = True
        server.periodic.append(self.refresh)

    def refresh(self) -> None:
        if self._wanted.is_set():
            self._wanted.clear()
            self._reading = self.read_state()
            self._fresh.set()

    def read_state(self) -> dict:
        """What ``families`` needs, read from the service; only on the master's loop."""
        service = self.service
        status = service.status()
        slots = self._slots.assign(w["id"] for w in status["workers"])
        clients: dict[tuple[int, str], dict] = {}  # (rank, job key) -> its live sessions' (one, but while replaced)
        now = service.clock()
        for c in status["clients"]:
            st = service.fleet.job_of(c["id"])
            key = (c["rank"], "" if st is None else st.job.key)
            agg = clients.setdefault(key,
                                     {"stall": 0.0, "batches_per_s": 0.0, "queued": 0, "last_batch_age_s": None})
            agg["stall"] = max(agg["stall"], c.get("stall", 0.0))
            age = self._last_batch_age(c["id"], now)
            if age is not None:
                agg["last_batch_age_s"] = max(age, agg["last_batch_age_s"] or 0.0)
            agg["batches_per_s"] += c.get("batches_per_s", 0.0)
            agg["queued"] += c.get("queued", 0) or 0
            bounds = c.get("wait_le")
            if (isinstance(bounds, list) and bounds and all(isinstance(b, (int, float)) for b in bounds)
                    and bounds == sorted(bounds) and len(bounds) <= 64):
                self._wait_le[key] = [float(b) for b in bounds]
        totals = service.rates.group_totals()
        client_totals = {}  # (rank, job key) -> its totals, of the jobs held (an ended job's series go)
        for group, t in totals.items():
            kind, _, rest = group.partition(":")
            rank, _, job = rest.partition(":")
            if kind == "c" and rank.isdigit() and job in service.fleet.jobs:
                client_totals[(int(rank), job)] = t
        self._wait_le = {k: v for k, v in self._wait_le.items() if k[1] in service.fleet.jobs}
        counts = {kind: sum(st.error_counts.get(kind, 0) for st in service.fleet.jobs.values())
                  for kind in ("failed", "skipped")}
        return {
            "time": time.monotonic(),
            "job": status["job"],
            "workers": sorted(((slots[w["id"]], w) for w in status["workers"]), key=lambda sw: sw[0]),
            "worker_totals": totals.get("w", {}),
            "clients": clients,
            "client_totals": client_totals,
            "client_wait_le": dict(self._wait_le),
            "ranks": status["ranks"],
            # A shared fleet's jobs (a master of one job has its remoteloader_job_* series).
            "jobs": status["jobs"] if status["max_jobs"] > 1 else [],
            "errors": dict(counts),
        }

    # -- on the scrape thread ----------------------------------------------------------------
    def current(self) -> dict:
        if not self._attached:
            reading = self.read_state()
        else:
            with self._scrape_lock:
                self._fresh.clear()
                self._wanted.set()
                self._fresh.wait(self.max_wait_s)
                reading = self._reading
            if reading is None:
                return {}
        return dict(reading, age_s=max(0.0, time.monotonic() - reading["time"]))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve the registry over HTTP at ``/metrics`` (other paths: 404) on a thread of
        its own; returns the port bound."""
        self._http = _metrics_server(host, port, make_wsgi_app(self.registry))
        threading.Thread(target=self._http.serve_forever, name="remoteloader-metrics", daemon=True).start()
        self.port = self._http.server_address[1]
        return self.port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _Server(ThreadingMixIn, WSGIServer):
    """A threaded WSGI server on IPv4 or IPv6, as the host is written."""

    daemon_threads = True  # a hung scraper never keeps the master from exiting

    def __init__(self, address: tuple[str, int], handler: type) -> None:
        # Read by the base class when it makes the socket (it defaults to IPv4).
        self.address_family = socket.getaddrinfo(*address, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        super().__init__(address, handler)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:
        """Scrapes are not logged (one line per scrape, every few seconds)."""


def _only_metrics(app: Callable) -> Callable:
    """``app`` at ``/metrics``; 404 elsewhere (an endpoint that answers any path tells a
    scanner it found something, and serves the metrics to whoever guesses any URL)."""
    def serve(environ: dict, start_response: Callable) -> list[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: the metrics are at /metrics\n"]
        return app(environ, start_response)
    return serve


def _metrics_server(host: str, port: int, app: Callable) -> WSGIServer:
    return make_server(host.strip("[]"), port, _only_metrics(app), _Server, _QuietHandler)


class _Constant(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics
