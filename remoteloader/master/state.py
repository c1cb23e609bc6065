"""The master's state, changed only by ``JobState.apply(update)``.

Queries (``choose_split``, ``partition``, ``status``...) read the state and never
change it; the request handlers turn what they decide into update records. ``apply``
does no I/O and reads no clock, so replaying a journal rebuilds exactly this state.
"""
from __future__ import annotations

import hashlib
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import msgspec

from ..core.plan import (
    BaseSplit,
    EpochSplit,
    RankShares,
    pieces_of,
    plan_epoch,
    rank_shares,
)
from ..core.mix import plan_mixed_epoch
from ..core.schedule import lane_of, lane_piece_key
from ..formats import DataFile, reaches
from ..protocol.messages import job_key
from ..spec import DatasetSpec
from . import updates as U


@dataclass
class WorkerInfo:
    worker_id: str
    addr: str
    pid: int
    seq: int  # registration order; ties in balancing break by it, deterministically
    last_seen: float
    buffered: int = 0
    stats: dict = field(default_factory=dict)
    assigned: set = field(default_factory=set)  # (epoch, split_id) not yet fully consumed
    draining: bool = False
    # Hung-split detection: what the worker last said it was producing, and since when.
    producing: Optional[tuple] = None  # (epoch, split_id, pieces produced)
    producing_since: float = 0.0
    key: str = ""  # its X25519 public key (register.key), for clients' membership
    node: str = ""  # the node it runs on (register.node): the ranks of that node get it first
    arena: str = ""  # its arena socket (register.arena), for clients' membership


@dataclass
class SplitProgress:
    split: EpochSplit
    pieces: int
    consumed: int = 0
    worker: Optional[str] = None
    assigned_at: float = 0.0
    produced: bool = False
    failed: Optional[str] = None
    position: int = 0  # in its rank's plan: where it comes in a deterministic order
    lane: Optional[tuple[int, int, int]] = None  # mix_splits: (lane, offset, share), ``core.schedule.lane_of``

    @property
    def done(self) -> bool:
        return self.consumed >= self.pieces or self.failed is not None


@dataclass
class RankEpoch:
    """One run of an epoch by a rank's client session: ``seq`` numbers the session's runs."""

    epoch: int
    session: str
    seq: int
    splits: dict[int, SplitProgress]
    pending: deque  # split ids waiting for a worker, in plan order
    finished: bool = False
    # Split ids assigned to a worker and not done: split choice balances ranks on its size
    # without scanning their splits.
    in_flight: set = field(default_factory=set)


class EpochPlan:
    """One epoch's splits (a split's id is its index), and each rank's of them."""

    def __init__(self, splits: list[EpochSplit]) -> None:
        self.splits = splits
        self.by_rank: dict[int, list[EpochSplit]] = {}
        for s in splits:
            self.by_rank.setdefault(s.rank, []).append(s)


@dataclass
class Job:
    spec: DatasetSpec
    fingerprint: str
    schema: dict[str, str]
    files: list[DataFile]
    splits: list[BaseSplit]
    total_rows: int
    world_size: Optional[int] = None
    # Following a growing table (spec table.follow): the first listing's split count, each
    # epoch's window of base splits [lo, hi) (journaled: WindowOpened), whether it has ended.
    listed: Optional[int] = None
    windows: dict[int, tuple[int, int]] = field(default_factory=dict)
    ended: bool = False
    split_rows: Optional[int] = None  # what its base splits were planned at (JobSubmitted.split_rows)
    file_tables: list[int] = field(default_factory=list)  # tables mixed by weight: each file's table
    name: str = ""  # its name (hello.job on a shared fleet; "": unnamed)

    @property
    def key(self) -> str:
        """What names the job on the master, to workers and in status: fingerprint and name."""
        return job_key(self.fingerprint, self.name)

    @property
    def follows(self) -> bool:
        return self.listed is not None

    def base_tables(self) -> list[int]:
        """Each base split's table in the mix (spec ``tables``)."""
        return [self.file_tables[s.file] for s in self.splits]

    @property
    def plan_fingerprint(self) -> str:
        """Identity of the split plan: a resumed epoch is only exact over the same splits. A
        following job's lists only grow (every id keeps its meaning): its plan is the first
        listing's, so a checkpoint stays valid as the table grows (not on a job that listed
        the table anew: its ids differ)."""
        splits = self.splits if self.listed is None else self.splits[:self.listed]
        files = self.files if self.listed is None else self.files[:max((s.file + 1 for s in splits), default=0)]
        blob = json.dumps([s.to_wire() for s in splits] + [[f.path, f.num_rows] for f in files]).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def window(self, epoch: int) -> list[BaseSplit]:
        """The base splits epoch ``epoch`` plans: all of them, or a following job's window."""
        if self.listed is None:
            return self.splits
        lo, hi = self.windows[epoch]
        return self.splits[lo:hi]


REPLACED_KEPT = 1024
MAX_RESUMED_EPOCHS = 8  # epochs whose resume (rows consumed before) the state keeps
MAX_PLANS = 16  # epoch plans kept in the memo


class JobState:
    def __init__(self) -> None:
        self.job: Optional[Job] = None
        self.workers: dict[str, WorkerInfo] = {}
        self.clients: dict[str, int] = {}  # client session -> rank
        self.session_of: dict[int, str] = {}  # rank -> its live session (the inverse of clients)
        self.client_stats: dict[str, dict] = {}
        self.client_seen: dict[str, float] = {}  # client session -> its last hello or heartbeat
        self.next_seq: dict[str, int] = {}  # client session -> the seq its next epoch run gets
        # Sessions another session of their rank replaced, newest last: told so rather than
        # invited to rejoin (which would take the rank back, and back again).
        self.replaced: deque = deque(maxlen=REPLACED_KEPT)
        self.partitions: dict[int, list[str]] = {}  # rank -> worker ids it reads from
        self.rank_node: dict[int, str] = {}  # rank -> the node its session said it runs on (hello.node)
        self._served: Optional[dict[str, list[int]]] = None  # worker id -> its ranks; None: rebuild
        self.ranks: dict[int, RankEpoch] = {}
        self.prefetched: dict[int, RankEpoch] = {}  # rank -> its next epoch, started early
        self.errors: list[dict] = []  # failed splits of epochs some rank is still in, and files left out
        self.error_counts = {"failed": 0, "skipped": 0}  # every failure of the job, for errors_total
        self._worker_seq = 0
        # Epochs resumed on another world size: base split id -> row ranges consumed before.
        self.resumed: dict[int, dict[int, list[tuple[int, int]]]] = {}
        self._plans: dict[int, EpochPlan] = {}  # memo of the pure epoch plan
        self._plan_floor: Optional[int] = None  # while a snapshot is restored: keep plans from this epoch on
        # The cache policy's decision (cache.mode auto): group -> (mode, reason); groups reverted for good.
        self.cache_plan: dict[str, tuple[str, str]] = {}
        self.cache_reverted: set[str] = set()

    # -- the one mutator --------------------------------------------------------------
    def apply(self, update: U.Update) -> None:
        _APPLY[type(update)](self, update)

    def _on_MasterStarted(self, u: U.MasterStarted) -> None:
        for w in self.workers.values():
            w.last_seen = u.time
        for cid in self.client_seen:
            self.client_seen[cid] = u.time

    def _on_Snapshot(self, u: U.Snapshot) -> None:
        """The state as ``snapshot()`` wrote it (a compacted journal starts with one). Built
        aside and swapped in whole: a snapshot of another version, or one that does not fit
        together (a progress entry of a split its run does not have), is refused with this
        state untouched, so replay never goes on from half a state."""
        if u.version != U.SNAPSHOT_VERSION:
            raise ValueError(f"snapshot version {u.version!r}, this master reads {U.SNAPSHOT_VERSION}")
        restored = JobState()
        restored._restore(u)
        self.__dict__.update(restored.__dict__)

    def _restore(self, u: U.Snapshot) -> None:
        """Rebuild ``u`` into this fresh state, through the same code as live operation."""
        if u.job is not None:
            job = u.job
            self._on_JobSubmitted(U.JobSubmitted(job.spec, job.fingerprint, job.schema, job.files, job.splits, [],
                                                 job.tables, job.split_rows, job.name))
            self.job.world_size = job.world_size
            if self.job.follows:
                self.job.listed, self.job.ended = job.listed, job.ended
                self.job.windows = {epoch: tuple(w) for epoch, w in job.windows.items()}
        self._worker_seq = u.worker_seq
        for w in u.workers:
            self.workers[w.worker_id] = WorkerInfo(w.worker_id, w.addr, w.pid, w.seq, w.last_seen, draining=w.draining,
                                                   assigned=set(w.assigned), key=w.key, node=w.node, arena=w.arena)
        for c in u.sessions:
            self.clients[c.session], self.client_seen[c.session], self.next_seq[c.session] = c.rank, c.seen, c.next_seq
            self.session_of[c.rank] = c.session
            self.rank_node[c.rank] = c.node
        self.replaced.extend(u.replaced)
        self.partitions = {rank: list(members) for rank, members in u.partitions.items()}
        self.resumed = {epoch: {base: list(ranges) for base, ranges in done.items()} for epoch, done in u.resumed.items()}
        # Runs are rebuilt one by one: until all are, none of their plans (nor the resumes
        # they were planned with) may be pruned as older than the runs restored so far.
        self._plan_floor = min((r.epoch for r in (*u.runs, *u.prefetched)), default=None)
        for records, target in ((u.runs, self.ranks), (u.prefetched, self.prefetched)):
            for r in records:
                run = self._new_rank_epoch(r.rank, r.epoch, r.session, r.seq)
                run.finished, run.pending = r.finished, deque(r.pending)
                for p in r.progress:
                    progress = run.splits[p.split_id]
                    progress.consumed, progress.worker, progress.assigned_at = p.consumed, p.worker, p.assigned_at
                    progress.produced, progress.failed = p.produced, p.failed
                    if p.worker is not None and not progress.done:
                        run.in_flight.add(p.split_id)
                target[r.rank] = run
        self._plan_floor = None
        self.errors = [msgspec.structs.asdict(e) for e in u.errors]
        self.error_counts = dict(u.error_counts)
        if self.job is not None:
            self._on_CachePlanChanged(U.CachePlanChanged(self.job.fingerprint, u.cache_plan, u.cache_reverted))

    def snapshot(self) -> U.Snapshot:
        """The whole state but what heartbeats bring back (worker and client statistics);
        applied to a fresh state, it rebuilds this one. Copies, not views: the state goes on
        changing after it is taken."""
        job = self.job

        def runs(epochs: dict[int, RankEpoch]) -> list[U.RunRecord]:
            return [U.RunRecord(rank, run.epoch, run.session, run.seq, run.finished, list(run.pending),
                                [U.ProgressRecord(sid, p.consumed, p.worker, p.assigned_at, p.produced, p.failed)
                                 for sid, p in run.splits.items()
                                 if p.consumed or p.worker is not None or p.failed is not None])
                    for rank, run in sorted(epochs.items())]

        return U.Snapshot(
            version=U.SNAPSHOT_VERSION,
            job=None if job is None else U.JobRecord(
                job.spec, job.fingerprint, dict(job.schema), [U.file_record(f) for f in job.files],
                [U.SplitRecord.of(s) for s in job.splits], job.world_size, job.listed, dict(job.windows), job.ended,
                list(job.file_tables), job.split_rows, job.name),
            worker_seq=self._worker_seq,
            workers=[U.WorkerRecord(w.worker_id, w.addr, w.pid, w.seq, w.last_seen, w.draining, sorted(w.assigned),
                                    w.key, w.node, w.arena) for w in self.workers.values()],
            sessions=[U.SessionRecord(session, rank, self.client_seen.get(session, 0.0), self.next_seq.get(session, 0),
                                      self.rank_node.get(rank, "")) for session, rank in self.clients.items()],
            replaced=list(self.replaced),
            partitions={rank: list(members) for rank, members in sorted(self.partitions.items())},
            resumed={epoch: {base: list(ranges) for base, ranges in done.items()}
                     for epoch, done in sorted(self.resumed.items())},
            runs=runs(self.ranks),
            prefetched=runs(self.prefetched),
            errors=[U.SplitError(**e) for e in self.errors],
            error_counts=dict(self.error_counts),
            cache_plan=[U.CacheChoiceRecord(group, mode, reason) for group, (mode, reason) in sorted(self.cache_plan.items())],
            cache_reverted=sorted(self.cache_reverted),
        )

    def _on_CachePlanChanged(self, u: U.CachePlanChanged) -> None:
        if self.job is None or u.fingerprint != self.job.fingerprint:
            raise ValueError(f"a cache plan for job {u.fingerprint!r}, not the current one")
        self.cache_plan = {c.group: (c.mode, c.reason) for c in u.choices}
        self.cache_reverted = set(u.reverted)

    def _on_JobSubmitted(self, u: U.JobSubmitted) -> None:
        splits = [s.base_split(i) for i, s in enumerate(u.splits)]
        self.cache_plan, self.cache_reverted = {}, set()
        self.job = Job(u.spec, u.fingerprint, u.schema, [U.data_file(f) for f in u.files], splits,
                       sum(s.rows for s in splits), listed=len(splits) if u.spec.table.follow is not None else None,
                       file_tables=list(u.tables), split_rows=u.split_rows, name=u.name)
        if self.job.follows:  # a first listing that holds ``until`` is the stream's last (spec.md)
            self.job.ended = any(reaches(f.partition, u.spec.table.follow["until"]) for f in self.job.files)
        self.errors.extend({"epoch": -1, "rank": -1, "split_id": -1, "rows": 0, "message": m, "skipped": True}
                           for m in u.skipped)
        self.error_counts["skipped"] += len(u.skipped)

    def _on_TableGrew(self, u: U.TableGrew) -> None:
        job = self.job
        if job is None or not job.follows:
            raise ValueError("a growth of a job that does not follow its table")
        if (u.first_file, u.first_split) != (len(job.files), len(job.splits)):
            raise ValueError(f"a growth from file {u.first_file} and split {u.first_split}, but the job has "
                             f"{len(job.files)} files and {len(job.splits)} splits")
        job.files.extend(U.data_file(f) for f in u.files)
        job.splits.extend(s.base_split(u.first_split + i) for i, s in enumerate(u.splits))
        job.total_rows += sum(s.rows for s in u.splits)
        job.ended = job.ended or u.ended
        skipped = self.job.spec.on_error == "skip"
        self.errors.extend({"epoch": -1, "rank": -1, "split_id": -1, "rows": 0, "message": m, "skipped": skipped}
                           for m in u.problems)
        self.error_counts["skipped" if skipped else "failed"] += len(u.problems)

    def _on_WindowOpened(self, u: U.WindowOpened) -> None:
        job = self.job
        if job is None or not job.follows:
            raise ValueError("a window of a job that does not follow its table")
        lo = 0 if u.epoch == 0 else job.windows.get(u.epoch - 1, (None, None))[1]
        if u.epoch in job.windows or u.lo != lo or not lo <= u.hi <= len(job.splits):
            raise ValueError(f"window [{u.lo}, {u.hi}) of epoch {u.epoch} does not follow the job's windows")
        job.windows[u.epoch] = (u.lo, u.hi)
        self._plans.pop(u.epoch, None)

    def _on_WorkerRegistered(self, u: U.WorkerRegistered) -> None:
        self._worker_seq += 1
        self.workers[u.worker_id] = WorkerInfo(u.worker_id, u.addr, u.pid, self._worker_seq, u.time, key=u.key,
                                               node=u.node, arena=u.arena)

    def _on_WorkerHeartbeat(self, u: U.WorkerHeartbeat) -> None:
        w = self.workers.get(u.worker_id)
        if w is None:
            return
        w.last_seen, w.buffered, w.stats = u.time, u.buffered, u.stats
        split = u.stats.get("split")
        producing = tuple(split) if isinstance(split, list) else None
        # A full buffer is backpressure from a slow trainer, not a hung worker.
        if producing != w.producing or u.buffered >= u.stats.get("capacity", 1 << 30):
            w.producing, w.producing_since = producing, u.time

    def _on_WorkerDraining(self, u: U.WorkerDraining) -> None:
        if u.worker_id in self.workers:
            self.workers[u.worker_id].draining = True

    def _on_SplitRevoked(self, u: U.SplitRevoked) -> None:
        rank_epoch, progress = self._owner(u.epoch, u.split_id)
        w = self.workers.get(u.worker_id)
        if w is not None:
            w.assigned.discard((u.epoch, u.split_id))
            if w.producing is not None and tuple(w.producing[:2]) == (u.epoch, u.split_id):
                w.producing = None
        if progress is not None and progress.worker == u.worker_id:
            self._requeue(lambda p: p is progress, [rank_epoch])

    def _on_WorkerLost(self, u: U.WorkerLost) -> None:
        w = self.workers.pop(u.worker_id, None)
        if w is None:
            return
        # Unfinished splits go back to the front of their queue; the next worker skips
        # the pieces clients already consumed, and clients drop any piece they hold.
        self._requeue(lambda p: p.worker == u.worker_id)
        for members in self.partitions.values():
            if u.worker_id in members:
                members.remove(u.worker_id)
        self._served = None

    def _on_ClientJoined(self, u: U.ClientJoined) -> None:
        assert self.job is not None
        if self.job.world_size is None:
            self.job.world_size = u.world_size
        for session in [s for s, rank in self.clients.items() if rank == u.rank and s != u.session]:
            self._forget_client(session)  # a new process of the rank replaces the old one
            self.replaced.append(session)
        # Runs of another session: their pieces at workers are for a client that will not
        # ask for them. The new session says what it consumed when it starts its epoch.
        self._drop_runs(u.rank, keep=u.session)
        self.clients[u.session] = u.rank
        self.session_of[u.rank] = u.session
        self.rank_node[u.rank] = u.node
        self.client_seen[u.session] = u.time
        self.next_seq.setdefault(u.session, 0)
        self.partitions.setdefault(u.rank, [])
        self._served = None

    def _on_ClientHeartbeat(self, u: U.ClientHeartbeat) -> None:
        if u.session in self.clients:
            self.client_stats[u.session] = dict(u.stats, time=u.time)
            self.client_seen[u.session] = u.time

    def _on_ClientLeft(self, u: U.ClientLeft) -> None:
        rank = self.clients.get(u.session)
        self._forget_client(u.session)
        if rank is not None:
            self._drop_runs(rank, keep=None, session=u.session)
        if not self.clients:
            self._end_job_run()

    def _on_PartitionsChanged(self, u: U.PartitionsChanged) -> None:
        self.partitions = {rank: [w for w in members if w in self.workers] for rank, members in u.partitions}
        self._served = None

    def _forget_client(self, session: str) -> None:
        rank = self.clients.pop(session, None)
        if rank is not None and self.session_of.get(rank) == session:
            del self.session_of[rank]
        self.client_stats.pop(session, None)
        self.client_seen.pop(session, None)
        self.next_seq.pop(session, None)

    def _drop_runs(self, rank: int, keep: Optional[str], session: Optional[str] = None) -> None:
        """Release the rank's epoch runs (current and prefetched) of sessions other than
        ``keep`` (or only those of ``session``): their splits leave the workers' books."""
        for runs in (self.ranks, self.prefetched):
            run = runs.get(rank)
            if run is not None and run.session != keep and session in (None, run.session):
                self._release(run)
                del runs[rank]

    def _end_job_run(self) -> None:
        """Every client has left: the next client starts a new run of the job, with a world
        size of its own. The job (spec, files, splits) and the workers stay."""
        for run in self._rank_epochs():
            self._release(run)
        self.ranks.clear()
        self.prefetched.clear()
        self.partitions.clear()
        self.rank_node.clear()
        self._served = None
        self.resumed.clear()
        self._plans.clear()
        self.errors = [e for e in self.errors if e["epoch"] < 0]
        if self.job is not None:
            self.job.world_size = None

    def _on_EpochStarted(self, u: U.EpochStarted) -> None:
        # A fresh start from the plan, unless workers already started this run ahead of
        # time (prefetch of the same session and epoch): its pieces are deterministic, so
        # they stand whatever the client then reports it has consumed (SplitsConsumed,
        # right after), whether it is new, resumed from a checkpoint, or rejoining.
        current = self.ranks.get(u.rank)
        if current is not None:
            self._release(current)
        self.next_seq[u.session] = max(self.next_seq.get(u.session, 0), u.seq + 1)
        ahead = self.prefetched.pop(u.rank, None)
        if ahead is not None and (ahead.session, ahead.epoch, ahead.seq) == (u.session, u.epoch, u.seq):
            self.ranks[u.rank] = ahead
            return
        if ahead is not None:
            self._release(ahead)
        self.ranks[u.rank] = self._new_rank_epoch(u.rank, u.epoch, u.session, u.seq)
        # Errors of epochs no rank is in any more have been reported: keep the list bounded.
        epochs = {r.epoch for r in self.ranks.values()}
        self.errors = [e for e in self.errors if e["epoch"] < 0 or e["epoch"] in epochs]

    def _on_EpochResumed(self, u: U.EpochResumed) -> None:
        done: dict[int, list[tuple[int, int]]] = {}
        for base, lo, hi in u.done:
            done.setdefault(base, []).append((lo, hi))
        self.resumed[u.epoch] = {b: sorted(r) for b, r in done.items()}
        self._plans.pop(u.epoch, None)
        # Bounded whatever clients send: resumes of epochs no run is in go first, oldest first.
        if len(self.resumed) > MAX_RESUMED_EPOCHS:
            live = {r.epoch for r in self._rank_epochs()} | {u.epoch}
            for epoch in sorted(self.resumed, key=lambda e: (e in live, e))[:len(self.resumed) - MAX_RESUMED_EPOCHS]:
                del self.resumed[epoch]
                self._plans.pop(epoch, None)

    def _on_EpochPrefetched(self, u: U.EpochPrefetched) -> None:
        if u.rank not in self.prefetched:
            self.prefetched[u.rank] = self._new_rank_epoch(u.rank, u.epoch, u.session, u.seq)
            self.next_seq[u.session] = max(self.next_seq.get(u.session, 0), u.seq + 1)

    def _new_rank_epoch(self, rank: int, epoch: int, session: str, seq: int) -> RankEpoch:
        assert self.job is not None and self.job.world_size is not None
        batch_size = self.job.spec.batch_size
        mine = self._plan(epoch).by_rank.get(rank, [])
        splits = {s.id: SplitProgress(s, pieces_of(s.rows, batch_size), position=i) for i, s in enumerate(mine)}
        pending = deque(s.id for s in mine)
        mix = self.job.spec.mix_splits
        if self.job.spec.tables:  # a mix of tables: its lanes as planned, in the order the batches need them
            for s in mine:
                splits[s.id].lane = s.lane
            pending = deque(s.id for s in sorted(mine, key=lambda s: lane_piece_key(s.lane, 0, batch_size)))
        elif mix > 1:  # lanes: splits go out in the order the batches first need them, K lanes at once
            lanes = lane_of([s.rows for s in mine], batch_size, mix)
            for s, lane in zip(mine, lanes):
                splits[s.id].lane = lane
            pending = deque(s.id for _, s in sorted(zip(lanes, mine), key=lambda x: lane_piece_key(x[0], 0, batch_size)))
        return RankEpoch(epoch, session, seq, splits, pending)

    def _on_SplitAssigned(self, u: U.SplitAssigned) -> None:
        rank_epoch, progress = self._owner(u.epoch, u.split_id)
        rank_epoch.pending.remove(u.split_id)
        rank_epoch.in_flight.add(u.split_id)
        progress.worker, progress.produced, progress.assigned_at = u.worker_id, False, u.time
        self.workers[u.worker_id].assigned.add((u.epoch, u.split_id))

    def _on_SplitProduced(self, u: U.SplitProduced) -> None:
        progress = self._progress(u.epoch, u.split_id)
        if progress is not None and progress.worker == u.worker_id:
            progress.produced = True

    def _on_SplitsConsumed(self, u: U.SplitsConsumed) -> None:
        rank_epoch = self.ranks.get(u.rank)
        if rank_epoch is None or rank_epoch.seq != u.seq:
            return
        for split_id, consumed in u.acks:
            progress = rank_epoch.splits.get(split_id)
            if progress is None:
                continue
            progress.consumed = max(progress.consumed, min(consumed, progress.pieces))
            if progress.done:
                self._finish(rank_epoch.epoch, progress)

    def _on_SplitFailed(self, u: U.SplitFailed) -> None:
        progress = self._progress(u.epoch, u.split_id)
        if progress is None or progress.done:
            return
        progress.failed = u.error
        self._finish(u.epoch, progress)
        self.errors.append({"epoch": u.epoch, "rank": progress.split.rank, "split_id": u.split_id,
                            "rows": progress.split.rows, "message": u.error, "skipped": u.skipped})
        self.error_counts["skipped" if u.skipped else "failed"] += 1

    def _on_EpochFinished(self, u: U.EpochFinished) -> None:
        rank_epoch = self.ranks.get(u.rank)
        if rank_epoch is not None and rank_epoch.seq == u.seq:
            self._release(rank_epoch)
            rank_epoch.finished = True

    # -- helpers of apply ----------------------------------------------------------------
    def _rank_epochs(self) -> list[RankEpoch]:
        return [*self.ranks.values(), *self.prefetched.values()]

    def _requeue(self, which: Callable[[SplitProgress], bool], rank_epochs: Optional[list[RankEpoch]] = None) -> None:
        """Assigned, unfinished splits matching ``which`` (of ``rank_epochs``, default all)
        go back to the front of their queues, in the order the rank needs them: plan order,
        or with lanes the order their batches first need them in (one worker holds several
        lanes' splits)."""
        def need(p: SplitProgress) -> Any:
            return p.split.id if p.lane is None else lane_piece_key(p.lane, 0, self.job.spec.batch_size)

        for rank_epoch in self._rank_epochs() if rank_epochs is None else rank_epochs:
            hit = [p for p in map(rank_epoch.splits.__getitem__, rank_epoch.in_flight) if which(p)]
            for p in sorted(hit, key=need, reverse=True):
                if p.worker in self.workers:
                    self.workers[p.worker].assigned.discard((rank_epoch.epoch, p.split.id))
                p.worker, p.produced = None, False
                rank_epoch.in_flight.discard(p.split.id)
                rank_epoch.pending.appendleft(p.split.id)

    def _plan(self, epoch: int) -> EpochPlan:
        if epoch not in self._plans:
            spec = self.job.spec
            if spec.tables:  # a mix of tables: its passes less the rows consumed before a resume (core/mix.py)
                self._plans[epoch] = EpochPlan(self._mixed_plan(epoch, self.resumed.get(epoch)))
            else:
                self._plans[epoch] = EpochPlan(plan_epoch(
                    self.job.window(epoch), epoch, spec.seed, spec.shuffle, self.job.world_size, spec.batch_size,
                    spec.drop_last, spec.even_batches, self.resumed.get(epoch), spec.mix_splits))
            oldest = min(r.epoch for r in self.ranks.values()) if self.ranks else epoch
            if self._plan_floor is not None:
                oldest = min(oldest, self._plan_floor)
            self._plans = {e: p for e, p in self._plans.items() if e >= min(oldest, epoch)}
            self.resumed = {e: d for e, d in self.resumed.items() if e >= min(oldest, epoch)}
            if len(self._plans) > MAX_PLANS:  # a memo: any plan can be computed again
                live = {r.epoch for r in self._rank_epochs()} | {epoch}
                self._plans = {e: p for e, p in self._plans.items() if e in live}
        return self._plans[epoch]

    def _mixed_plan(self, epoch: int, done: Optional[Mapping[int, list[tuple[int, int]]]]) -> list[EpochSplit]:
        spec = self.job.spec
        mixed = plan_mixed_epoch(self.job.splits, self.job.base_tables(), [t.weight for t in spec.tables],
                                 [t.when_done for t in spec.tables], epoch, spec.seed, spec.shuffle,
                                 self.job.world_size, spec.batch_size, spec.even_batches, done)
        return [s for r in sorted(mixed) for s in mixed[r].splits]

    def _owner(self, epoch: int, split_id: int) -> tuple[Optional[RankEpoch], Optional[SplitProgress]]:
        plan = self._plans.get(epoch)
        if plan is not None and 0 <= split_id < len(plan.splits):
            rank = plan.splits[split_id].rank  # a split's id is its place in the epoch's plan
            for rank_epoch in (self.ranks.get(rank), self.prefetched.get(rank)):
                if rank_epoch is not None and rank_epoch.epoch == epoch and split_id in rank_epoch.splits:
                    return rank_epoch, rank_epoch.splits[split_id]
        for rank_epoch in self._rank_epochs():  # not indexed (a stale report of an epoch gone): rare
            if rank_epoch.epoch == epoch and split_id in rank_epoch.splits:
                return rank_epoch, rank_epoch.splits[split_id]
        return None, None

    def _progress(self, epoch: int, split_id: int) -> Optional[SplitProgress]:
        return self._owner(epoch, split_id)[1]

    def _finish(self, epoch: int, progress: SplitProgress) -> None:
        if progress.worker in self.workers:
            self.workers[progress.worker].assigned.discard((epoch, progress.split.id))
        rank_epoch, _ = self._owner(epoch, progress.split.id)
        if rank_epoch is not None:
            rank_epoch.in_flight.discard(progress.split.id)
            if progress.worker is None and progress.split.id in rank_epoch.pending:
                rank_epoch.pending.remove(progress.split.id)

    def _release(self, rank_epoch: RankEpoch) -> None:
        rank_epoch.pending.clear()
        for progress in rank_epoch.splits.values():
            if progress.worker in self.workers:
                self.workers[progress.worker].assigned.discard((rank_epoch.epoch, progress.split.id))

    def balanced_partitions(self, max_workers_per_client: int) -> dict[int, list[str]]:
        """Partitioned round robin with locality: each rank reads from at most
        ``max_workers_per_client`` workers. Live members stay put (a client never loses a
        worker that holds its data). Free slots are filled from the workers of the rank's own
        node (``register.node`` equal to its ``hello.node``; "" is a node too, so a cluster
        that names none is one node), and only while that node has no live worker from the
        others (the fallback: a node whose workers are still starting, or all lost); within
        either, from the workers serving the fewest ranks. A query: the service commits the
        result as ``PartitionsChanged`` whenever membership changes."""
        partitions = {rank: list(members) for rank, members in self.partitions.items()}
        live = sorted((w for w in self.workers.values() if not w.draining), key=lambda w: w.seq)
        load = {w.worker_id: 0 for w in self.workers.values()}
        for members in partitions.values():
            for wid in members:
                load[wid] += 1
        for rank in sorted(partitions):
            members = partitions[rank]
            node = self.rank_node.get(rank, "")
            pool = [w for w in live if w.node == node] or live
            target = min(max_workers_per_client, len(pool))
            pooled = {w.worker_id for w in pool}
            serving = sum(1 for m in members if m in pooled)  # what the target counts
            live_members = sum(1 for m in members if not self.workers[m].draining)  # what the cap counts
            while serving < target and live_members < max_workers_per_client:
                wid = min((w.worker_id for w in pool if w.worker_id not in members),
                          key=lambda i: (load[i], self.workers[i].seq))
                members.append(wid)
                load[wid] += 1
                serving, live_members = serving + 1, live_members + 1
        return partitions

    def sessions_served(self, worker_id: str) -> list[str]:
        """The live sessions of the ranks whose partition holds this worker: the only ones
        it may hold pieces for (what its heartbeat reply lists)."""
        return [self.session_of[r] for r in self._served_ranks(worker_id) if r in self.session_of]

    def _served_ranks(self, worker_id: str) -> list[int]:
        """The ranks whose partition holds this worker, from an index rebuilt only after
        partitions change (rarely: membership), so split choice never scans every rank.
        Every change of partitions drops the index (``_served = None``)."""
        if self._served is None:
            self._served = {}
            for rank, members in sorted(self.partitions.items()):
                for wid in members:
                    self._served.setdefault(wid, []).append(rank)
        return self._served.get(worker_id, [])

    # -- queries ---------------------------------------------------------------------------
    def choose_split(self, worker_id: str, avoid: frozenset = frozenset(),
                     ahead: bool = True) -> Optional[tuple[RankEpoch, SplitProgress]]:
        """(epoch run, split) next for this worker: from the ranks it serves (but those in
        ``avoid``, whose share of the worker's buffer is full), a rank of its own node first,
        then the one with the fewest splits in flight, so every trainer's queue fills evenly;
        with ``ahead``, a prefetched next epoch when no current epoch has work for it."""
        worker = self.workers[worker_id]
        if worker.draining:
            return None
        served = self._served_ranks(worker_id)
        for epochs in (self.ranks, self.prefetched) if ahead else (self.ranks,):
            best = None
            for rank in served:
                rank_epoch = epochs.get(rank)
                if rank in avoid or rank_epoch is None or rank_epoch.finished or not rank_epoch.pending:
                    continue
                # A worker that serves another node's rank (the fallback) serves its own node's first.
                order = (self.rank_node.get(rank, "") != worker.node, len(rank_epoch.in_flight))
                if best is None or order < best[0]:
                    best = (order, rank_epoch, rank_epoch.splits[rank_epoch.pending[0]])
            if best is not None:
                return best[1], best[2]
        return None

    def splits_ahead(self, worker_id: str) -> list[tuple[int, int]]:
        """(epoch, split id) the worker holds of epochs started early: their pieces wait in
        the worker's buffer until the trainer gets there."""
        return [(rank_epoch.epoch, split_id) for rank_epoch in self.prefetched.values()
                for split_id in rank_epoch.in_flight if rank_epoch.splits[split_id].worker == worker_id]

    def prefetch_candidates(self, worker_id: str) -> list[U.EpochPrefetched]:
        """The next epoch of ranks this worker serves whose current run has nothing left to
        hand out, whose client session is still there, and whose next epoch has not been
        started yet; as the updates that start them (each reserving its session's next seq)."""
        return [U.EpochPrefetched(rank, re.epoch + 1, re.session, self.next_seq[re.session])
                for rank, re in sorted(self.ranks.items())
                if worker_id in self.partitions.get(rank, ()) and not re.pending and rank not in self.prefetched
                and re.session in self.clients and (not self.job.follows or re.epoch + 1 in self.job.windows)]

    def stalled_splits(self, now: float, heartbeat_interval: float, split_timeout: float) -> list[tuple]:
        """(epoch, split_id, worker_id, reason) of assigned splits that make no progress:
        not being produced although the worker has heartbeated since it got them (the
        assignment reply was lost, e.g. in a master crash), or produced no piece for
        ``split_timeout`` (a hung worker)."""
        out = []
        for w in self.workers.values():
            current = w.producing[:2] if w.producing else None
            for epoch, split_id in sorted(w.assigned):
                p = self._progress(epoch, split_id)
                if p is None or p.produced or p.done:
                    continue
                if current != (epoch, split_id):
                    if w.last_seen - p.assigned_at > 2 * heartbeat_interval + 1.0:
                        out.append((epoch, split_id, w.worker_id, "the worker does not hold it (assignment lost)"))
                elif now - w.producing_since > split_timeout:
                    out.append((epoch, split_id, w.worker_id, f"no progress for {now - w.producing_since:.1f} s "
                                                              f"(stuck after piece {w.producing[2]})"))
        return out

    def shares(self) -> RankShares:
        """Each rank's rows of a whole epoch (a resumed epoch has fewer)."""
        assert self.job is not None and self.job.world_size is not None
        spec = self.job.spec
        if spec.tables:  # a mix: each rank's rows of its passes, the same every whole epoch (core/mix.py)
            whole = EpochPlan(self._mixed_plan(0, None)) if 0 in self.resumed else self._plan(0)
            rows = [sum(s.rows for s in whole.by_rank.get(r, ())) for r in range(self.job.world_size)]
            return RankShares(tuple(rows), (0,) * len(rows), 0)
        return rank_shares(self.job.total_rows, self.job.world_size, spec.batch_size, spec.drop_last,
                           spec.even_batches)

    def rows_read_by_table(self) -> list[int]:
        """A mix of tables: the rows of each table the ranks consumed in their current epochs
        (whole pieces acknowledged: what the realised mix is measured on)."""
        read = [0] * len(self.job.spec.tables)
        for rank_epoch in self.ranks.values():
            for p in rank_epoch.splits.values():
                if p.split.lane is not None and p.failed is None:
                    read[p.split.lane[0]] += min(p.consumed * self.job.spec.batch_size, p.split.rows)
        return read

    def epoch_started(self, epoch: int) -> bool:
        """Whether any rank (or a prefetch) has started ``epoch`` from its plan."""
        return any(r.epoch == epoch for r in self._rank_epochs())

    def epoch_splits(self, rank: int, epoch: int) -> list[SplitProgress]:
        rank_epoch = self.ranks[rank]
        assert rank_epoch.epoch == epoch
        return list(rank_epoch.splits.values())

    def errors_for(self, rank: int, epoch: int) -> list[dict]:
        return [e for e in self.errors if (e["rank"], e["epoch"]) in ((rank, epoch), (-1, -1))]


# Which method applies each update type. Checked at import: an Update without a handler
# fails when the master starts, not when a journal holding one is replayed.
_APPLY: dict[type, Callable[[JobState, Any], None]] = {
    U.MasterStarted: JobState._on_MasterStarted,
    U.JobSubmitted: JobState._on_JobSubmitted,
    U.WorkerRegistered: JobState._on_WorkerRegistered,
    U.WorkerHeartbeat: JobState._on_WorkerHeartbeat,
    U.WorkerDraining: JobState._on_WorkerDraining,
    U.SplitRevoked: JobState._on_SplitRevoked,
    U.WorkerLost: JobState._on_WorkerLost,
    U.ClientJoined: JobState._on_ClientJoined,
    U.ClientHeartbeat: JobState._on_ClientHeartbeat,
    U.ClientLeft: JobState._on_ClientLeft,
    U.PartitionsChanged: JobState._on_PartitionsChanged,
    U.Snapshot: JobState._on_Snapshot,
    U.EpochStarted: JobState._on_EpochStarted,
    U.EpochPrefetched: JobState._on_EpochPrefetched,
    U.EpochResumed: JobState._on_EpochResumed,
    U.SplitAssigned: JobState._on_SplitAssigned,
    U.SplitProduced: JobState._on_SplitProduced,
    U.SplitsConsumed: JobState._on_SplitsConsumed,
    U.SplitFailed: JobState._on_SplitFailed,
    U.EpochFinished: JobState._on_EpochFinished,
    U.CachePlanChanged: JobState._on_CachePlanChanged,
    U.TableGrew: JobState._on_TableGrew,
    U.WindowOpened: JobState._on_WindowOpened,
}
_unhandled = set(U.UPDATE_TYPES.values()) - set(_APPLY) - set(U.FLEET_ONLY)
if _unhandled:
    raise ImportError(f"JobState.apply has no handler for {sorted(c.__name__ for c in _unhandled)}")
