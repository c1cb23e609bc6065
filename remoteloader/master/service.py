"""Request handling: turns each message into update records, applies them, replies.

Handlers decide (reading ``JobState`` through its queries), then ``_commit`` journals
and applies. Nothing here changes state any other way, so the reply a client gets is
always consistent with what a restarted master would rebuild from the journal.
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
from ..core.cache.store import BlockStore
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
from ..spec import DatasetSpec, SpecError, spec_differences
from . import updates as U
from ..core.allowlist import TableAllowlist
from .cache_plan import CachePlanner
from .history import History
from .journal import Journal
from .metrics import RateWindow
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


BIND_WAIT_S = 0.5  # the longest a hello holds the loop while a spec binds
# Row ranges of one base split a resume's `done` may hold: the prefixes of its epoch splits,
# which an elastic resume's plan cuts again (each resume can add a few).
MAX_DONE_RANGES = 16


@dataclass
class Planned:
    """A bound job, its base splits, and the estimate they were cut by."""

    bound: BoundDataset
    splits: list
    row_bytes: Optional[float]  # transformed bytes per row of a sample (None: not estimated)


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
    # A deterministic order reads `cycle` splits of a rank at once: they must fit a worker together.
    # Mixed batches read `mix_splits` splits of a rank at once, one per lane: the same.
    share = budget_bytes if spec.splits_in_flight is None else budget_bytes * 2 // (spec.splits_in_flight + 1)
    cap = split_rows_within(share, per_row) if per_row is not None else None
    if cap is not None and base and max(s.raw_rows for s in base) > cap:
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
    if not splits or sum(s.rows for s in splits) == 0:
        raise SpecError(f"table.partitions: the selection of table {spec.table.path!r} has no rows")
    return Planned(bound, splits, per_row)


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


def _done_of(resumed: Optional[dict]) -> list:
    return sorted([base, lo, hi] for base, ranges in (resumed or {}).items() for lo, hi in ranges)


def _acks(acks: list[M.Ack]) -> list[tuple[int, int]]:
    return [(a.split_id, a.pieces) for a in acks]


class MasterService:
    def __init__(self, config: MasterConfig, journal: Optional[Journal] = None,
                 clock: Callable[[], float] = time.time, keys: Optional[MasterKeys] = None,
                 cache: Optional[BlockStore] = None) -> None:
        """``cache``: the block cache (``--cache``); without it no split touches a cache."""
        self.config = config
        # Signs client sessions and worker ids (protocol/capability.py); a journaled master
        # passes the keys kept beside its journal, so replayed sessions' tokens still verify.
        self.keys = keys if keys is not None else MasterKeys.ephemeral()
        self.journal = journal
        self.clock = clock
        self.state = JobState()
        self.rates = RateWindow(config.rate_window_s)
        self.cache = CachePlanner(cache, config.cache_max_bytes, config.popularity_log)
        self.history = History()  # a bounded picture of the run over time (status with history: true)
        self.decision_log: Callable[[], list[dict]] = list  # the autoscaler's recent decisions, for status (set by it)
        # Workers launched and not yet registered (a Ray actor waiting for room, a process
        # starting), for status: not counted among the workers (set by remoteloader-master).
        self.pending_workers: Callable[[], int] = lambda: 0
        self.bound: Optional[BoundDataset] = None
        # Transformed bytes a row, and of the largest split, estimated when this master
        # planned the job (not journaled: a replayed job's splits were cut already, and
        # they stay unknown).
        self.row_bytes: Optional[float] = None
        self.split_bytes: Optional[int] = None
        self._binding: Optional[PendingBind] = None
        # Who this master process is: a client that sees it change reports everything it
        # has consumed again (consumption is not journaled).
        self.incarnation = uuid.uuid4().hex[:12]
        if journal is not None:
            replayed = 0
            for update in journal.replay():
                try:
                    self.state.apply(update)
                except Exception as e:  # an invalid record must not keep the master from starting
                    journal.quarantine(-1, U.encode(update), repr(e))
                    continue
                replayed += 1
            if replayed:
                log.info("replayed %d journal records", replayed)
        # Journal bytes right after the last compaction (or at start): what has been appended
        # since is what the compaction rule counts.
        self._snapshot_bytes = journal.size if journal is not None else 0
        if self.state.job is not None:
            self.bound = bind_schema(self.state.job.spec, self.state.job.schema)
        self._commit(U.MasterStarted(clock()))
        self.sync()

    def _commit(self, update: U.Update) -> None:
        if self.journal is not None and not update.TRANSIENT:
            self.journal.append(update)  # durable at the next sync, before any reply goes out
        self.state.apply(update)
        if isinstance(update, _MEMBERSHIP):
            partitions = self.state.balanced_partitions(self.config.max_workers_per_client)
            if partitions != self.state.partitions:
                self._commit(U.PartitionsChanged(sorted(partitions.items())))

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
            self.journal.compact(self.state.snapshot())
            self._snapshot_bytes = self.journal.size

    # -- the job ---------------------------------------------------------------------
    def submit(self, spec: DatasetSpec) -> None:
        """Bind and plan a job; raises SpecError naming the key or column at fault."""
        self._submit_bound(spec, _bind_and_plan(spec, self.config.buffer_bytes))
        self.sync()

    def _submit_bound(self, spec: DatasetSpec, planned: Planned) -> None:
        bound, splits = planned.bound, planned.splits
        files = bound.files or []
        self._commit(U.JobSubmitted(spec, spec.fingerprint(), bound.schema, [U.file_record(f) for f in files],
                                    [U.SplitRecord.of(s) for s in splits], bound.skipped))
        self.bound = bound
        self.row_bytes = planned.row_bytes
        self.split_bytes = None if planned.row_bytes is None else int(max(s.rows for s in splits) * planned.row_bytes)
        if self.config.popularity_log:
            # Which columns jobs read together: `remoteloader reorder` stores them together.
            record_projection(self.config.popularity_log, spec.table.path, bound.read_columns)
        log.info("job %s: %d files, %d splits, %d rows", spec.fingerprint(), len(files), len(splits),
                 self.state.job.total_rows)

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
        self.rates.forget({"w:" + w for w in self.state.workers} | {"c:" + c for c in self.state.clients})
        for w in list(self.state.workers.values()):
            if w.last_seen < now - self.config.heartbeat_timeout:
                log.warning("worker %s (%s) missed heartbeats for %.1f s: presumed dead",
                            w.worker_id, w.addr, now - w.last_seen)
                self._commit(U.WorkerLost(w.worker_id, "heartbeat timeout"))
        for session, seen in list(self.state.client_seen.items()):
            if seen < now - self.config.client_timeout:
                log.warning("client %s (rank %d) silent for %.0f s: forgotten", session, self.state.clients[session],
                            now - seen)
                self._commit(U.ClientLeft(session, "client timeout"))
        for epoch, split_id, worker_id, reason in self.state.stalled_splits(
                now, self.config.heartbeat_interval, self.config.split_timeout):
            log.warning("worker %s: split %d of epoch %d revoked: %s", worker_id, split_id, epoch, reason)
            self._commit(U.SplitRevoked(epoch, split_id, worker_id, reason))
        plan = self.cache.decide(self.state, self.bound, lambda: self.rates.group_totals().get("w", {}), now)
        if plan is not None:
            self._commit(plan)
        if self.history.due(now):
            self._sample_history(now)

    def _sample_history(self, now: float) -> None:
        """One sample of the run for ``history`` (once a second, from the tick)."""
        st, rates = self.state, self.rates
        workers = list(st.workers.values())
        stall: dict[int, float] = {}
        client_rows, reported = 0.0, False
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
            epoch=max((run.epoch for run in st.ranks.values()), default=None),
            cache_hits=totals.get("cache.hits", 0.0), cache_misses=totals.get("cache.misses", 0.0))
        self.history.decisions(now, self.decision_log())

    def _require_job(self) -> None:
        if self.state.job is None:
            raise RequestError("no job yet: the master waits for the first client's spec", code=ErrorCode.NO_JOB)

    def _require_worker(self, m: M.WorkerNamed) -> None:
        """The sender is the worker it names: registered, and holding its ``registered.token``
        (a member who read a worker id in ``status`` cannot drain it or take its splits)."""
        if not self._is_worker(m):
            raise RequestError(f"unknown worker {m.worker_id[:80]}", code=ErrorCode.UNKNOWN_WORKER)

    def _is_worker(self, m: M.WorkerNamed) -> bool:
        return m.worker_id in self.state.workers and self.keys.worker_token_ok(m.worker_id, m.token)

    def _require_client(self, session: str) -> int:
        if session not in self.state.clients:
            if session in self.state.replaced:
                raise RequestError("another loader took this rank over (a new process of the rank, or another job "
                                   "of the same world size on this master)", code=ErrorCode.REPLACED)
            raise RequestError(f"unknown client session {session[:80]}; say hello again",
                               code=ErrorCode.UNKNOWN_CLIENT)
        return self.state.clients[session]

    # -- workers ----------------------------------------------------------------------
    def _on_register(self, m: M.Register) -> Reply:
        if len(self.state.workers) >= self.config.max_workers:
            raise RequestError(f"the master already has {len(self.state.workers)} workers (max_workers)",
                               code=ErrorCode.FULL)
        self._check_worker_addr(m.addr)
        job = self.state.job
        if job is not None and m.fingerprint != job.fingerprint:
            # A worker still compiled for a job this master no longer serves (a master
            # restarted on the same address with another spec): it fetches the spec again.
            raise RequestError(f"this master serves job {job.fingerprint}, not {m.fingerprint[:80]}",
                               code=ErrorCode.WRONG_JOB)
        worker_id = "w-" + uuid.uuid4().hex[:10]
        self._commit(U.WorkerRegistered(worker_id, m.addr, m.pid, self.clock(), m.key, m.node))
        log.info("worker %s registered from %s (pid %d%s)", worker_id, m.addr, m.pid,
                 f", node {m.node}" if m.node else "")
        # Split tasks name the job too: a worker that registered before one existed checks each.
        return M.Registered(worker_id=worker_id, heartbeat_interval=self.config.heartbeat_interval,
                            fingerprint=m.fingerprint if job is None else job.fingerprint,
                            token=self.keys.worker_token(worker_id), verify_key=self.keys.verify_key)

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
        self._require_job()
        job = self.state.job
        return M.Spec(spec=job.spec.to_dict(), schema=job.schema, fingerprint=job.fingerprint,
                      split_bytes=self.split_bytes)

    def _on_heartbeat(self, m: M.Heartbeat) -> Reply:
        def beat(state: M.WorkerState, sessions: list[str]) -> M.HeartbeatOk:
            return M.HeartbeatOk(state=state, sessions=sessions, master=self.incarnation)

        w = self.state.workers.get(m.worker_id)
        if w is None or not self._is_worker(m):
            return beat(M.WorkerState.UNKNOWN, [])
        stats = msgspec.to_builtins(m.stats) if m.stats is not None else {}
        self._commit(U.WorkerHeartbeat(m.worker_id, self.clock(), m.buffered, stats))
        self.rates.update("w:" + m.worker_id, self.clock(), stats)
        if self.state.job is not None:
            self.cache.observe(m.worker_id, self.state.job.fingerprint, stats)
        # The live sessions of the ranks it serves: pieces it holds for any other are stale.
        sessions = self.state.sessions_served(m.worker_id)
        if not w.draining:
            return beat(M.WorkerState.RUN, sessions)
        if w.assigned:
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
        if not self.state.workers[worker_id].draining:
            log.info("worker %s draining", worker_id)
            self._commit(U.WorkerDraining(worker_id))
            # A next epoch's split read ahead would keep it waiting for a trainer that may
            # never start that epoch: it goes back to the queue, produced again when needed.
            for epoch, split_id in self.state.splits_ahead(worker_id):
                self._commit(U.SplitRevoked(epoch, split_id, worker_id, "its worker is draining"))

    def _on_bye(self, m: M.Bye) -> Reply:
        if self._is_worker(m):
            self._commit(U.WorkerLost(m.worker_id, "left"))
        return M.Ok()

    def _on_get_split(self, m: M.GetSplit) -> Reply:
        self._require_worker(m)
        if len(m.avoid_ranks) > self.config.max_world_size:
            raise RequestError("avoid_ranks must be a list of ranks")
        avoid = frozenset(m.avoid_ranks)
        choice = self.state.choose_split(m.worker_id, avoid, ahead=False) if self.state.job else None
        # A worker with no current work reads ahead into the next epoch, one split at a
        # time and only when it says it has room for one (`read_ahead`: within its byte
        # budget, leaving a split's room for current work): those pieces wait in its
        # buffer, outside the trainers' credit, until the trainer gets there.
        if (choice is None and m.read_ahead and self.config.prefetch_next_epoch and self.state.job is not None
                and not self.state.splits_ahead(m.worker_id)):
            for prefetch in self.state.prefetch_candidates(m.worker_id):
                self._commit(prefetch)
            choice = self.state.choose_split(m.worker_id, avoid)
        if choice is None:
            return M.NoSplit(retry_ms=self.config.no_split_retry_ms, reason="no pending split for this worker")
        run, progress = choice
        s = progress.split
        self._commit(U.SplitAssigned(run.epoch, s.id, m.worker_id, self.clock()))
        job = self.state.job
        cycle = job.spec.cycle
        task = make_task(job.files, job.splits[s.base], s, run.epoch, skip=progress.consumed, session=run.session,
                         seq=run.seq, fingerprint=job.fingerprint, cache=self.cache.directive(self.state, self.bound),
                         order=None if cycle is None else split_order(progress.position, cycle, s.padding),
                         lane=progress.lane)
        return M.Split(split=task.to_wire())

    def _on_split_produced(self, m: M.SplitProduced) -> Reply:
        if self._holds(m):
            self._commit(U.SplitProduced(m.epoch, m.split_id, m.worker_id))
        return M.Ok()

    def _on_split_failed(self, m: M.SplitFailed) -> Reply:
        if self._holds(m):
            skipped = self.state.job.spec.on_error == "skip"
            log.error("split %d failed%s: %s", m.split_id, " (skipped)" if skipped else "", m.error)
            self._commit(U.SplitFailed(m.epoch, m.split_id, m.worker_id, m.error, skipped))
        return M.Ok()

    def _on_splits_released(self, m: M.SplitsReleased) -> Reply:
        """The worker gives splits back: their rank went silent (its pieces were dropped) or
        its share of the worker's buffer is full while other ranks starve. They are handed
        out again from what the rank consumed, as after a worker failure."""
        self._require_worker(m)
        held = self.state.workers[m.worker_id].assigned
        for ref in m.splits:
            if (ref.epoch, ref.split_id) in held:
                self._commit(U.SplitRevoked(ref.epoch, ref.split_id, m.worker_id, f"released: {m.reason[:200]}"))
        return M.Ok()

    def _holds(self, m: Union[M.SplitProduced, M.SplitFailed]) -> bool:
        """Whether the reporting worker still holds that split; if it was re-assigned
        meanwhile (the worker was presumed dead, or the rank restarted), the report is stale."""
        self._require_worker(m)
        return (m.epoch, m.split_id) in self.state.workers[m.worker_id].assigned

    # -- clients ------------------------------------------------------------------------
    def _on_hello(self, m: M.Hello) -> Reply:
        if self.state.job is None:
            self._bind_first_spec(m.spec)
        job = self.state.job
        if m.fingerprint != job.fingerprint:
            differs = "; ".join(spec_differences(m.spec, job.spec.to_dict())) or "a key"
            raise RequestError(
                f"spec fingerprint {m.fingerprint[:80]} differs from the running job's {job.fingerprint} in "
                f"{differs} (here: this loader, there: the running job): this master serves another dataset "
                "spec (start another master, or use the same spec)", code=ErrorCode.SPEC_MISMATCH)
        if m.world_size > self.config.max_world_size:
            raise RequestError(f"world size {m.world_size} is above the master's maximum "
                               f"{self.config.max_world_size}", code=ErrorCode.BAD_RANK)
        if not m.rank < m.world_size:
            raise RequestError(f"rank {m.rank} is outside world size {m.world_size}", code=ErrorCode.BAD_RANK)
        if job.world_size is not None and m.world_size != job.world_size:
            raise RequestError(self._busy_message(m.world_size), code=ErrorCode.BUSY)
        session = "s-" + uuid.uuid4().hex[:12]
        self._commit(U.ClientJoined(session, m.rank, m.world_size, self.clock(), m.node))
        shares = self.state.shares()
        # The token is what lets this client's credit take the session's pieces at workers;
        # the session id alone (which status shows) does not.
        # It signs the session's public key too: a token seen on the wire is no use with another key.
        return M.Welcome(session=session, token=self.keys.session_token(session, m.key), job=M.JobInfo(
            fingerprint=job.fingerprint, total_rows=job.total_rows,
            rank_rows=shares.rows[m.rank] + shares.padding[m.rank], dropped_rows=shares.dropped,
            world_size=job.world_size, sparse_keys=list(self.bound.sparse_keys),
            sparse_scored=list(self.bound.pipeline.sparse_scored), plan=job.plan_fingerprint,
            dense_width=self.bound.pipeline.dense_width))

    def _busy_message(self, world_size: int) -> str:
        """Why a client of another world size cannot join now: the job of the live clients."""
        st, now = self.state, self.clock()
        last = max(st.client_seen.values(), default=now)
        return (f"world size {world_size}: this master is serving a job of world size {st.job.world_size} "
                f"({len(st.clients)} live client{'s' if len(st.clients) != 1 else ''}, last heard {now - last:.0f} s "
                f"ago); it takes another world size once they have closed their loaders, or after "
                f"{self.config.client_timeout:g} s of silence (remoteloader-master --client-timeout)")

    def _bind_first_spec(self, spec_dict: dict) -> None:
        """The first client's spec becomes the job. Binding lists files and reads footers,
        maybe from an object store: it runs on its own thread, so the loop keeps answering
        everybody else; hellos meanwhile hear ``binding`` (retry) until it is done or past
        ``bind_timeout``."""
        if self._binding is None:
            try:
                spec = DatasetSpec.from_dict(spec_dict)
            except SpecError as e:
                raise RequestError(str(e), code=ErrorCode.BAD_SPEC) from None
            if not TableAllowlist(self.config.allowed_tables).allows(spec.table.path):
                # Says nothing of whether the path exists: that would be an oracle.
                raise RequestError("table.path: this master does not serve that table (see --allow-table)",
                                   code=ErrorCode.BAD_SPEC)
            self._binding = PendingBind(spec, time.monotonic(), self.config.buffer_bytes)
        pending = self._binding
        pending.done.wait(BIND_WAIT_S)  # a small table binds within this request
        if not pending.done.is_set():
            if time.monotonic() - pending.started < self.config.bind_timeout:
                raise RequestError("the master is binding the spec to the table; retry", code=ErrorCode.BINDING)
            self._binding = None
            raise RequestError(f"table.path: reading the table's metadata took longer than "
                               f"{self.config.bind_timeout:g} s", code=ErrorCode.BAD_SPEC)
        self._binding = None
        if pending.error is not None:
            raise RequestError(str(pending.error), code=ErrorCode.BAD_SPEC)
        self._submit_bound(pending.spec, pending.result)

    def _on_start_epoch(self, m: M.StartEpoch) -> Reply:
        session = m.session
        rank = self._require_client(session)
        epoch = m.epoch
        if not epoch < self.config.max_epoch:
            raise RequestError(f"epoch {epoch} is outside [0, {self.config.max_epoch})", code=ErrorCode.BAD_EPOCH)
        consumed = _acks(m.consumed)
        done = self._check_done(m.done)
        current = self.state.ranks.get(rank)
        if done and current is not None and epoch > current.epoch + 1:
            # A resume continues the epoch a checkpoint was taken in: the rank's current one,
            # the next, or an earlier one; never a far-off epoch nobody is in.
            raise RequestError(f"done (rows consumed before a resume) for epoch {epoch}, but rank {rank} is in "
                               f"epoch {current.epoch}", code=ErrorCode.BAD_EPOCH)
        if done != _done_of(self.state.resumed.get(epoch)):
            if self.state.epoch_started(epoch):
                raise RequestError(f"epoch {epoch} already started with other rows consumed before the resume: "
                                   "every rank must load the same checkpoint", code=ErrorCode.RESUME_MISMATCH)
            self._commit(U.EpochResumed(epoch, done))
        ahead = self.state.prefetched.get(rank)
        if ahead is not None and (ahead.session, ahead.epoch) == (session, epoch):
            seq = ahead.seq  # the run workers started early: its pieces are this epoch's
        else:
            seq = self.state.next_seq[session]
        self._commit(U.EpochStarted(rank, epoch, session, seq))
        consumed = self._current_acks(rank, seq, consumed)
        if consumed:  # a resumed client: what it consumed before is not produced again
            self._commit(U.SplitsConsumed(rank, seq, consumed))
        splits = [M.EpochSplitInfo(p.split.id, p.split.rows, p.split.base, p.split.row_lo, p.split.padding)
                  for p in self.state.epoch_splits(rank, epoch)]
        return M.Epoch(epoch=epoch, seq=seq, splits=splits)

    def _check_done(self, done: list[M.DoneRange]) -> list:
        """Rows consumed before an elastic resume, disjoint and coalesced (adjacent ranges
        merged), as ``[[base split, lo, hi], ...]``. A checkpoint's consumed rows are
        prefixes of the epoch's splits, a few per base split: more ranges than that is not a
        checkpoint. (Their shape was checked at decode; here, whether they fit the job.)"""
        splits = self.state.job.splits
        # A lane boundary cuts a base split as a rank boundary does (mix_splits): so many more.
        most = MAX_DONE_RANGES * self.state.job.spec.mix_splits
        merged: list[list[int]] = []
        per_split: dict[int, int] = {}
        for base, lo, hi in sorted((d.base_split, d.lo, d.hi) for d in done):
            if not (base < len(splits) and lo < hi <= splits[base].rows):
                raise RequestError(f"done: rows [{lo}, {hi}) of base split {base} do not exist in this job")
            if merged and merged[-1][0] == base and merged[-1][2] > lo:
                raise RequestError(f"done: overlapping row ranges in base split {base}")
            if merged and merged[-1][0] == base and merged[-1][2] == lo:
                merged[-1][2] = hi
                continue
            per_split[base] = per_split.get(base, 0) + 1
            if per_split[base] > most:
                raise RequestError(f"done: more than {most} row ranges in base split {base}: a "
                                   "checkpoint's consumed rows are prefixes of the epoch's splits")
            merged.append([base, lo, hi])
        return merged

    def _on_client_heartbeat(self, m: M.ClientHeartbeat) -> Reply:
        session = m.session
        rank = self._require_client(session)
        acks = self._current_acks(rank, m.seq, _acks(m.acks))
        if acks:
            self._commit(U.SplitsConsumed(rank, m.seq, acks))
        stats = msgspec.to_builtins(m.stats) if m.stats is not None else {}
        self._commit(U.ClientHeartbeat(session, self.clock(), stats))
        self.rates.update("c:" + session, self.clock(), stats)
        # Worker keys reach clients only here, over the authenticated control channel.
        workers = [M.WorkerAddr(wid, self.state.workers[wid].addr, self.state.workers[wid].key)
                   for wid in self.state.partitions.get(rank, [])]
        run = self.state.ranks.get(rank)
        errors = self.state.errors_for(rank, run.epoch) if run is not None and run.seq == m.seq else []
        holders = []
        if run is not None and run.seq == m.seq and self.state.job.spec.splits_in_flight is not None:
            holders = [M.SplitHolder(sid, worker) for sid in sorted(run.in_flight)
                       if (worker := run.splits[sid].worker) is not None]
        return M.Membership(workers=workers, errors=[msgspec.convert(e, M.SplitError, from_attributes=True)
                                                     for e in errors], master=self.incarnation, holders=holders)

    def _on_finish_epoch(self, m: M.FinishEpoch) -> Reply:
        rank = self._require_client(m.session)
        current = self.state.ranks.get(rank)
        if current is None or current.seq != m.seq:
            raise RequestError(f"rank {rank} is not in epoch run {m.seq}", code=ErrorCode.BAD_EPOCH)
        self._commit(U.EpochFinished(rank, m.seq))
        return M.Ok()

    def _on_goodbye(self, m: M.Goodbye) -> Reply:
        """The client closed its loader: its session ends now, not after the client timeout."""
        if m.session in self.state.clients:
            self._commit(U.ClientLeft(m.session, "goodbye"))
        return M.Ok()

    def _current_acks(self, rank: int, seq: int, acks: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Acks for splits of the rank's current run; others are stale (a run changed under
        a heartbeat in flight) and are not journaled."""
        current = self.state.ranks.get(rank)
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
        if "starved_s" not in self.state.client_stats.get(client_id, {}):
            return None
        return min(1.0, self.rates.rate("c:" + client_id, "starved_s"))

    def worker_busy(self, worker_id: str) -> Optional[float]:
        """Share of the window the worker spent producing (reading, transforming, cutting);
        None for a worker that does not report ``busy_s``. What ``status`` shows as ``busy``
        and the autoscaler scales down on."""
        worker = self.state.workers.get(worker_id)
        if worker is None or "busy_s" not in worker.stats:
            return None
        return min(1.0, self.rates.rate("w:" + worker_id, "busy_s"))

    def status(self, history: bool = False) -> dict:
        """What ``remoteloader status --json`` prints; with ``history``, the run over time too."""
        st, now = self.state, self.clock()
        job = st.job
        ranks = {}
        for rank, re in sorted(st.ranks.items()):
            done = sum(1 for p in re.splits.values() if p.done)
            ranks[str(rank)] = {"epoch": re.epoch, "session": re.session, "seq": re.seq, "splits": len(re.splits), "done": done,
                                "pending": len(re.pending), "finished": re.finished}
        return {
            # Redacted: any key holder may ask for the status (and it ends up in logs and tickets).
            "job": None if job is None else {"fingerprint": job.fingerprint, "table": redact(job.spec.table.path),
                                             "files": len(job.files), "splits": len(job.splits),
                                             "rows": job.total_rows, "world_size": job.world_size,
                                             "split_bytes": self.split_bytes},
            # Per worker, from its last heartbeat: held_bytes / ahead_bytes / budget_bytes
            # (what it holds), and busy, its share of the rate window spent producing.
            "workers": [{"id": w.worker_id, "addr": w.addr, "pid": w.pid, **({"node": w.node} if w.node else {}),
                         "buffered": w.buffered,
                         "assigned": len(w.assigned), "draining": w.draining,
                         "last_seen_s": round(now - w.last_seen, 3),
                         **{k: v for k, v in w.stats.items() if k != "costs"},  # costs: the cache policy's input
                         "rows_per_s": round(self.rates.rate("w:" + w.worker_id, "rows"), 1),
                         "busy": round(self.worker_busy(w.worker_id) or 0.0, 4)}
                        for w in sorted(st.workers.values(), key=lambda w: w.seq)],
            "clients": [{"id": cid, "rank": rank, **({"node": st.rank_node[rank]} if st.rank_node.get(rank) else {}),
                         **st.client_stats.get(cid, {}),
                         "stall": round(self.client_stall(cid), 4),
                         "starved": round(self.client_starved(cid) or 0.0, 4),
                         "batches_per_s": round(self.rates.rate("c:" + cid, "batches"), 2)}
                        for cid, rank in st.clients.items()],
            "pending_workers": self.pending_workers(),
            "autoscaler": self.decision_log(),
            # Where the block cache is, its counters, and the auto policy's decisions with their reasons.
            "cache": self.cache.status(self.state, self.bound, self.rates.group_totals().get("w", {})),
            "ranks": ranks,
            "errors": [dict(e, message=redact_text(e["message"])) for e in st.errors[-20:]],  # they name files
            **({"history": self.history.to_dict()} if history else {}),
        }


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
