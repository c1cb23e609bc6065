"""The state of a master of several jobs (issue 39), changed only by ``FleetState.apply``.

Each job keeps its own ``JobState`` (plan, sessions, runs, resumes, order, cache plan),
untouched by the others. Workers are the fleet's: their updates reach the fleet's worker
registry and every job, so each job keeps its own books of what a worker holds for it. A
job starts from the registry (``ForJob(JobSubmitted)`` of a new key) and ends by
``JobEnded``. A job's key is its spec fingerprint and its name (``messages.job_key``): two
jobs of one spec under two names are two jobs. Like ``JobState.apply``, ``apply`` does no I/O and reads no clock: replaying
the journal rebuilds exactly this state.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import msgspec

from . import updates as U
from ..protocol.messages import job_key
from .state import JobState, WorkerInfo

# Updates of the whole fleet: the worker registry and every job apply them.
FLEET_WIDE = (U.MasterStarted, U.WorkerRegistered, U.WorkerHeartbeat, U.WorkerDraining, U.WorkerLost)
_SESSIONS_CHANGE = (U.ClientJoined, U.ClientLeft, U.Snapshot)


class FleetState:
    def __init__(self) -> None:
        # The fleet's workers and no job: what a new job starts from, and what status lists.
        self.registry = JobState()
        self.jobs: dict[str, JobState] = {}  # job key -> its job, in the order they started
        self.session_job: dict[str, str] = {}  # client session -> the key of its job

    @property
    def workers(self) -> dict[str, WorkerInfo]:
        return self.registry.workers

    def job_of(self, session: str) -> Optional[JobState]:
        key = self.session_job.get(session)
        return None if key is None else self.jobs[key]

    def live_jobs(self) -> list[str]:
        """Keys of the jobs with a client session."""
        return [fp for fp, st in self.jobs.items() if st.clients]

    # -- the one mutator --------------------------------------------------------------
    def apply(self, update: U.Update) -> None:
        handler = _APPLY.get(type(update))
        if handler is not None:
            handler(self, update)
        elif isinstance(update, FLEET_WIDE):
            self._broadcast(update)
        else:  # a job's update without its job: a journal of a master that served one job
            if len(self.jobs) != 1:
                raise ValueError(f"a {type(update).__name__} that names no job, on a master of {len(self.jobs)} jobs")
            self._on_ForJob(U.ForJob(next(iter(self.jobs)), update))

    def _broadcast(self, update: U.Update) -> None:
        self.registry.apply(update)
        for key, st in self.jobs.items():
            st.apply(_seen_by(key, update))

    def _on_ForJob(self, u: U.ForJob) -> None:
        inner = u.update
        if isinstance(inner, U.JobSubmitted):
            if job_key(inner.fingerprint, inner.name) != u.job:
                raise ValueError(f"job {u.job!r} submitted as {job_key(inner.fingerprint, inner.name)!r}")
            if u.job not in self.jobs:
                st = JobState()
                st.apply(self.registry.snapshot())  # the fleet's workers, with nothing assigned
                self.jobs[u.job] = st
        st = self.jobs.get(u.job)
        if st is None:
            raise ValueError(f"an update of job {u.job!r}, which this master does not hold")
        st.apply(inner)
        if isinstance(inner, _SESSIONS_CHANGE):
            self._index_sessions(u.job)

    def _on_JobSubmitted(self, u: U.JobSubmitted) -> None:
        """A journal of a master that served one job: its job, by its fingerprint."""
        self._on_ForJob(U.ForJob(job_key(u.fingerprint, u.name), u))

    def _on_JobEnded(self, u: U.JobEnded) -> None:
        if self.jobs.pop(u.job, None) is not None:
            self._index_sessions(u.job)

    def _index_sessions(self, key: str) -> None:
        for session in [s for s, k in self.session_job.items() if k == key]:
            del self.session_job[session]
        st = self.jobs.get(key)
        if st is not None:
            self.session_job.update((session, key) for session in st.clients)

    def _on_Snapshot(self, u: U.Snapshot) -> None:
        """A compacted journal of a master that served one job: a fleet of that job."""
        jobs = [] if u.job is None else [u]
        self._restore(U.FleetSnapshot(U.FLEET_SNAPSHOT_VERSION, _workers_only(u), jobs))

    def _on_FleetSnapshot(self, u: U.FleetSnapshot) -> None:
        if u.version != U.FLEET_SNAPSHOT_VERSION:
            raise ValueError(f"fleet snapshot version {u.version!r}, this master reads {U.FLEET_SNAPSHOT_VERSION}")
        self._restore(u)

    def _restore(self, u: U.FleetSnapshot) -> None:
        """Built aside and swapped in whole: a snapshot refused in part leaves this state untouched."""
        restored = FleetState()
        restored.registry.apply(u.workers)
        for snap in u.jobs:
            if snap.job is None:
                raise ValueError("a job's snapshot without its job")
            st = JobState()
            st.apply(snap)
            key = st.job.key
            if key in restored.jobs:
                raise ValueError(f"a fleet snapshot holding job {key!r} twice")
            restored.jobs[key] = st
            restored._index_sessions(key)
        self.__dict__.update(restored.__dict__)

    def snapshot(self) -> U.FleetSnapshot:
        return U.FleetSnapshot(U.FLEET_SNAPSHOT_VERSION, self.registry.snapshot(),
                               [st.snapshot() for st in self.jobs.values()])


def _seen_by(key: str, update: U.Update) -> U.Update:
    """A worker's heartbeat as one job sees it: the split it says it is producing is that
    job's only if the heartbeat names it (``stats.job``), so another job's split of the same
    (epoch, id) never looks like progress, or its absence like a lost assignment."""
    if not isinstance(update, U.WorkerHeartbeat) or update.stats.get("job", key) == key:
        return update
    return msgspec.structs.replace(update, stats={k: v for k, v in update.stats.items() if k != "split"})


def _workers_only(u: U.Snapshot) -> U.Snapshot:
    """The fleet's part of a one-job snapshot: its workers, holding nothing."""
    return msgspec.structs.replace(
        u, job=None, workers=[msgspec.structs.replace(w, assigned=[]) for w in u.workers], sessions=[], replaced=[],
        partitions={}, resumed={}, runs=[], prefetched=[], errors=[], error_counts={"failed": 0, "skipped": 0},
        cache_plan=[], cache_reverted=[])


_APPLY: dict[type, Callable[[FleetState, Any], None]] = {
    U.ForJob: FleetState._on_ForJob,
    U.JobSubmitted: FleetState._on_JobSubmitted,
    U.JobEnded: FleetState._on_JobEnded,
    U.Snapshot: FleetState._on_Snapshot,
    U.FleetSnapshot: FleetState._on_FleetSnapshot,
}
