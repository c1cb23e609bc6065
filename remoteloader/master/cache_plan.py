"""The master's side of the block cache: each split's directive, and the auto policy's loop.

The job's spec says whether (``cache.mode``), the operator where (``--cache``): a master
without a cache gives no directive, whatever the spec. ``write-all`` and ``read`` are
fixed directives; ``auto`` follows the policy (``cache_policy``), whose decisions are
journaled (``CachePlanChanged``) so a restarted master keeps them. What the policy reads
(workers' measured costs, the cache's rates) is measurement, not state: it lives here,
owned by the service's thread, and starts over after a restart.

Every job has its own policy state (``JobCachePolicy``), a shared fleet's jobs too: workers
report each job's costs apart, and each job's plan is decided, checked and journaled for that
job alone. Blocks are keyed by what they hold, not by job, so what one job's plan writes
another job of the same features reads (its directive looks its features up).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Optional

import numpy as np

from ..columns import DenseColumn
from ..core.binding import BoundDataset
from ..core.cache.keys import digest
from ..core.cache.store import BlockStore
from ..core.popularity import load_popularity
from ..core.redact import redact
from ..protocol.messages import CacheDirective
from . import updates as U
from .cache_policy import FeatureGroup, Measured, PlanCheck, choose, feature_groups
from .state import JobState

log = logging.getLogger(__name__)
DECIDE_EVERY_S = 2.0
POPULARITY_WINDOW_S = 7 * 86400.0  # other jobs that read a group's columns this recently may read them again
PROBE_BYTES = 8 << 20


def probe_rates(store: BlockStore, nbytes: int = PROBE_BYTES) -> Optional[tuple[float, float]]:
    """(read, write) bytes/s of one write and one read of ``nbytes``, so the first decision
    has rates before any worker has read or written a block; None if the probe failed."""
    column = DenseColumn(np.random.default_rng().random(nbytes // 4, dtype=np.float32))
    key = digest("probe", time.time_ns())
    try:
        start = time.perf_counter()
        written = store.write(key, {"probe": column})
        wrote = time.perf_counter()
        found = store.lookup(key, ["probe"]).found
        read = time.perf_counter()
        store.remove(key)
    except Exception as e:  # noqa: BLE001 - a probe failure leaves the rates to the workers
        log.warning("cache probe of %s failed: %s", redact(store.uri), e)
        return None
    if "probe" not in found:
        return None
    return written / max(read - wrote, 1e-6), written / max(wrote - start, 1e-6)


class CostLedger:
    """One job's costs from its workers' cumulative reports, as totals that survive worker restarts."""

    def __init__(self) -> None:
        self.fingerprint = ""  # the job (its key) once a report of it came: before, nothing is measured
        self.rows = 0.0
        self.split_s = 0.0
        self.measured = Measured()
        self._last: dict[str, dict] = {}  # worker id -> its last report for this job

    def observe(self, worker_id: str, fingerprint: str, costs: Optional[list]) -> None:
        """The worker's report of job ``fingerprint`` (its key) in ``costs``, if it has one."""
        report = next((c for c in costs or () if c.get("fingerprint") == fingerprint), None)
        if report is None:
            return
        self.fingerprint = fingerprint
        last = self._last.get(worker_id)
        if last is not None and report["rows"] < last["rows"]:
            last = None  # the worker restarted its counts
        self._last[worker_id] = report
        self.rows += report["rows"] - (last["rows"] if last else 0)
        self.split_s += report["split_s"] - (last["split_s"] if last else 0.0)
        self.measured.rows, self.measured.split_s = self.rows, self.split_s
        for table, key in ((self.measured.columns, "columns"), (self.measured.features, "features")):
            before = {c[0]: c for c in (last or {}).get(key, ())}
            for name, rows, seconds, nbytes in report[key]:
                old = before.get(name, (name, 0, 0.0, 0))
                entry = table.setdefault(name, [0.0, 0.0, 0.0])
                entry[0] += rows - old[1]
                entry[1] += seconds - old[2]
                entry[2] += nbytes - old[3]

    def forget(self, worker_id: str) -> None:
        self._last.pop(worker_id, None)


class JobCachePolicy:
    """What the auto policy measures and remembers of one job: its costs (a worker reports
    each job's apart, ``heartbeat.stats.costs``), the check of its last change, its feature
    groups and its current directive. On a shared fleet every job has its own."""

    def __init__(self) -> None:
        self.ledger = CostLedger()
        self.check: Optional[PlanCheck] = None
        self.groups: Optional[list[FeatureGroup]] = None
        self.directive: tuple[object, Optional[CacheDirective]] = (None, None)
        self.next_decision = 0.0
        self.last_choices: dict = {}  # group -> the policy's latest Choice (its reason is current; the plan's may be older)


class CachePlanner:
    def __init__(self, store: Optional[BlockStore], budget_bytes: Optional[int] = None,
                 popularity_log: Optional[str] = None, probe: bool = True) -> None:
        self.store = store
        self.budget_bytes = budget_bytes
        self.popularity_log = popularity_log
        self.probed: Optional[tuple[float, float]] = None  # (read, write) bytes/s; set once by the probe thread
        self.jobs: dict[str, JobCachePolicy] = {}  # job key -> its policy's state (a job the master holds)
        if store is not None and probe:
            threading.Thread(target=self._probe, name="cache-probe", daemon=True).start()

    def policy(self, state: JobState) -> JobCachePolicy:
        return self.jobs.setdefault(state.job.key, JobCachePolicy())

    def forget(self, key: str) -> None:
        """The job ended: its measurements go."""
        self.jobs.pop(key, None)

    # -- each split -----------------------------------------------------------------------
    def directive(self, state: JobState, bound: Optional[BoundDataset]) -> Optional[CacheDirective]:
        """What a split of the job does with the cache now; None: nothing."""
        if self.store is None or bound is None or state.job is None:
            return None
        policy = self.policy(state)
        memo = tuple(sorted(state.cache_plan.items()))
        if policy.directive[0] != memo:
            policy.directive = (memo, self._make_directive(state, bound))
        return policy.directive[1]

    def _make_directive(self, state: JobState, bound: BoundDataset) -> Optional[CacheDirective]:
        mode, pipeline = bound.spec.cache_mode, bound.pipeline
        cacheable = [f for f in pipeline.feature_names if pipeline.row_local(f)]
        # A mix of tables is cached as any job: its blocks are keyed by each table's stored
        # column names (core/cache/job.py), whatever tables[i].columns calls them.
        if mode == "off":
            return None
        if mode == "write-all":
            return CacheDirective(features=cacheable, sources=[], write_features=cacheable, write_sources=[])
        if mode == "read":
            return CacheDirective(features=cacheable, sources=[], write_features=[], write_sources=[])
        if not state.cache_plan:  # auto, nothing decided yet: use what other jobs cached, write nothing
            return CacheDirective(features=cacheable, sources=[], write_features=[], write_sources=[])
        groups = {g.name: g for g in self.groups(state, bound)}
        transformed = [f for name, (m, _) in state.cache_plan.items() if m == "transformed" and name in groups
                       for f in groups[name].features]
        sources = sorted({c for name, (m, _) in state.cache_plan.items() if m == "source" and name in groups
                          for c in groups[name].columns})
        if not transformed and not sources:
            return None  # every group computes: not even a lookup, which a slow cache would make costly
        return CacheDirective(features=transformed, sources=sources, write_features=transformed,
                              write_sources=sources)

    def groups(self, state: JobState, bound: BoundDataset) -> list[FeatureGroup]:
        policy = self.policy(state)
        if policy.groups is None:
            policy.groups = feature_groups(bound.pipeline)
        return policy.groups

    # -- the auto policy, on the service's tick ---------------------------------------------
    def observe(self, worker_id: str, stats: dict, jobs: Iterable[str]) -> None:
        """A worker's heartbeat: its cost report of each of ``jobs`` (the keys of the jobs the master holds)."""
        costs = stats.get("costs")
        if not costs:
            return
        for key in jobs:
            self.jobs.setdefault(key, JobCachePolicy()).ledger.observe(worker_id, key, costs)

    def decide(self, state: JobState, bound: Optional[BoundDataset], worker_totals: Callable[[], dict],
               now: float) -> Optional[U.CachePlanChanged]:
        """A new decision for the job (mode auto), or None when nothing changes."""
        if self.store is None or bound is None or state.job is None or bound.spec.cache_mode != "auto":
            return None
        policy = self.policy(state)
        if now < policy.next_decision:
            return None
        policy.next_decision = now + DECIDE_EVERY_S
        ledger = policy.ledger
        if not ledger.fingerprint:
            return None  # no report for this job yet
        epoch = max((run.epoch for run in state.ranks.values()), default=0)
        if policy.check is not None:
            reason = policy.check.verdict(epoch, ledger.rows, ledger.split_s)
            if reason is not None:
                reverted = set(state.cache_reverted) | set(policy.check.changed)
                plan = {g: ("compute", reason) if g in policy.check.changed else mc
                        for g, mc in state.cache_plan.items()}
                policy.check = None
                log.warning("cache plan of job %s %s", state.job.key, reason)
                return self._update(state, plan, reverted)
        self._rates(ledger.measured, worker_totals())
        groups = self.groups(state, bound)
        choices = choose(groups, ledger.measured, self._reads(state, bound, groups, epoch), state.job.total_rows,
                         self.budget_bytes, frozenset(state.cache_reverted))
        policy.last_choices = {c.group: c for c in choices}
        plan = dict(state.cache_plan)
        changed = []
        for c in choices:
            current = plan.get(c.group, ("", ""))[0]
            # Sticky: a cached group stays so (its blocks are being written) unless the check reverts it.
            if not c.final or current in ("transformed", "source") or current == c.mode:
                continue
            plan[c.group] = (c.mode, c.reason)
            if c.mode != "compute":
                changed.append(c.group)
        if plan == state.cache_plan:
            return None
        if changed:
            policy.check = PlanCheck(tuple(changed), epoch, ledger.split_s / max(ledger.rows, 1.0))
        return self._update(state, plan, set(state.cache_reverted))

    def _update(self, state: JobState, plan: dict, reverted: set) -> U.CachePlanChanged:
        return U.CachePlanChanged(state.job.fingerprint, [U.CacheChoiceRecord(g, m, r) for g, (m, r) in sorted(plan.items())],
                                  sorted(reverted))

    def _rates(self, m: Measured, totals: dict) -> None:
        """The cache's read and write rates: what workers measured, else the probe's."""
        m.read_bps, m.write_bps = self.probed or (None, None)
        if totals.get("cache.read_seconds", 0.0) > 0.05 and totals.get("cache.bytes_read", 0.0) > 0:
            m.read_bps = totals["cache.bytes_read"] / totals["cache.read_seconds"]
        if totals.get("cache.write_seconds", 0.0) > 0.05 and totals.get("cache.put_bytes", 0.0) > 0:
            m.write_bps = totals["cache.put_bytes"] / totals["cache.write_seconds"]

    def _reads(self, state: JobState, bound: BoundDataset, groups: list[FeatureGroup], epoch: int) -> dict[str, float]:
        """Reads expected of each group's rows after this epoch: the job's remaining epochs,
        plus other jobs that read all of its columns lately."""
        remaining = max(0, bound.spec.expected_epochs - 1 - epoch)
        counts: dict[str, int] = {}
        if self.popularity_log:
            counts = load_popularity(self.popularity_log, POPULARITY_WINDOW_S, table=bound.spec.table.path)
        # The log holds this job too (the master records it at submit): the others are one fewer.
        return {g.name: remaining + max(0, min((counts.get(c, 0) for c in g.columns), default=0) - 1)
                for g in groups}

    def _probe(self) -> None:
        assert self.store is not None
        self.probed = probe_rates(self.store)

    # -- status -------------------------------------------------------------------------------
    def status(self, jobs: list[tuple[JobState, Optional[BoundDataset]]], worker_totals: dict) -> Optional[dict]:
        """Where the cache is and its counters; the policy's decisions of a master of one job
        (``mode``, ``groups``, ...) beside them, and of a shared fleet's jobs under ``jobs``, by job key."""
        if self.store is None:
            return None
        out: dict = {"location": redact(self.store.uri), "budget_bytes": self.budget_bytes,
                     "counters": {k[6:]: v for k, v in sorted(worker_totals.items()) if k.startswith("cache.")}}
        held = [(st, bound) for st, bound in jobs if bound is not None and st.job is not None]
        if len(jobs) == 1 and held:
            out.update(self._job_status(*held[0]))
        elif len(jobs) > 1:
            out["jobs"] = {st.job.key: self._job_status(st, bound) for st, bound in held}
        return out

    def _job_status(self, state: JobState, bound: BoundDataset) -> dict:
        out: dict = {"mode": bound.spec.cache_mode}
        if out["mode"] != "auto":
            return out
        policy = self.policy(state)
        m = policy.ledger.measured
        out["read_bytes_per_s"], out["write_bytes_per_s"] = m.read_bps, m.write_bps
        plan = state.cache_plan
        out["groups"] = []
        for g in self.groups(state, bound):
            mode, reason = plan.get(g.name, ("compute", "undecided"))
            latest = policy.last_choices.get(g.name)
            if latest is not None and latest.mode == mode:
                reason = latest.reason
            out["groups"].append({"group": g.name, "features": list(g.features), "columns": list(g.columns),
                                  "mode": mode, "reason": reason})
        out["reverted"] = sorted(state.cache_reverted)
        return out
