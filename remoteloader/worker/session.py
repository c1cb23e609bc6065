"""The worker's session with its master: who it is there, which job, and the pipeline for it.

One immutable ``WorkerSession`` that only the control thread replaces (``CurrentSession``);
the producer and the pusher read the current reference, so no thread ever sees a worker id
of one registration with the pipeline of another, or no worker id at all: while the worker
(re-)registers there is no session, and the producer waits.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Optional

from ..core.allowlist import TableAllowlist
from ..core.binding import bind_schema
from ..core.cache.job import JobCache
from ..core.cache.store import BlockStore
from ..core.cache.writer import BlockWriter
from ..core.processor import SplitProcessor
from ..formats import IOStats
from ..protocol import messages as M
from ..protocol.rpc import HandshakeRefused, MasterUnavailable, RemoteError, RpcClient
from ..spec import DatasetSpec
from .lifecycle import Lifecycle, TableRefused
from .pipelines import Pipelines

log = logging.getLogger(__name__)
HANDSHAKE_RETRY_S = 5.0  # a worker whose handshake the master refuses tries again this often (the keys may be fixed)


@dataclass(frozen=True)
class WorkerSession:
    worker_id: str
    token: str  # proves to the master that a request naming worker_id comes from us
    verify_key: str  # the master's public key: client sessions' tokens verify under it
    fingerprint: str  # the job (spec fingerprint) the processor was compiled for
    processor: SplitProcessor
    heartbeat_interval: float
    # A master of several jobs (registered.max_jobs > 1): splits of any of them are this
    # worker's to produce, each with its job's pipeline from ``pipelines``. Else a split of
    # another job means the master moved to it: the worker registers for that job.
    shared: bool
    pipelines: Pipelines


class CurrentSession:
    """The session now in force. ``publish`` and ``retract`` belong to the control thread;
    the producer may only say that the session it holds serves another job."""

    def __init__(self) -> None:
        self._session: Optional[WorkerSession] = None
        self._wrong_job: Optional[WorkerSession] = None
        self._cond = threading.Condition()
        self._master = ""  # the master process heartbeats last named (control thread only)
        self.master_changes = 0  # how often it changed: requests made before were to another process

    def saw_master(self, master: str) -> None:
        """The master process a heartbeat named (the control thread's): a new one (a restart,
        with or without journal) never answers what its predecessor was asked."""
        if master and master != self._master:
            if self._master:
                self.master_changes += 1
            self._master = master

    def get(self) -> Optional[WorkerSession]:
        return self._session

    def wait(self, stop: threading.Event, not_this: Optional[WorkerSession] = None) -> Optional[WorkerSession]:
        """The current session once there is one (other than ``not_this``); None on stop."""
        with self._cond:
            while not stop.is_set() and (self._session is None or self._session is not_this):
                self._cond.wait(0.1)
            return None if stop.is_set() else self._session

    def publish(self, session: WorkerSession) -> None:
        with self._cond:
            self._session, self._wrong_job = session, None
            self._cond.notify_all()

    def retract(self) -> None:
        with self._cond:
            self._session = None

    def report_wrong_job(self, session: WorkerSession) -> None:
        """A split of ``session``'s master is for another job than its pipeline."""
        with self._cond:
            if self._session is session:
                self._wrong_job = session

    def wrong_job(self) -> bool:
        return self._wrong_job is not None and self._wrong_job is self._session


class SessionEnded:
    """The ``stop`` of an RPC made under ``session``: set once the worker stops, once that
    session is no longer the one in force (the master forgot this worker, and the control
    thread retracted it), or once heartbeats name another master process (a restart on
    its journal keeps the session). A request the old process never answered is then
    given up at once instead of after the whole RPC timeout."""

    def __init__(self, stop: threading.Event, current: CurrentSession, session: WorkerSession) -> None:
        self._stop, self._current, self._session = stop, current, session
        self._changes = current.master_changes

    def is_set(self) -> bool:
        return (self._stop.is_set() or self._current.get() is not self._session
                or self._current.master_changes != self._changes)


class _Leaving:
    """``Lifecycle.leaving`` as the ``stop`` of an RPC call (which asks ``is_set``): a drain
    or stop requested by a signal handler is a plain assignment, not an event's set."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.is_set = lifecycle.leaving


class Registrar:
    """Fetches the job's spec, compiles its pipeline, then registers, in that order so
    that the master only counts on a worker that is ready (compiling kernels holds the GIL
    for seconds, long enough to miss heartbeats). A master may have no job yet, restart
    and forget us, or run another job: every step retries until it succeeds or the worker
    is asked to leave, and a request to leave (drain, stop) ends the wait for an answer at once."""

    def __init__(self, addr: str, allowlist: TableAllowlist, coalesce_gap: int, lifecycle: Lifecycle,
                 register_timeout_s: Optional[float] = None, key: str = "",
                 cache: Optional[tuple[BlockStore, BlockWriter]] = None, node: str = "",
                 pipelines: Optional[Pipelines] = None, arena: str = "") -> None:
        self.addr = addr
        self.arena = arena  # its arena socket (protocol/arena.py), for clients on this host
        self.pipelines = pipelines if pipelines is not None else Pipelines()  # kept across registrations
        self.io = IOStats()  # every pipeline's reads, one set of counters
        self.node = node  # where this worker runs (--node): the master gives it to that node's ranks first
        self.cache = cache  # the block cache (store, background writer), or None
        self.key = key  # this process's X25519 public key (hex), for clients' sealed frames
        self.allowlist = allowlist
        self.coalesce_gap = coalesce_gap
        self.lifecycle = lifecycle
        # How long one register waits for its answer before asking again (None: the RPC
        # client's timeout). Tests of a master that never answers shorten it.
        self.register_timeout_s = register_timeout_s
        self._leaving = _Leaving(lifecycle)

    def join(self, rpc: RpcClient, previous: Optional[WorkerSession] = None,
             rebuild: bool = False) -> Optional[WorkerSession]:
        """A new session (the pipeline kept when the job is the same); None if the worker
        is asked to leave first. Raises TableRefused for a job outside --allow-table."""
        processor = None if previous is None or rebuild else previous.processor
        fingerprint = "" if processor is None else previous.fingerprint
        while not self.lifecycle.leaving():
            try:
                if processor is None:
                    processor, fingerprint = self._build(rpc, previous)
                reply = rpc.call(M.Register(addr=self.addr, pid=os.getpid(), fingerprint=fingerprint, key=self.key,
                                            node=self.node, arena=self.arena),
                                 timeout_s=self.register_timeout_s, stop=self._leaving)
                if not isinstance(reply, M.Registered):
                    raise MasterUnavailable(f"register answered with {M.tag(reply)!r}")
                if reply.fingerprint != fingerprint:
                    log.warning("the master runs job %s, not %s: rebuilding", reply.fingerprint, fingerprint)
                    self._leave(rpc, reply.worker_id, reply.token)
                    processor = None
                    continue
                log.info("worker %s serving on %s (job %s%s)", reply.worker_id, self.addr, fingerprint,
                         f", one of up to {reply.max_jobs}" if reply.max_jobs > 1 else "")
                self.pipelines.put(fingerprint, processor)
                return WorkerSession(reply.worker_id, reply.token, reply.verify_key, fingerprint, processor,
                                     reply.heartbeat_interval, reply.max_jobs > 1, self.pipelines)
            except HandshakeRefused as e:  # its keys: said at once, retried slowly (the master may be restarted)
                log.error("%s; retrying every %.0f s", e, HANDSHAKE_RETRY_S)
                self.lifecycle.stop.wait(HANDSHAKE_RETRY_S)
            except MasterUnavailable as e:
                if not self.lifecycle.leaving():
                    log.warning("%s; retrying", e)
            except RemoteError as e:
                if e.code == "wrong_job":
                    log.warning("%s: rebuilding for the master's job", e)
                    processor = None
                else:  # no job yet, or the master is full: ask again shortly
                    self.lifecycle.stop.wait(0.2)
        return None

    def _build(self, rpc: RpcClient, previous: Optional[WorkerSession]) -> tuple[SplitProcessor, str]:
        reply = rpc.call(M.GetSpec(), stop=self._leaving)
        if not isinstance(reply, M.Spec):
            raise MasterUnavailable(f"get_spec answered with {M.tag(reply)!r}")
        if previous is not None and reply.fingerprint == previous.fingerprint:
            return previous.processor, previous.fingerprint
        return self.compile(reply), reply.fingerprint

    def compile(self, reply: M.Spec) -> SplitProcessor:
        """The pipeline of the job ``reply`` (get_spec's answer) describes. Raises TableRefused
        for a table outside --allow-table, SpecError for a spec this worker cannot bind."""
        spec = DatasetSpec.from_dict(reply.spec)
        for _, path in spec.table_paths:  # every table of a mix
            if not self.allowlist.allows(path):
                raise TableRefused(f"the master's job reads table {path!r}, outside this "
                                   "worker's --allow-table prefixes; refusing to serve it")
        bound = bind_schema(spec, reply.schema)
        memo = self.pipelines.memo
        store, writer = self.cache if self.cache is not None else (None, None)
        cache = None if store is None and memo is None else JobCache(store, writer, bound, memo)
        processor = SplitProcessor(bound, self.coalesce_gap, cache, io=self.io)
        processor.warm_up()
        return processor

    def _leave(self, rpc: RpcClient, worker_id: str, token: str) -> None:
        """Undo a registration made with the wrong pipeline, so it never gets a split."""
        try:
            rpc.call(M.Bye(worker_id=worker_id, token=token), timeout_s=1.0, stop=self.lifecycle.stop)
        except (MasterUnavailable, RemoteError):
            pass  # it times out on the master instead
