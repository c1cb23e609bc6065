"""Request handling: turns each message into update records, applies them, replies.

Handlers decide (reading ``FleetState`` and each job's ``JobState`` through their
queries), then ``_commit`` journals and applies. Nothing here changes state any other way,
so the reply a client gets is always consistent with what a restarted master would
rebuild from the journal. A master holds up to ``max_jobs`` jobs (issue 39): a client's
requests go to the job of its session, a worker's split reports to the job they name.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Union

import msgspec

from ..core.binding import BoundDataset, bind, bind_schema
from ..core.cache.job import job_block_keys
from ..core.cache.store import BlockStore
from ..core.mix import MAX_PASSES, base_and_pass, check_passes
from ..core.plan import make_task, plan_base_splits
from ..core.schedule import split_order
from ..core.popularity import record_projection
from ..core.redact import redact, redact_text
from ..core.sampling import sampled_splits
from ..core.sizing import DEFAULT_BUFFER_BYTES, format_size, row_bytes, split_rows_within
from ..protocol.address import AddressError, validate_address
from ..protocol.capability import MasterKeys
from ..protocol import messages as M
from ..protocol.messages import MASTER_REQUESTS, ErrorCode
from ..spec import DatasetSpec, SpecError, spec_differences, weighted_shares
from . import updates as U
from ..core.allowlist import TableAllowlist
from .cache_plan import CachePlanner
from .history import History
from .journal import Journal
from .fleet import FleetState
from .follow import Follower
from .metrics import RateWindow
from .share import JobShares, effective_weight
from .shared_work import Candidate, SharedWork, split_identity
from .state import JobState

log = logging.getLogger(__name__)
Reply = M.MasterReply


class RequestError(Exception):
    """Answered to the sender as an ``error`` message; ``code`` lets clients react."""

    def __init__(self, message: str, code: Optional[ErrorCode] = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class MasterConfig:
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    max_workers_per_client: int = 32
    no_split_retry_ms: int = 50
    split_timeout: float = 60.0  # a worker producing nothing for this long loses its split
    rate_window_s: float = 10.0  # throughput and stall are measured over this window
    popularity_log: Optional[str] = None  # JSON lines: each job's projected columns (feature reordering)
    prefetch_next_epoch: bool = True  # idle workers start a rank's next epoch before it asks
    # Bounds on what peers can make the master hold (a flood is refused, not absorbed).
    max_workers: int = 4096
    max_world_size: int = 4096
    max_epoch: int = 1 << 31
    # Table path / URI prefixes clients' specs may read (None: any; empty: none, the
    # master's own --spec only). remoteloader-master always sets it.
    allowed_tables: Optional[tuple[str, ...]] = None
    bind_timeout: float = 120.0  # seconds a first client's spec may take to bind (list files, footers)
    client_timeout: float = 600.0  # a client silent this long is forgotten (it rejoins by saying hello)
    # The journal is compacted to one snapshot once the records appended since the last one
    # pass this many bytes, or the snapshot's own size if larger (so compaction costs O(1)
    # per byte appended, and an idle master never compacts, however large its state).
    journal_compact_bytes: int = 4 << 20
    # What each worker may hold (its --buffer-bytes): splits are planned so that one
    # transformed split stays within half of it.
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    # The master's private ipc directory (``--bind ipc://DIR/NAME``): registered ipc
    # addresses must lie in it. None: the master listens on tcp, and takes no ipc worker.
    ipc_dir: Optional[str] = None
    # The block cache's byte budget (--cache-max-bytes): the auto policy plans within it.
    cache_max_bytes: Optional[int] = None
    # Jobs (specs) the master holds at once. 1: it serves one spec for its whole life (the
    # first client's, or --spec), and refuses any other; more: a shared fleet, where a job
    # whose loaders all left keeps its place until a new spec needs it (--max-jobs).
    max_jobs: int = 1


BIND_WAIT_S = 0.5  # the longest a hello holds the loop while a spec binds
# Row ranges of one base split a resume's `done` may hold: the prefixes of its epoch splits,
# which an elastic resume's plan cuts again (each resume can add a few).
MAX_DONE_RANGES = 16


@dataclass
class JobRuntime:
    """What the service knows of a job beyond its journaled state: its bound pipeline, and
    the transformed bytes of a row and of its largest split as estimated when this master
    planned it (a replayed job's splits were cut already: they stay unknown)."""

    bound: BoundDataset
    row_bytes: Optional[float] = None
    split_bytes: Optional[int] = None
    follower: Optional[Follower] = None  # a following job's re-listings (master/follow.py)


@dataclass
class Planned:
    """A bound job, its base splits, and the estimate they were cut by."""

    bound: BoundDataset
    splits: list
    row_bytes: Optional[float]  # transformed bytes per row of a sample (None: not estimated)
    split_rows: int  # the rows a base split was planned at: split_rows, or the cap that fits a worker


def _bind_and_plan(spec: DatasetSpec, budget_bytes: int = DEFAULT_BUFFER_BYTES) -> Planned:
    """Bind and plan a job, with splits small enough for the workers' budget: one
    transformed split within half of ``budget_bytes`` (core/sizing.py), or the spec's
    ``split_rows`` if that is smaller. The splits are journaled: a replay never plans again."""
    bound = bind(spec)
    files = bound.files or []
    try:
        per_row = row_bytes(bound, files)
    except Exception as e:  # the sample's error is the workers' to report, with its split
        log.warning("could not estimate the transformed size of a row (%s): splits planned with split_rows %d",
                    redact_text(str(e))[:500], spec.split_rows)
        per_row = None
    base = plan_base_splits(files, spec.split_rows)
    split_rows = spec.split_rows
    # A deterministic order reads `cycle` splits of a rank at once: they must fit a worker together.
    # Mixed batches read `mix_splits` splits of a rank at once, one per lane: the same.
    share = budget_bytes if spec.splits_in_flight is None else budget_bytes * 2 // (spec.splits_in_flight + 1)
    cap = split_rows_within(share, per_row) if per_row is not None else None
    if cap is not None and base and max(s.raw_rows for s in base) > cap:
        split_rows = cap
        planned = max(s.raw_rows for s in base)
        base = plan_base_splits(files, cap)
        largest = max(s.raw_rows for s in base)
        uncut = sum(1 for s in base if s.raw_rows > cap)
        log.warning("split_rows %d: about %s a row once transformed makes a split of %d rows %s, more than half the "
                    "workers' --buffer-bytes %s; planned splits of at most %d rows instead%s", spec.split_rows,
                    format_size(per_row), planned, format_size(planned * per_row), format_size(budget_bytes), cap,
                    "" if not uncut else f" ({uncut} splits are single stripes or row groups of up to {largest} rows, "
                                         f"{format_size(largest * per_row)}, which cannot be cut smaller)")
    splits = sampled_splits(bound, files, base)
    for i, mixed in enumerate(spec.tables):  # each table of a mix, named by its key
        if not any(s.rows for s in splits if bound.file_tables[s.file] == i):
            raise SpecError(f"tables[{i}].partitions: the selection of table {mixed.table.path!r} has no rows")
    if not splits or sum(s.rows for s in splits) == 0:
        raise SpecError(f"table.partitions: the selection of table {spec.table.path!r} has no rows")
    if spec.tables:
        check_passes(spec, [sum(s.rows for s in splits if bound.file_tables[s.file] == i)
                            for i in range(len(spec.tables))])
    return Planned(bound, splits, per_row, split_rows)


class PendingBind:
    """A spec being bound on its own thread (a daemon: a hung object store cannot keep
    the master from exiting)."""

    def __init__(self, spec: DatasetSpec, started: float, budget_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        self.spec, self.started, self.budget_bytes = spec, started, budget_bytes
        self.done = threading.Event()
        self.result: Optional[Planned] = None
        self.error: Optional[SpecError] = None
        threading.Thread(target=self._run, name="remoteloader-bind", daemon=True).start()

    def _run(self) -> None:
        try:
            self.result = _bind_and_plan(self.spec, self.budget_bytes)
        except SpecError as e:
            self.error = e
        except Exception as e:  # a failure the binder did not foresee still answers the client
            self.error = SpecError(f"table.path: binding failed: {type(e).__name__}: {e}")
        finally:
            self.done.set()


def _weight(st: JobState) -> float:
    """A job's weight in the fair share (its spec's ``share``), its priority class applied."""
    return effective_weight(st.job.spec.share_weight, st.job.spec.priority)


def _done_of(resumed: Optional[dict]) -> list:
    return sorted([base, lo, hi] for base, ranges in (resumed or {}).items() for lo, hi in ranges)


def _acks(acks: list[M.Ack]) -> list[tuple[int, int]]:
    return [(a.split_id, a.pieces) for a in acks]


class MasterService:
    def __init__(self, config: MasterConfig, journal: Optional[Journal] = None,
                 clock: Callable[[], float] = time.time, keys: Optional[MasterKeys] = None,
                 cache: Optional[BlockStore] = None) -> None:
        """``cache``: the block cache (``--cache``); without it no split touches a cache."""
        if config.max_jobs < 1:
            raise ValueError(f"max_jobs {config.max_jobs}: a master holds at least one job")
        self.config = config
        # Signs client sessions and worker ids (protocol/capability.py); a journaled master
        # passes the keys kept beside its journal, so replayed sessions' tokens still verify.
        self.keys = keys if keys is not None else MasterKeys.ephemeral()
        self.journal = journal
        self.clock = clock
        self.fleet = FleetState()
        self.runtime: dict[str, JobRuntime] = {}  # job key -> what is not journaled of that job
        self.shares = JobShares()  # which job's split a worker gets next
        self.shared_work = SharedWork()  # which of the jobs' next splits, so that jobs share blocks
        self.rates = RateWindow(config.rate_window_s)
        self.cache = CachePlanner(cache, config.cache_max_bytes, config.popularity_log)
        self.history = History()  # a bounded picture of the run over time (status with history: true)
        self.decision_log: Callable[[], list[dict]] = list  # the autoscaler's recent decisions, for status (set by it)
        # Workers launched and not yet registered (a Ray actor waiting for room, a process
        # starting), for status: not counted among the workers (set by remoteloader-master).
        self.pending_workers: Callable[[], int] = lambda: 0
        self._binding: dict[str, PendingBind] = {}  # spec fingerprint -> its spec being bound
        # Who this master process is: a client that sees it change reports everything it
        # has consumed again (consumption is not journaled).
        self.incarnation = uuid.uuid4().hex[:12]
        if journal is not None:
            replayed = 0
            for update in journal.replay():
                try:
                    self.fleet.apply(update)
                except Exception as e:  # an invalid record must not keep the master from starting
                    journal.quarantine(-1, U.encode(update), repr(e))
                    continue
                replayed += 1
            if replayed:
                log.info("replayed %d journal records", replayed)
        # Journal bytes right after the last compaction (or at start): what has been appended
        # since is what the compaction rule counts.
        self._snapshot_bytes = journal.size if journal is not None else 0
        for key, st in self.fleet.jobs.items():
            self.runtime[key] = JobRuntime(bind_schema(st.job.spec, st.job.schema))
            self._follow(key)
        self._commit(U.MasterStarted(clock()))
        self.sync()

    # -- single-job views: a master of one job (--spec, max_jobs 1), and tests of one --------
    @property
    def state(self) -> JobState:
        """The state of this master's only job (before it has one: the fleet's workers, no job)."""
        jobs = list(self.fleet.jobs.values())
        if len(jobs) > 1:
            raise RuntimeError(f"this master holds {len(jobs)} jobs: read service.fleet")
        return jobs[0] if jobs else self.fleet.registry

    @property
    def bound(self) -> Optional[BoundDataset]:
        """The bound pipeline of this master's only job."""
        job = self.state.job
        return None if job is None else self.runtime[job.key].bound

    @property
    def split_bytes(self) -> Optional[int]:
        job = self.state.job
        return None if job is None else self.runtime[job.key].split_bytes

    def _commit(self, update: U.Update) -> None:
        if self.journal is not None and not U.transient(update):
            self.journal.append(update)  # durable at the next sync, before any reply goes out
        self.fleet.apply(update)
        # After a change of membership, the service decides the partitions again (and
        # journals them): a worker's change, for every job; a client's, for its own.
        if isinstance(update, _MEMBERSHIP):
            jobs = list(self.fleet.jobs)
        elif isinstance(update, U.ForJob) and isinstance(update.update, _MEMBERSHIP):
            jobs = [update.job] if update.job in self.fleet.jobs else []
        else:
            return
        for key in jobs:
            st = self.fleet.jobs[key]
            partitions = st.balanced_partitions(self.config.max_workers_per_client)
            if partitions != st.partitions:
                self._commit(U.ForJob(key, U.PartitionsChanged(sorted(partitions.items()))))

    def sync(self) -> None:
        """Make every committed update durable (one fsync for all of them: the server calls
        this once per pass, before sending that pass's replies), then compact the journal
        once what was appended since the last snapshot outweighs it (and
        ``journal_compact_bytes``): never on the snapshot's own size, which would compact
        a large job's state on every pass."""
        if self.journal is None:
            return
        self.journal.sync()
        appended = self.journal.size - self._snapshot_bytes
        if appended > max(self.config.journal_compact_bytes, self._snapshot_bytes):
            self.journal.compact(self.fleet.snapshot())
            self._snapshot_bytes = self.journal.size

    # -- the job ---------------------------------------------------------------------
    def submit(self, spec: DatasetSpec, name: str = "") -> None:
        """Bind and plan a job (named ``name``: a shared fleet's); raises SpecError naming the
        key or column at fault."""
        self._submit_bound(spec, _bind_and_plan(spec, self.config.buffer_bytes), name)
        self.sync()

    def _submit_bound(self, spec: DatasetSpec, planned: Planned, name: str = "") -> JobState:
        bound, splits = planned.bound, planned.splits
        files = bound.files or []
        fingerprint = spec.fingerprint()
        key = M.job_key(fingerprint, name)
        self._commit(U.ForJob(key, U.JobSubmitted(
            spec, fingerprint, bound.schema, [U.file_record(f) for f in files], [U.SplitRecord.of(s) for s in splits],
            bound.skipped, bound.file_tables, planned.split_rows, name)))
        split_bytes = None if planned.row_bytes is None else int(max(s.rows for s in splits) * planned.row_bytes)
        self.runtime[key] = JobRuntime(bound, planned.row_bytes, split_bytes)
        if self.config.popularity_log:
            # Which columns jobs read together: `remoteloader reorder` stores them together.
            record_projection(self.config.popularity_log, spec.table.path, bound.read_columns)
        st = self.fleet.jobs[key]
        log.info("job %s: %d files, %d splits, %d rows", key, len(files), len(splits), st.job.total_rows)
        self._follow(key)
        return st

    def _follow(self, key: str) -> None:
        """Start re-listing a following job's table (until its stream has ended)."""
        job, runtime = self.fleet.jobs[key].job, self.runtime[key]
        if not job.follows or job.ended:
            return
        # Growths are cut as the job's splits were (journaled: a restarted master has no row size
        # estimate); a journal written before split_rows was: split_rows.
        reported = {e["message"] for e in self.fleet.jobs[key].errors if e["epoch"] < 0}
        runtime.follower = Follower(runtime.bound, job.files, job.splits, job.split_rows or job.spec.split_rows,
                                    reported)

    def close(self, wait_s: float = 2.0) -> None:
        """Stop every follower's re-listing (the master is shutting down); waits at most
        ``wait_s`` in all for listings under way (the threads are daemons: a hung listing
        cannot keep the process alive)."""
        followers = [r.follower for r in self.runtime.values() if r.follower is not None]
        for follower in followers:
            follower.stop()
        deadline = time.monotonic() + wait_s
        for follower in followers:
            follower.join(max(0.0, deadline - time.monotonic()))

    def _take_growths(self) -> None:
        """Commit what the followers listed since the last tick, one journaled update each."""
        for key, runtime in list(self.runtime.items()):
            if runtime.follower is None:
                continue
            for growth in runtime.follower.take():
                self._commit(U.ForJob(key, U.TableGrew(
                    growth.first_file, growth.first_split, [U.file_record(f) for f in growth.files],
                    [U.SplitRecord.of(s) for s in growth.splits], growth.problems, growth.ended)))
                for problem in growth.problems:
                    log.warning("following job %s: %s", key, redact_text(problem))
                if growth.files:
                    log.info("following job %s: %d new files, %d splits, %d rows", key, len(growth.files),
                             len(growth.splits), sum(s.rows for s in growth.splits))
            if self.fleet.jobs[key].job.ended:
                runtime.follower.stop()
                runtime.follower = None

    # -- dispatch ----------------------------------------------------------------------
    def handle(self, request: Union[M.Message, dict]) -> Reply:
        """The reply to one request. A plain map (tests, in-process callers) is checked like
        a received header first."""
        if isinstance(request, dict):
            try:
                request = M.from_fields(request.get("t"), {k: v for k, v in request.items() if k != "t"})
            except msgspec.ValidationError as e:
                return M.Error(message=f"malformed message: {e}", code=ErrorCode.PROTOCOL)
        handler = _HANDLERS.get(type(request))
        if handler is None:
            return M.Error(message=f"the master does not serve {M.tag(request)!r}")
        try:
            return handler(self, request)
        except RequestError as e:
            # Errors name tables; a URI's credentials stay out of what a client is told.
            return M.Error(message=redact_text(str(e)), code=e.code)

    def tick(self) -> None:
        """Periodic duties: dead workers lose their splits, hung workers the split they hold."""
        now = self.clock()
        self._take_growths()
        self.rates.forget({"w:" + w for w in self.fleet.workers} | {"c:" + c for c in self.fleet.session_job})
        for w in list(self.fleet.workers.values()):
            if w.last_seen < now - self.config.heartbeat_timeout:
                log.warning("worker %s (%s) missed heartbeats for %.1f s: presumed dead",
                            w.worker_id, w.addr, now - w.last_seen)
                self._commit(U.WorkerLost(w.worker_id, "heartbeat timeout"))
        for key, st in list(self.fleet.jobs.items()):
            for session, seen in list(st.client_seen.items()):
                if seen < now - self.config.client_timeout:
                    log.warning("client %s (job %s, rank %d) silent for %.0f s: forgotten", session, key,
                                st.clients[session], now - seen)
                    self._commit(U.ForJob(key, U.ClientLeft(session, "client timeout")))
            for epoch, split_id, worker_id, reason in st.stalled_splits(
                    now, self.config.heartbeat_interval, self.config.split_timeout):
                log.warning("worker %s: split %d of epoch %d of job %s revoked: %s", worker_id, split_id, epoch,
                            key, reason)
                self._commit(U.ForJob(key, U.SplitRevoked(epoch, split_id, worker_id, reason)))
        # The auto cache policy, each job's own (its costs, its plan, its check).
        for key, st in list(self.fleet.jobs.items()):
            plan = self.cache.decide(st, self.runtime[key].bound, lambda: self.rates.group_totals().get("w", {}), now)
            if plan is not None:
                self._commit(U.ForJob(key, plan))
        if self.history.due(now):
            self._sample_history(now)

    def _sample_history(self, now: float) -> None:
        """One sample of the run for ``history`` (once a second, from the tick)."""
        rates, jobs = self.rates, list(self.fleet.jobs.values())
        workers = list(self.fleet.workers.values())
        stall: dict[int, float] = {}  # by rank: with several jobs, the most stalled of each rank
        client_rows, reported = 0.0, False
        for st in jobs:
            for cid, rank in st.clients.items():
                stall[rank] = max(stall.get(rank, 0.0), self.client_stall(cid))
                if "rows" in st.client_stats.get(cid, {}):
                    client_rows, reported = client_rows + rates.rate("c:" + cid, "rows"), True
        totals = rates.group_totals().get("w", {})
        self.history.record(
            now, workers=len(workers), draining=sum(1 for w in workers if w.draining), pending=self.pending_workers(),
            held_bytes=float(sum(w.stats.get("held_bytes", 0) or 0 for w in workers)),
            budget_bytes=float(sum(w.stats.get("budget_bytes", 0) or 0 for w in workers)),
            rows_per_s=sum(rates.rate("w:" + w.worker_id, "rows") for w in workers),
            client_rows_per_s=client_rows if reported else None, stall=stall,
            epoch=max((run.epoch for st in jobs for run in st.ranks.values()), default=None),
            cache_hits=totals.get("cache.hits", 0.0), cache_misses=totals.get("cache.misses", 0.0))
        self.history.decisions(now, self.decision_log())

    def _job(self, key: str) -> tuple[str, JobState]:
        """The job a worker's request names (``""``: the oldest, as a worker of one job says)."""
        if not key and self.fleet.jobs:
            key = next(iter(self.fleet.jobs))
        st = self.fleet.jobs.get(key)
        if st is None:
            if not self.fleet.jobs:
                raise RequestError("no job yet: the master waits for the first client's spec", code=ErrorCode.NO_JOB)
            raise RequestError(f"this master holds no job {key[:80]} (it ended)", code=ErrorCode.NO_JOB)
        return key, st

    def _require_worker(self, m: M.WorkerNamed) -> None:
        """The sender is the worker it names: registered, and holding its ``registered.token``
        (a member who read a worker id in ``status`` cannot drain it or take its splits)."""
        if not self._is_worker(m):
            raise RequestError(f"unknown worker {m.worker_id[:80]}", code=ErrorCode.UNKNOWN_WORKER)

    def _is_worker(self, m: M.WorkerNamed) -> bool:
        return m.worker_id in self.fleet.workers and self.keys.worker_token_ok(m.worker_id, m.token)

    def _require_client(self, session: str) -> tuple[str, JobState, int]:
        """(job key, its state, rank) of a live client session."""
        key = self.fleet.session_job.get(session)
        if key is None:
            if any(session in st.replaced for st in self.fleet.jobs.values()):
                raise RequestError("another loader took this rank over (a new process of the rank, or another loader "
                                   "of the same job: the same spec, job name and world size on this master)",
                                   code=ErrorCode.REPLACED)
            raise RequestError(f"unknown client session {session[:80]}; say hello again",
                               code=ErrorCode.UNKNOWN_CLIENT)
        st = self.fleet.jobs[key]
        return key, st, st.clients[session]

    # -- workers ----------------------------------------------------------------------
    def _on_register(self, m: M.Register) -> Reply:
        if len(self.fleet.workers) >= self.config.max_workers:
            raise RequestError(f"the master already has {len(self.fleet.workers)} workers (max_workers)",
                               code=ErrorCode.FULL)
        self._check_worker_addr(m.addr)
        # A master of one job takes only workers compiled for it; a shared fleet's workers
        # compile each job's pipeline as they get its first split (they name any).
        job = self.state.job if self.config.max_jobs == 1 else None
        if job is not None and m.fingerprint != job.key:
            # A worker still compiled for a job this master no longer serves (a master
            # restarted on the same address with another spec): it fetches the spec again.
            raise RequestError(f"this master serves job {job.key}, not {m.fingerprint[:80]}",
                               code=ErrorCode.WRONG_JOB)
        worker_id = "w-" + uuid.uuid4().hex[:10]
        self._commit(U.WorkerRegistered(worker_id, m.addr, m.pid, self.clock(), m.key, m.node, m.arena))
        log.info("worker %s registered from %s (pid %d%s)", worker_id, m.addr, m.pid,
                 f", node {m.node}" if m.node else "")
        # Split tasks name the job too: a worker that registered before one existed checks each.
        return M.Registered(worker_id=worker_id, heartbeat_interval=self.config.heartbeat_interval,
                            fingerprint=m.fingerprint if job is None else job.key,
                            token=self.keys.worker_token(worker_id), verify_key=self.keys.verify_key,
                            max_jobs=self.config.max_jobs)

    def _check_worker_addr(self, addr: str) -> None:
        """An address every client can connect to: a concrete host (not ``*``, not an
        any-address) and a port in 1..65535; or an ipc socket in this master's own private
        directory (``remoteloader-master --bind ipc://DIR/NAME``), so that a worker cannot
        point clients at an arbitrary socket path. A bind-only address would make every
        client's connect fail."""
        try:
            validate_address(addr)
        except AddressError as e:
            raise RequestError(f"register: {e}") from None
        if addr.startswith("ipc://"):
            ipc_dir = self.config.ipc_dir
            if ipc_dir is None or addr[len("ipc://"):].rpartition("/")[0] != ipc_dir:  # validated: normalized
                where = f"its private directory {ipc_dir}" if ipc_dir else "none: it listens on tcp"
                raise RequestError(f"register: ipc address {addr[:160]!r} is not in this master's private ipc "
                                   f"directory ({where})")
            return
        host = addr[len("tcp://"):].rpartition(":")[0]
        if host in ("0.0.0.0", "[::]", "[0:0:0:0:0:0:0:0]") or len(addr) > 256:
            raise RequestError(f"register: addr {addr[:80]!r} is not one clients can connect to "
                               "(a concrete host, e.g. the worker's IP)")

    def _on_get_spec(self, m: M.GetSpec) -> Reply:
        key, st = self._job(m.fingerprint)
        job = st.job
        return M.Spec(spec=job.spec.to_dict(), schema=job.schema, fingerprint=job.key,
                      split_bytes=self.runtime[key].split_bytes)

    def _on_heartbeat(self, m: M.Heartbeat) -> Reply:
        def beat(state: M.WorkerState, sessions: list[str]) -> M.HeartbeatOk:
            return M.HeartbeatOk(state=state, sessions=sessions, master=self.incarnation)

        w = self.fleet.workers.get(m.worker_id)
        if w is None or not self._is_worker(m):
            return beat(M.WorkerState.UNKNOWN, [])
        stats = msgspec.to_builtins(m.stats) if m.stats is not None else {}
        self._commit(U.WorkerHeartbeat(m.worker_id, self.clock(), m.buffered, stats))
        self.rates.update("w:" + m.worker_id, self.clock(), stats)
        self.cache.observe(m.worker_id, stats, self.fleet.jobs)
        # The live sessions of the ranks it serves, of every job: pieces it holds for any other are stale.
        jobs = list(self.fleet.jobs.values())
        sessions = [session for st in jobs for session in st.sessions_served(m.worker_id)]
        if not w.draining:
            return beat(M.WorkerState.RUN, sessions)
        if any(st.workers[m.worker_id].assigned for st in jobs):
            return beat(M.WorkerState.DRAIN, sessions)
        # Drained: every split it held has been consumed; it may go.
        self._commit(U.WorkerLost(w.worker_id, "drained"))
        return beat(M.WorkerState.STOP, sessions)

    def _on_drain(self, m: M.Drain) -> Reply:
        # Only the worker itself (SIGTERM) or the autoscaler (``drain``, in process) drains it.
        self._require_worker(m)
        self.drain(m.worker_id)
        return M.Ok()

    def drain(self, worker_id: str) -> None:
        """Stop giving this worker splits; it exits once its buffered splits are consumed."""
        if not self.fleet.workers[worker_id].draining:
            log.info("worker %s draining", worker_id)
            self._commit(U.WorkerDraining(worker_id))
            # A next epoch's split read ahead would keep it waiting for a trainer that may
            # never start that epoch: it goes back to the queue, produced again when needed.
            for key, st in self.fleet.jobs.items():
                for epoch, split_id in st.splits_ahead(worker_id):
                    self._commit(U.ForJob(key, U.SplitRevoked(epoch, split_id, worker_id,
                                                                      "its worker is draining")))

    def _on_bye(self, m: M.Bye) -> Reply:
        if self._is_worker(m):
            self._commit(U.WorkerLost(m.worker_id, "left"))
        return M.Ok()

    def _on_get_split(self, m: M.GetSplit) -> Reply:
        self._require_worker(m)
        if len(m.avoid_ranks) > self.config.max_world_size:
            raise RequestError("avoid_ranks must be a list of ranks")
        jobs = self.fleet.jobs
        # Ranks whose share of the worker's buffer is full: named by rank (a worker of one
        # job), or by session (a shared fleet's worker: ranks of several jobs share numbers).
        avoid = {key: frozenset(m.avoid_ranks) | {st.clients[s] for s in m.avoid_sessions if s in st.clients}
                 for key, st in jobs.items()}
        order = self.shares.order({key: _weight(st) for key, st in jobs.items()})
        choices = [(key, choice) for key in order
                   if (choice := jobs[key].choose_split(m.worker_id, avoid[key], ahead=False)) is not None]
        picked = self._share_work(m.worker_id, choices) if choices and len(jobs) > 1 else 0
        if picked is None:
            return M.NoSplit(retry_ms=self.config.no_split_retry_ms,
                             reason="waiting for a split another job is producing with the same blocks")
        key, choice = choices[picked] if choices else ("", None)
        passed_over = [key for key, _ in choices[:picked]]  # their splits were left to the workers holding their blocks
        # A worker with no current work reads ahead into the next epoch, one split at a
        # time and only when it says it has room for one (`read_ahead`: within its byte
        # budget, leaving a split's room for current work): those pieces wait in its
        # buffer, outside the trainers' credit, until the trainer gets there.
        if (choice is None and m.read_ahead and self.config.prefetch_next_epoch
                and not any(st.splits_ahead(m.worker_id) for st in jobs.values())):
            for key in order:
                self._open_window_ahead(key, jobs[key])
                for prefetch in jobs[key].prefetch_candidates(m.worker_id):
                    self._commit(U.ForJob(key, prefetch))
                choice = jobs[key].choose_split(m.worker_id, avoid[key])
                if choice is not None:
                    break
        if choice is None:
            return M.NoSplit(retry_ms=self.config.no_split_retry_ms, reason="no pending split for this worker")
        run, progress = choice
        s = progress.split
        st = jobs[key]
        self._commit(U.ForJob(key, U.SplitAssigned(run.epoch, s.id, m.worker_id, self.clock())))
        self.shares.served(key, s.rows, behind=passed_over)
        job = st.job
        if len(jobs) > 1:
            self.shared_work.handed(key, split_identity(job.files, job.splits[s.base], job.spec.sampling),
                                    m.worker_id, run.epoch, s.id, self.clock())
        cycle = job.spec.cycle
        task = make_task(job.files, job.splits[s.base], s, run.epoch, skip=progress.consumed, session=run.session,
                         seq=run.seq, fingerprint=job.key,
                         cache=self.cache.directive(st, self.runtime[key].bound),
                         order=None if cycle is None else split_order(progress.position, cycle, s.padding),
                         lane=progress.lane)
        return M.Split(split=task.to_wire())

    def _share_work(self, worker_id: str, choices: list) -> Optional[int]:
        """Which of the jobs' next splits (``choices``, in fair-share order) this worker
        produces, so that two jobs' splits of one base split meet on one worker
        (master/shared_work.py); None: it waits a moment for one in flight elsewhere."""
        candidates = []
        for key, (_, progress) in choices:
            st, s = self.fleet.jobs[key], progress.split
            if key not in self.shared_work.jobs:
                self.shared_work.add_job(key, job_block_keys(self.runtime[key].bound))
            candidates.append(Candidate(key, split_identity(st.job.files, st.job.splits[s.base],
                                                                    st.job.spec.sampling),
                                        st.partitions.get(s.rank, ())))
        workers = self.fleet.workers
        return self.shared_work.pick(worker_id, candidates, self.clock(),
                                     lambda w: w in workers and not workers[w].draining)

    def _on_split_produced(self, m: M.SplitProduced) -> Reply:
        key = self._holder_job(m)
        if key is not None:
            self._commit(U.ForJob(key, U.SplitProduced(m.epoch, m.split_id, m.worker_id)))
            self.shared_work.produced(key, m.epoch, m.split_id)
        return M.Ok()

    def _on_split_failed(self, m: M.SplitFailed) -> Reply:
        key = self._holder_job(m)
        if key is not None:
            skipped = self.fleet.jobs[key].job.spec.on_error == "skip"
            log.error("split %d of job %s failed%s: %s", m.split_id, key, " (skipped)" if skipped else "",
                      m.error)
            self._commit(U.ForJob(key, U.SplitFailed(m.epoch, m.split_id, m.worker_id, m.error, skipped)))
        return M.Ok()

    def _on_splits_released(self, m: M.SplitsReleased) -> Reply:
        """The worker gives splits back: their rank went silent (its pieces were dropped) or
        its share of the worker's buffer is full while other ranks starve. They are handed
        out again from what the rank consumed, as after a worker failure."""
        self._require_worker(m)
        for ref in m.splits:
            key = self._holding(m.worker_id, m.job, ref.epoch, ref.split_id)
            if key is not None:
                self._commit(U.ForJob(key, U.SplitRevoked(ref.epoch, ref.split_id, m.worker_id,
                                                                  f"released: {m.reason[:200]}")))
        return M.Ok()

    def _holder_job(self, m: Union[M.SplitProduced, M.SplitFailed]) -> Optional[str]:
        """The job whose split the reporting worker still holds; None if it was re-assigned
        meanwhile (the worker was presumed dead, or the rank restarted): the report is stale."""
        self._require_worker(m)
        return self._holding(m.worker_id, m.job, m.epoch, m.split_id)

    def _holding(self, worker_id: str, job: str, epoch: int, split_id: int) -> Optional[str]:
        """``job`` (``""``, from a worker of one job: the oldest) if ``worker_id`` holds that split of it."""
        if not job and self.fleet.jobs:
            job = next(iter(self.fleet.jobs))
        st = self.fleet.jobs.get(job)
        return job if st is not None and (epoch, split_id) in st.workers[worker_id].assigned else None

    # -- clients ------------------------------------------------------------------------
    def _on_hello(self, m: M.Hello) -> Reply:
        key, st = self._hello_job(m)
        job = st.job
        if m.world_size > self.config.max_world_size:
            raise RequestError(f"world size {m.world_size} is above the master's maximum "
                               f"{self.config.max_world_size}", code=ErrorCode.BAD_RANK)
        if not m.rank < m.world_size:
            raise RequestError(f"rank {m.rank} is outside world size {m.world_size}", code=ErrorCode.BAD_RANK)
        if job.world_size is not None and m.world_size != job.world_size:
            raise RequestError(self._busy_message(st, m.world_size), code=ErrorCode.BUSY)
        session = "s-" + uuid.uuid4().hex[:12]
        self._commit(U.ForJob(key, U.ClientJoined(session, m.rank, m.world_size, self.clock(), m.node)))
        shares = st.shares()
        bound = self.runtime[key].bound
        # The token is what lets this client's credit take the session's pieces at workers;
        # the session id alone (which status shows) does not.
        # It signs the session's public key too: a token seen on the wire is no use with another key.
        return M.Welcome(session=session, token=self.keys.session_token(session, m.key), job=M.JobInfo(
            fingerprint=job.fingerprint, total_rows=job.total_rows,
            rank_rows=shares.rows[m.rank] + shares.padding[m.rank], dropped_rows=shares.dropped,
            world_size=job.world_size, sparse_keys=list(bound.sparse_keys),
            sparse_scored=list(bound.pipeline.sparse_scored), plan=job.plan_fingerprint,
            dense_width=bound.pipeline.dense_width))

    def _hello_job(self, m: M.Hello) -> tuple[str, JobState]:
        """The job a hello joins: the one of its spec and name, or (while there is room) a new
        one, whose spec is bound first. A master of one job (``--spec``, ``--max-jobs 1``, the
        embedded one) serves its job whatever the name, and refuses every other spec."""
        jobs = self.fleet.jobs
        name = m.job if self.config.max_jobs > 1 else ""
        st = jobs.get(M.job_key(m.fingerprint, name))
        if st is None:
            if self.config.max_jobs == 1 and jobs:
                self._spec_mismatch(m, self.state)
            st = self._bind_new_job(m.spec, name)
        if m.fingerprint != st.job.fingerprint:  # the loader's and the master's fingerprints of one spec
            self._spec_mismatch(m, st)
        return st.job.key, st

    def _spec_mismatch(self, m: M.Hello, st: JobState) -> None:
        job = st.job
        differs = "; ".join(spec_differences(m.spec, job.spec.to_dict())) or "a key"
        raise RequestError(
            f"spec fingerprint {m.fingerprint[:80]} differs from the running job's {job.fingerprint} in "
            f"{differs} (here: this loader, there: the running job): this master serves another dataset "
            "spec (start another master, or use the same spec)", code=ErrorCode.SPEC_MISMATCH)

    def _busy_message(self, st: JobState, world_size: int) -> str:
        """Why a client of another world size cannot join the job of its spec now: its live clients."""
        now = self.clock()
        last = max(st.client_seen.values(), default=now)
        return (f"world size {world_size}: this master is serving a job of world size {st.job.world_size} "
                f"({len(st.clients)} live client{'s' if len(st.clients) != 1 else ''}, last heard {now - last:.0f} s "
                f"ago); it takes another world size once they have closed their loaders, or after "
                f"{self.config.client_timeout:g} s of silence (remoteloader-master --client-timeout)")

    def _bind_new_job(self, spec_dict: dict, name: str) -> JobState:
        """A new job of this spec and name. Binding lists files and reads footers, maybe from an
        object store: it runs on its own thread, so the loop keeps answering everybody else
        (the other jobs' clients and workers included); hellos meanwhile hear ``binding``
        (retry) until it is done or past ``bind_timeout``. A spec that fails to bind fails
        only its own loader."""
        try:
            spec = DatasetSpec.from_dict(spec_dict)
        except SpecError as e:
            raise RequestError(str(e), code=ErrorCode.BAD_SPEC) from None
        fingerprint = spec.fingerprint()
        pending = self._binding.get(fingerprint)
        if pending is None:
            allowlist = TableAllowlist(self.config.allowed_tables)
            for key, path in spec.table_paths:  # every table of a mix
                if not allowlist.allows(path):
                    # Says nothing of whether the path exists: that would be an oracle.
                    raise RequestError(f"{key}: this master does not serve that table (see --allow-table)",
                                       code=ErrorCode.BAD_SPEC)
            self._check_room()
            if len(self._binding) >= self.config.max_jobs:  # a flood of specs is refused, not absorbed
                raise RequestError(f"the master is binding {len(self._binding)} other specs; retry",
                                   code=ErrorCode.BINDING)
            pending = self._binding[fingerprint] = PendingBind(spec, time.monotonic(), self.config.buffer_bytes)
        pending.done.wait(BIND_WAIT_S)  # a small table binds within this request
        if not pending.done.is_set():
            if time.monotonic() - pending.started < self.config.bind_timeout:
                raise RequestError("the master is binding the spec to the table; retry", code=ErrorCode.BINDING)
            del self._binding[fingerprint]
            raise RequestError(f"table.path: reading the table's metadata took longer than "
                               f"{self.config.bind_timeout:g} s", code=ErrorCode.BAD_SPEC)
        del self._binding[fingerprint]
        if pending.error is not None:
            raise RequestError(str(pending.error), code=ErrorCode.BAD_SPEC)
        key = M.job_key(fingerprint, name)
        if key in self.fleet.jobs:  # bound twice over (another hello of the job got there first)
            return self.fleet.jobs[key]
        self._check_room(end_idle=True)
        return self._submit_bound(pending.spec, pending.result, name)

    def _check_room(self, end_idle: bool = False) -> None:
        """Room for one more job: below ``max_jobs``, or (``end_idle``: by ending it) a job
        whose loaders all left, the oldest such; else refused, naming the setting."""
        jobs = self.fleet.jobs
        if len(jobs) < self.config.max_jobs:
            return
        idle = [key for key, st in jobs.items() if not st.clients]
        if not idle:
            raise RequestError(f"this master already serves {len(jobs)} live jobs, its most "
                               f"(remoteloader-master --max-jobs {self.config.max_jobs}): retry once one ends, "
                               "or start the master with a larger --max-jobs", code=ErrorCode.FULL)
        if end_idle:
            log.info("job %s ends: its loaders left, and a new job needs its place", idle[0])
            self._commit(U.JobEnded(idle[0], "its loaders left, and a new job needed its place"))
            if self.runtime[idle[0]].follower is not None:
                self.runtime[idle[0]].follower.stop()
            del self.runtime[idle[0]]
            self.shares.forget(idle[0])
            self.shared_work.forget(idle[0])
            self.cache.forget(idle[0])
            self.rates.drop_groups(lambda group: group.endswith(":" + idle[0]))  # its ranks' metrics series

    def _on_start_epoch(self, m: M.StartEpoch) -> Reply:
        session = m.session
        key, st, rank = self._require_client(session)
        epoch = m.epoch
        if not epoch < self.config.max_epoch:
            raise RequestError(f"epoch {epoch} is outside [0, {self.config.max_epoch})", code=ErrorCode.BAD_EPOCH)
        consumed = _acks(m.consumed)
        if st.job.follows and epoch not in st.job.windows:
            try:
                self._open_window(key, st, epoch)
            except RequestError as e:
                if e.code == ErrorCode.WAITING:  # a rank waiting for data is alive: not forgotten meanwhile
                    stats = {k: v for k, v in st.client_stats.get(session, {}).items() if k != "time"}
                    self._commit(U.ForJob(key, U.ClientHeartbeat(session, self.clock(), stats)))
                raise
        done = self._check_done(st, m.done)
        current = st.ranks.get(rank)
        if done and current is not None and epoch > current.epoch + 1:
            # A resume continues the epoch a checkpoint was taken in: the rank's current one,
            # the next, or an earlier one; never a far-off epoch nobody is in.
            raise RequestError(f"done (rows consumed before a resume) for epoch {epoch}, but rank {rank} is in "
                               f"epoch {current.epoch}", code=ErrorCode.BAD_EPOCH)
        if done != _done_of(st.resumed.get(epoch)):
            if st.epoch_started(epoch):
                raise RequestError(f"epoch {epoch} already started with other rows consumed before the resume: "
                                   "every rank must load the same checkpoint", code=ErrorCode.RESUME_MISMATCH)
            self._commit(U.ForJob(key, U.EpochResumed(epoch, done)))
        ahead = st.prefetched.get(rank)
        if ahead is not None and (ahead.session, ahead.epoch) == (session, epoch):
            seq = ahead.seq  # the run workers started early: its pieces are this epoch's
        else:
            seq = st.next_seq[session]
        self._commit(U.ForJob(key, U.EpochStarted(rank, epoch, session, seq)))
        consumed = self._current_acks(st, rank, seq, consumed)
        if consumed:  # a resumed client: what it consumed before is not produced again
            self._commit(U.ForJob(key, U.SplitsConsumed(rank, seq, consumed)))
        splits = [M.EpochSplitInfo(p.split.id, p.split.rows, p.split.base, p.split.row_lo, p.split.padding,
                                   None if p.split.lane is None else list(p.split.lane),
                                   None if p.split.table is None else list(p.split.table))
                  for p in st.epoch_splits(rank, epoch)]
        return M.Epoch(epoch=epoch, seq=seq, splits=splits)

    def _open_window(self, key: str, st: JobState, epoch: int) -> None:
        """The first start of a following job's epoch fixes its window: the base splits
        added since the window before (every rank's run of the epoch then plans the same
        rows). With nothing new yet, the client is told to wait (``waiting``: it retries)
        unless the stream has ended, whose windows from then on are empty."""
        job = st.job
        if epoch > 0 and epoch - 1 not in job.windows:
            raise RequestError(f"epoch {epoch}: a following job reads its windows in order, and epoch {epoch - 1} "
                               "has not started", code=ErrorCode.BAD_EPOCH)
        lo = job.windows[epoch - 1][1] if epoch > 0 else 0
        if lo == len(job.splits) and not job.ended:
            raise RequestError(f"epoch {epoch}: no new data in table {redact(job.spec.table.path)} since the "
                               f"window before; waiting for it to grow (listed every {job.spec.table.follow['every']:g} s)",
                               code=ErrorCode.WAITING)
        self._commit(U.ForJob(key, U.WindowOpened(epoch, lo, len(job.splits))))

    def _open_window_ahead(self, key: str, st: JobState) -> None:
        """A following job's next window, opened early once a rank has nothing left to hand
        out of the last one and there is new data, so that workers read ahead into it as into
        a fixed table's next epoch (the window is then fixed here, not at its first start:
        what lands meanwhile is the window after's)."""
        job = st.job
        if not job.follows or not job.windows:
            return
        last = max(job.windows)
        lo = job.windows[last][1]
        if lo < len(job.splits) and any(r.epoch == last and not r.pending and r.session in st.clients
                                        for r in st.ranks.values()):
            self._commit(U.ForJob(key, U.WindowOpened(last + 1, lo, len(job.splits))))

    def _check_done(self, st: JobState, done: list[M.DoneRange]) -> list:
        """Rows consumed before an elastic resume, disjoint and coalesced (adjacent ranges
        merged), as ``[[base split, lo, hi], ...]`` (a mix of tables: ``[rows key, lo, hi]``,
        ``core.mix.rows_key``). A checkpoint's consumed rows are prefixes of the epoch's splits,
        a few per base split: more ranges than that is not a checkpoint. (Their shape was
        checked at decode; here, whether they fit the job.)"""
        splits = st.job.splits
        # A lane boundary cuts a base split as a rank boundary does (mix_splits): so many more.
        most = MAX_DONE_RANGES * st.job.spec.mix_splits
        # A mix of tables names a restarted table's later passes' rows by base split and pass.
        passes = MAX_PASSES if st.job.spec.tables else 1
        merged: list[list[int]] = []
        per_key: dict[int, int] = {}
        for key, lo, hi in sorted((d.base_split, d.lo, d.hi) for d in done):
            base, pass_ = base_and_pass(key)
            where = f"base split {base}" + (f" in pass {pass_}" if pass_ else "")
            if not (base < len(splits) and pass_ < passes and lo < hi <= splits[base].rows):
                raise RequestError(f"done: rows [{lo}, {hi}) of {where} do not exist in this job")
            if merged and merged[-1][0] == key and merged[-1][2] > lo:
                raise RequestError(f"done: overlapping row ranges in {where}")
            if merged and merged[-1][0] == key and merged[-1][2] == lo:
                merged[-1][2] = hi
                continue
            per_key[key] = per_key.get(key, 0) + 1
            if per_key[key] > most:
                raise RequestError(f"done: more than {most} row ranges in {where}: a "
                                   "checkpoint's consumed rows are prefixes of the epoch's splits")
            merged.append([key, lo, hi])
        return merged

    def _on_client_heartbeat(self, m: M.ClientHeartbeat) -> Reply:
        session = m.session
        key, st, rank = self._require_client(session)
        acks = self._current_acks(st, rank, m.seq, _acks(m.acks))
        if acks:
            self._commit(U.ForJob(key, U.SplitsConsumed(rank, m.seq, acks)))
        stats = msgspec.to_builtins(m.stats) if m.stats is not None else {}
        self._commit(U.ForJob(key, U.ClientHeartbeat(session, self.clock(), stats)))
        self.rates.update("c:" + session, self.clock(), stats)
        # Worker keys reach clients only here, over the authenticated control channel.
        workers = [M.WorkerAddr(wid, w.addr, w.key, w.arena)
                   for wid in st.partitions.get(rank, []) for w in (st.workers[wid],)]
        run = st.ranks.get(rank)
        errors = st.errors_for(rank, run.epoch) if run is not None and run.seq == m.seq else []
        holders = []
        if run is not None and run.seq == m.seq and st.job.spec.splits_in_flight is not None:
            holders = [M.SplitHolder(sid, worker) for sid in sorted(run.in_flight)
                       if (worker := run.splits[sid].worker) is not None]
        return M.Membership(workers=workers, errors=[msgspec.convert(e, M.SplitError, from_attributes=True)
                                                     for e in errors], master=self.incarnation, holders=holders)

    def _on_finish_epoch(self, m: M.FinishEpoch) -> Reply:
        key, st, rank = self._require_client(m.session)
        current = st.ranks.get(rank)
        if current is None or current.seq != m.seq:
            raise RequestError(f"rank {rank} is not in epoch run {m.seq}", code=ErrorCode.BAD_EPOCH)
        self._commit(U.ForJob(key, U.EpochFinished(rank, m.seq)))
        return M.Ok()

    def _on_goodbye(self, m: M.Goodbye) -> Reply:
        """The client closed its loader: its session ends now, not after the client timeout."""
        key = self.fleet.session_job.get(m.session)
        if key is not None:
            self._commit(U.ForJob(key, U.ClientLeft(m.session, "goodbye")))
        return M.Ok()

    def _current_acks(self, st: JobState, rank: int, seq: int,
                      acks: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Acks for splits of the rank's current run; others are stale (a run changed under
        a heartbeat in flight) and are not journaled."""
        current = st.ranks.get(rank)
        if current is None or current.seq != seq:
            return []
        return [a for a in acks if a[0] in current.splits]

    def _on_status(self, m: M.Status) -> Reply:
        return M.StatusReply(status=self.status(history=m.history))

    def client_stall(self, session: str) -> float:
        """Share of the window the client's training loop spent waiting for batches, the
        wait for an epoch's first batch included (a rank stuck at an epoch's start stalls)."""
        key = "c:" + session
        return min(1.0, self.rates.rate(key, "wait_s") + self.rates.rate(key, "epoch_start_s"))

    def client_starved(self, client_id: str) -> Optional[float]:
        """Share of the window the client waited while no worker held a batch for it; None
        for a client that does not report it (older clients)."""
        st = self.fleet.job_of(client_id)
        if st is None or "starved_s" not in st.client_stats.get(client_id, {}):
            return None
        return min(1.0, self.rates.rate("c:" + client_id, "starved_s"))

    def worker_busy(self, worker_id: str) -> Optional[float]:
        """Share of the window the worker spent producing (reading, transforming, cutting);
        None for a worker that does not report ``busy_s``. What ``status`` shows as ``busy``
        and the autoscaler scales down on."""
        worker = self.fleet.workers.get(worker_id)
        if worker is None or "busy_s" not in worker.stats:
            return None
        return min(1.0, self.rates.rate("w:" + worker_id, "busy_s"))

    @staticmethod
    def _mix_status(st: JobState) -> dict:
        """A mix of tables: each table's weight, rows a batch, and the realised mix, the rows of
        each the ranks consumed in their current epochs and their share of all of them."""
        spec = st.job.spec
        read = st.rows_read_by_table()
        shares = weighted_shares(spec.batch_size, [t.weight for t in spec.tables])
        return {"epochs": sorted({r.epoch for r in st.ranks.values()}),
                "tables": [{"path": redact(t.table.path), "weight": t.weight, "when_done": t.when_done,
                            "rows_per_batch": share, "rows_read": n, "share_read": round(n / max(1, sum(read)), 4)}
                           for t, share, n in zip(spec.tables, shares, read)]}

    def status(self, history: bool = False) -> dict:
        """What ``remoteloader status --json`` prints; with ``history``, the run over time too.
        ``job`` and ``ranks`` are the oldest job's (a master of one job: its job), and with
        several jobs ``job.oldest_of`` says how many there are; ``jobs`` lists every job,
        ``clients`` and ``errors`` hold every job's, each naming its job."""
        jobs, now = self.fleet.jobs, self.clock()
        first = next(iter(jobs.values()), self.fleet.registry)
        job = first.job
        ranks = {}
        for rank, re in sorted(first.ranks.items()):
            done = sum(1 for p in re.splits.values() if p.done)
            ranks[str(rank)] = {"epoch": re.epoch, "session": re.session, "seq": re.seq, "splits": len(re.splits), "done": done,
                                "pending": len(re.pending), "finished": re.finished}
        assigned = {wid: sum(len(st.workers[wid].assigned) for st in jobs.values()) for wid in self.fleet.workers}
        return {
            # Redacted: any key holder may ask for the status (and it ends up in logs and tickets).
            "job": None if job is None else {"fingerprint": job.fingerprint, "key": job.key,
                                             **({"name": job.name} if job.name else {}),
                                             "table": redact(job.spec.table.path),
                                             "files": len(job.files), "splits": len(job.splits),
                                             "rows": job.total_rows, "world_size": job.world_size,
                                             "split_bytes": self.runtime[job.key].split_bytes,
                                             **({"mix": self._mix_status(first)} if job.spec.tables else {}),
                                             # A shared fleet: this is one of several (an operator reading
                                             # the top level must not take it for the whole fleet's work).
                                             **({"oldest_of": len(jobs)} if len(jobs) > 1 else {})},
            "jobs": self._jobs_status(),
            "max_jobs": self.config.max_jobs,
            # Per worker, from its last heartbeat: held_bytes / ahead_bytes / budget_bytes
            # (what it holds), and busy, its share of the rate window spent producing.
            "workers": [{"id": w.worker_id, "addr": w.addr, "pid": w.pid, **({"node": w.node} if w.node else {}),
                         "buffered": w.buffered,
                         "assigned": assigned[w.worker_id], "draining": w.draining,
                         "last_seen_s": round(now - w.last_seen, 3),
                         **{k: v for k, v in w.stats.items() if k != "costs"},  # costs: the cache policy's input
                         "rows_per_s": round(self.rates.rate("w:" + w.worker_id, "rows"), 1),
                         "busy": round(self.worker_busy(w.worker_id) or 0.0, 4)}
                        for w in sorted(self.fleet.workers.values(), key=lambda w: w.seq)],
            "clients": [{"id": cid, "rank": rank, **({"job": key} if len(jobs) > 1 else {}),
                         **({"node": st.rank_node[rank]} if st.rank_node.get(rank) else {}),
                         **st.client_stats.get(cid, {}),
                         "stall": round(self.client_stall(cid), 4),
                         "starved": round(self.client_starved(cid) or 0.0, 4),
                         "batches_per_s": round(self.rates.rate("c:" + cid, "batches"), 2)}
                        for key, st in jobs.items() for cid, rank in st.clients.items()],
            "pending_workers": self.pending_workers(),
            "autoscaler": self.decision_log(),
            # Where the block cache is, its counters, and the auto policy's decisions with their
            # reasons (a shared fleet's: each job's, under `jobs`).
            "cache": self.cache.status([(st, self.runtime[key].bound) for key, st in jobs.items()],
                                       self.rates.group_totals().get("w", {})),
            # Work shared between jobs (a shared fleet): the master's co-scheduling choices, and
            # the blocks workers computed for one job and another took from their memo.
            "shared_work": dict(self.shared_work.counters.to_dict(), **{
                k[7:]: v for k, v in sorted(self.rates.group_totals().get("w", {}).items())
                if k.startswith("shared.")}) if len(jobs) > 1 or self.shared_work.jobs else None,
            "ranks": ranks,
            # They name files: redacted.
            "errors": [dict(e, message=redact_text(e["message"]), **({"job": key} if len(jobs) > 1 else {}))
                       for key, st in jobs.items() for e in st.errors[-20:]][-20 * max(1, len(jobs)):],
            **({"history": self.history.to_dict()} if history else {}),
        }

    def _jobs_status(self) -> list[dict]:
        """A line per job: its spec, world size, progress through its current epoch, what
        its trainers consume (rows/s, and its share of all jobs' consumption), and its stall."""
        rows = {key: sum(self.rates.rate("c:" + cid, "rows") for cid in st.clients) for key, st in self.fleet.jobs.items()}
        total = sum(rows.values())
        out = []
        for key, st in self.fleet.jobs.items():
            runs = list(st.ranks.values())
            splits = sum(len(r.splits) for r in runs)
            done = sum(1 for r in runs for p in r.splits.values() if p.done)
            out.append({"job": key, "fingerprint": st.job.fingerprint, **({"name": st.job.name} if st.job.name else {}),
                        "table": redact(st.job.spec.table.path),
                        "world_size": st.job.world_size, "clients": len(st.clients),
                        "epoch": max((r.epoch for r in runs), default=None),
                        "progress": round(done / splits, 4) if splits else None,
                        "rows_per_s": round(rows[key], 1), "share": round(rows[key] / total, 4) if total else None,
                        "weight": st.job.spec.share_weight, "priority": st.job.spec.priority,
                        "stall": round(max((self.client_stall(cid) for cid in st.clients), default=0.0), 4),
                        **({"follow": self._follow_status(key, st)} if st.job.follows else {})})
        return out

    def _follow_status(self, key: str, st: JobState) -> dict:
        """A following job's stream: its watermark (the latest partition listed), its windows,
        what is listed but in no window yet, and its last re-listing."""
        job, now = st.job, time.time()
        follower = self.runtime[key].follower
        last = max(job.windows, default=None)
        windowed = job.windows[last][1] if last is not None else 0
        out = {"every_s": job.spec.table.follow["every"], "until": job.spec.table.follow["until"],
               "watermark": max((f.partition for f in job.files), key=lambda p: tuple(p.split("/")), default=""),
               "files": len(job.files), "windows": len(job.windows),
               "window": None if last is None else {"epoch": last, "splits": list(job.windows[last]),
                                                    "rows": sum(s.rows for s in job.window(last))},
               "waiting_rows": sum(s.rows for s in job.splits[windowed:]), "ended": job.ended}
        if follower is not None:
            stats = follower.stats
            out.update(listings=stats.listings, last_listing_s=round(stats.last_s, 4),
                       last_listing_cpu_s=round(stats.last_cpu_s, 4), listed_files=stats.last_files,
                       last_listing_age_s=None if stats.last_at is None else round(now - stats.last_at, 1),
                       error=stats.error)
        return out


# Which method answers each request. Checked at import against the protocol, so a
# request type without a handler fails when the master starts.
_HANDLERS: dict[type, Callable[[MasterService, M.Message], Reply]] = {
    M.Register: MasterService._on_register,
    M.GetSpec: MasterService._on_get_spec,
    M.Heartbeat: MasterService._on_heartbeat,
    M.Drain: MasterService._on_drain,
    M.Bye: MasterService._on_bye,
    M.GetSplit: MasterService._on_get_split,
    M.SplitProduced: MasterService._on_split_produced,
    M.SplitFailed: MasterService._on_split_failed,
    M.SplitsReleased: MasterService._on_splits_released,
    M.Hello: MasterService._on_hello,
    M.StartEpoch: MasterService._on_start_epoch,
    M.ClientHeartbeat: MasterService._on_client_heartbeat,
    M.FinishEpoch: MasterService._on_finish_epoch,
    M.Goodbye: MasterService._on_goodbye,
    M.Status: MasterService._on_status,
}
# Updates after which the service decides the partitions again (and journals them).
_MEMBERSHIP = (U.WorkerRegistered, U.WorkerLost, U.WorkerDraining, U.ClientJoined, U.ClientLeft)
if {M.tag(c) for c in _HANDLERS} != MASTER_REQUESTS:
    raise ImportError(f"MasterService handlers {sorted(M.tag(c) for c in _HANDLERS)} do not match the protocol's {sorted(MASTER_REQUESTS)}")
