"""The control thread: registration, heartbeats, drain and splits handed back, off the
data path (a slow or restarting master never delays a batch). The only thread that
replaces the worker's session, and where signal requests take effect."""
from __future__ import annotations

import logging
import random
import time
from typing import Optional

import msgspec
import psutil

from ..core.sizing import format_size
from ..protocol import messages as M
from ..protocol.capability import SessionTokens
from ..protocol.rpc import MasterUnavailable, RemoteError, RpcClient, backoff_delay
from .buffer import WRONG_JOB, PieceBuffer
from .lifecycle import Lifecycle
from .producer import ProducerStats
from .session import CurrentSession, Registrar, WorkerSession

log = logging.getLogger(__name__)
RELEASE_CHUNK = M.MAX_RELEASED  # splits per splits_released (the master's limit)


class Control:
    def __init__(self, lifecycle: Lifecycle, current: CurrentSession, registrar: Registrar, buffer: PieceBuffer,
                 stats: ProducerStats, rpc: RpcClient, drain_timeout_s: float, tokens: SessionTokens) -> None:
        self.lifecycle = lifecycle
        self.tokens = tokens  # the pusher's check of client tokens: it needs our master's key
        self.current = current
        self.registrar = registrar
        self.buffer = buffer
        self.stats = stats
        self.rpc = rpc
        self.drain_timeout_s = drain_timeout_s
        self.master_gone = False  # no master to say bye to
        self._drain_reported = False
        self._drain_deadline = float("inf")
        # (reason, job) -> released (epoch, split id)s the master has not heard of
        self._unreported: dict[tuple[str, str], list[tuple[int, int]]] = {}
        self._rng = random.Random()  # jitter for heartbeat retries
        self._proc = psutil.Process()
        self._proc.cpu_percent()  # the first call primes the counter

    def run(self) -> None:
        lifecycle = self.lifecycle
        session: Optional[WorkerSession] = None
        next_heartbeat, failures = 0.0, 0
        while not lifecycle.stop.is_set():
            if lifecycle.requested == "stop":
                lifecycle.stop.set()
                break
            if lifecycle.requested == "drain":
                lifecycle.draining.set()
            if self.current.get() is None or self.current.wrong_job():
                session = self._join(session)
                if session is None:  # asked to leave before the master counts on us: nothing to drain
                    lifecycle.stop.set()
                    break
                next_heartbeat, failures = 0.0, 0
                continue
            now = time.monotonic()
            if lifecycle.draining.is_set() and not self._drain_reported and not self._report_drain(session, now):
                break
            if now >= self._drain_deadline:
                log.warning("drain timed out after %.0f s; handing splits back", self.drain_timeout_s)
                lifecycle.stop.set()
                break
            if now >= next_heartbeat:
                if self._heartbeat(session):
                    failures = 0
                    self._release(session)
                    next_heartbeat = now + session.heartbeat_interval
                else:
                    failures += 1
                    next_heartbeat = now + backoff_delay(failures, session.heartbeat_interval, self._rng)
            lifecycle.stop.wait(min(0.05, max(0.0, next_heartbeat - time.monotonic())))

    def _join(self, previous: Optional[WorkerSession]) -> Optional[WorkerSession]:
        rebuild = self.current.wrong_job()
        self.current.retract()  # the producer waits: no split is asked for under a forgotten id
        session = self.registrar.join(self.rpc, previous, rebuild)
        if session is None:
            return None
        if previous is not None and session.fingerprint != previous.fingerprint:
            self.buffer.discard_all(WRONG_JOB)
        self.tokens.set_master(session.verify_key)
        self.current.publish(session)
        if previous is None or session.fingerprint != previous.fingerprint:
            self._check_budget(session)
        return session

    def _check_budget(self, session: WorkerSession) -> None:
        """Once per job, as its pipeline is compiled: the master's estimate of the job's
        largest transformed split against this worker's --buffer-bytes (a larger one is
        produced alone, one at a time). The estimate also stands for the next split until
        a larger one is seen, so reading ahead is gated from the first split on."""
        try:
            reply = self.rpc.call(M.GetSpec(), timeout_s=min(self.rpc.timeout_s, 2.0), stop=self.lifecycle.stop)
        except (MasterUnavailable, RemoteError):
            return  # nothing lost: the buffer learns splits' sizes as it holds them
        if not isinstance(reply, M.Spec) or reply.fingerprint != session.fingerprint or reply.split_bytes is None:
            return
        self.buffer.expect_split_bytes(reply.split_bytes)
        if reply.split_bytes > self.buffer.budget_bytes:
            log.warning("job %s: its largest split is about %s once transformed, above this worker's --buffer-bytes "
                        "%s: such splits are produced alone, one at a time (start the master with --buffer-bytes "
                        "%s, or give this worker more)", session.fingerprint, format_size(reply.split_bytes),
                        format_size(self.buffer.budget_bytes), format_size(self.buffer.budget_bytes))

    def _report_drain(self, session: WorkerSession, now: float) -> bool:
        self._drain_reported = True
        self._drain_deadline = now + self.drain_timeout_s
        try:
            self.rpc.call(M.Drain(worker_id=session.worker_id, token=session.token), timeout_s=2.0,
                          stop=self.lifecycle.stop)
        except (MasterUnavailable, RemoteError) as e:
            # No master to hand splits to (e.g. the whole service is shutting down): nothing to wait for.
            log.warning("drain: %s; exiting", e)
            self.master_gone = True
            self.lifecycle.stop.set()
            return False
        return True

    def _heartbeat(self, session: WorkerSession) -> bool:
        stats = dict(self.stats.to_dict(), cpu=self._proc.cpu_percent() / 100.0, capacity=self.buffer.capacity,
                     ahead=self.buffer.ahead_count(), mem=float(self._proc.memory_info().rss), time=time.time(),
                     io=session.processor.io.to_dict(), discarded=self.buffer.discarded(), **self.buffer.byte_stats(),
                     costs=[msgspec.to_builtins(processor.costs.to_record(fingerprint))
                            for fingerprint, processor in session.pipelines.items()])
        mark = self.buffer.mark()
        try:
            reply = self.rpc.call(M.Heartbeat(worker_id=session.worker_id, token=session.token,
                                              buffered=len(self.buffer), stats=msgspec.convert(stats, M.WorkerStats)),
                                  timeout_s=min(self.rpc.timeout_s, 2.0))
        except (MasterUnavailable, RemoteError) as e:
            log.warning("heartbeat: %s", e)
            if self.lifecycle.draining.is_set():
                self.lifecycle.stop.set()  # draining with no master to hand splits to: nothing to wait for
            return False
        if not isinstance(reply, M.HeartbeatOk):
            log.warning("heartbeat answered with %r", M.tag(reply))
            return False
        self.current.saw_master(reply.master)
        if reply.sessions is not None:
            self.buffer.keep_sessions(reply.sessions, mark)
        state = reply.state
        if state == M.WorkerState.DRAIN:
            self.lifecycle.draining.set()
            self._drain_reported = True
            self._drain_deadline = min(self._drain_deadline, time.monotonic() + self.drain_timeout_s)
        elif state == M.WorkerState.STOP:
            log.info("worker %s drained; exiting", session.worker_id)
            self.lifecycle.stop.set()
        elif state == M.WorkerState.UNKNOWN:
            # The master lost us (restart without journal, or we were presumed dead): rejoin.
            log.warning("master does not know worker %s; registering again", session.worker_id)
            self.current.retract()
        return True

    def _release(self, session: WorkerSession) -> None:
        """Hand back the splits of discarded pieces (silent clients, stale runs, gone
        sessions); kept and retried until the master has them, or a client could wait for
        pieces nobody holds."""
        self.buffer.release_silent()  # sessions silent past --client-timeout: their pieces go back
        for reason, splits in self.buffer.take_released().items():
            log.warning("discarded pieces of %d splits (%s); handing them back", len(splits), reason)
            for epoch, split_id, *job in splits:  # one message names one job: grouped by (reason, job)
                self._unreported.setdefault((reason, job[0] if job else ""), []).append((epoch, split_id))
        for (reason, job), splits in list(self._unreported.items()):
            while splits:
                chunk = splits[:RELEASE_CHUNK]
                try:
                    self.rpc.call(M.SplitsReleased(worker_id=session.worker_id, token=session.token,
                                                   splits=[M.SplitRef(*s) for s in chunk], reason=reason, job=job),
                                  timeout_s=min(self.rpc.timeout_s, 2.0))
                except (MasterUnavailable, RemoteError) as e:
                    log.warning("splits_released: %s; retrying", e)
                    return
                del splits[:len(chunk)]
            del self._unreported[(reason, job)]
