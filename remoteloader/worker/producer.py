"""The producer thread: asks the master for a split, processes it, and puts its pieces
into the buffer (blocking while it is full)."""
from __future__ import annotations

import logging
import time
import traceback
from typing import Callable, Optional

import zmq

from ..core.allowlist import TableAllowlist
from ..core.plan import pieces_of
from ..core.processor import SplitError, SplitProcessor, SplitTask
from ..spec import SpecError
from ..protocol import messages as M
from ..protocol.rpc import MasterUnavailable, RemoteError, RpcClient
from .buffer import STORED, WRONG_JOB, Outcome, PieceBuffer
from .faults import Faults
from .lifecycle import Lifecycle, TableRefused
from .runs import Run
from .session import CurrentSession, SessionEnded, WorkerSession

log = logging.getLogger(__name__)
NOTIFY = "inproc://worker-notify"  # the producer wakes the pusher here


class ProducerStats:
    """Cumulative counters for heartbeats; written by the producer only.

    ``busy_s`` is time spent producing: reading, transforming and cutting splits. Time
    waiting for room in the buffer (a full share, the byte budget), for the master, or
    for a split to do is not busy, so ``d(busy_s)/dt`` is the share of its time a worker
    works, and ``rows / busy_s`` its rate flat out (the autoscaler reads both)."""

    def __init__(self) -> None:
        self.rows = self.batches = self.splits = 0
        self.busy_s = 0.0
        self.producing: Optional[list[int]] = None  # [epoch, split_id, pieces produced]
        self.producing_job = ""  # the job (spec fingerprint) of that split

    def to_dict(self) -> dict:
        stats = {"rows": self.rows, "batches": self.batches, "splits": self.splits, "busy_s": self.busy_s}
        producing = self.producing
        if producing is not None:
            stats["split"] = list(producing)
            stats["job"] = self.producing_job
        return stats


class Producer:
    def __init__(self, lifecycle: Lifecycle, current: CurrentSession, buffer: PieceBuffer, ctx: zmq.Context,
                 connect: Callable[[], RpcClient], allowlist: TableAllowlist, faults: Faults,
                 clock: Callable[[], float] = time.perf_counter,
                 compile: Optional[Callable[[M.Spec], SplitProcessor]] = None) -> None:
        self.lifecycle = lifecycle
        self.current = current
        self.buffer = buffer
        self._largest_split = ("", 0)  # (job, pieces of its largest split seen): deterministic order's share
        self.ctx = ctx
        self.connect = connect
        self.allowlist = allowlist
        self.faults = faults
        self.clock = clock  # what busy time is measured with
        self.compile = compile  # a job's pipeline from get_spec's answer (Registrar.compile)
        self.stats = ProducerStats()

    def run(self) -> None:
        stop = self.lifecycle.stop
        rpc = self.connect()
        notify = self.ctx.socket(zmq.PUSH)
        notify.connect(NOTIFY)
        retired: Optional[WorkerSession] = None  # a session found to serve another job
        try:
            while self.buffer.wait_for_room(stop):
                session = self.current.wait(stop, not_this=retired)
                if session is None:
                    return
                if self.lifecycle.draining.is_set():
                    stop.wait(0.1)
                    continue
                task = self._next_task(rpc, session)
                if task is None:
                    continue
                if task.fingerprint != session.fingerprint and not session.shared:
                    log.warning("%s is for job %s, this worker's pipeline for %s", task.describe(),
                                task.fingerprint, session.fingerprint)
                    self._release(rpc, session, task, WRONG_JOB)
                    self.current.report_wrong_job(session)
                    retired = session
                elif not self.allowlist.allows(task.file.path):
                    self._report_failure(rpc, session, task, f"{task.describe()}: file {task.file.path!r} is "
                                                             "outside this worker's --allow-table prefixes")
                else:
                    processor = self._pipeline(rpc, session, task)
                    if processor is not None:
                        self._process(rpc, session, task, notify, processor)
        finally:
            rpc.close()
            notify.close(linger=0)

    def _next_task(self, rpc: RpcClient, session: WorkerSession) -> Optional[SplitTask]:
        stop = self.lifecycle.stop
        ended = SessionEnded(stop, self.current, session)
        try:
            # A shared fleet's master is told sessions: a rank blocked in one job is not in another.
            reply = rpc.call(M.GetSplit(worker_id=session.worker_id, token=session.token,
                                        avoid_ranks=[] if session.shared else self.buffer.blocked_ranks(),
                                        avoid_sessions=self.buffer.blocked_sessions() if session.shared else [],
                                        read_ahead=self.buffer.room_to_read_ahead()), stop=ended)
        except (MasterUnavailable, RemoteError) as e:  # an unknown worker: the control thread registers again
            if ended.is_set() and not stop.is_set():
                log.info("get_split given up: the master that was asked restarted or forgot this worker")
            else:
                log.warning("get_split: %s", e)
                stop.wait(0.5)
            return None
        if isinstance(reply, M.Split):
            return SplitTask.from_wire(reply.split)
        if not isinstance(reply, M.NoSplit):  # the master re-queues a split nobody produces
            log.error("get_split answered with %r", M.tag(reply))
        stop.wait(reply.retry_ms / 1000 if isinstance(reply, M.NoSplit) else 0.5)
        return None

    def _pipeline(self, rpc: RpcClient, session: WorkerSession, task: SplitTask) -> Optional[SplitProcessor]:
        """The pipeline of the task's job: the session's, or (a shared fleet) one compiled
        before or now, from the master's get_spec for that job. A job this worker cannot
        compile fails its split (the job's clients hear why; the other jobs go on); a master
        that does not answer gets the split back."""
        if task.fingerprint == session.fingerprint:
            return session.processor
        processor = session.pipelines.get(task.fingerprint)
        if processor is not None:
            return processor
        try:
            reply = rpc.call(M.GetSpec(fingerprint=task.fingerprint),
                             stop=SessionEnded(self.lifecycle.stop, self.current, session))
            if not isinstance(reply, M.Spec) or reply.fingerprint != task.fingerprint:
                raise MasterUnavailable(f"get_spec of job {task.fingerprint} answered with {M.tag(reply)!r}")
            processor = self.compile(reply)
        except (MasterUnavailable, RemoteError) as e:
            log.warning("%s: %s", task.describe(), e)
            self._release(rpc, session, task, "no_pipeline")
            return None
        except (TableRefused, SpecError) as e:
            self._report_failure(rpc, session, task, f"{task.describe()}: job {task.fingerprint}: {e}")
            return None
        log.info("compiled the pipeline of job %s", task.fingerprint)
        if reply.split_bytes is not None:
            self.buffer.expect_split_bytes(reply.split_bytes)
        session.pipelines.put(task.fingerprint, processor)
        return processor

    def _process(self, rpc: RpcClient, session: WorkerSession, task: SplitTask, notify: zmq.Socket,
                 processor: SplitProcessor) -> None:
        run = Run.of(task)
        unwanted = self.buffer.admit(run)
        if unwanted is not None:
            self._release(rpc, session, task, unwanted)
            return
        self.stats.producing = [task.epoch, task.split_id, 0]
        self.stats.producing_job = task.fingerprint
        self._order_share(processor, task)
        try:
            outcome, failure = self._produce(session, task, run, notify, processor)
            if failure is not None:
                self._report_failure(rpc, session, task, failure)
            elif outcome.dropped:
                self._release(rpc, session, task, outcome.reason)
            elif outcome is STORED:
                self.stats.splits += 1
                # Still reported as producing until the master knows it is produced, so a
                # heartbeat in between never makes the split look abandoned.
                self._call_quietly(rpc, M.SplitProduced(worker_id=session.worker_id, token=session.token,
                                                        epoch=task.epoch, split_id=task.split_id,
                                                        job=task.fingerprint))
        finally:
            self.stats.producing = None

    def _order_share(self, processor: SplitProcessor, task: SplitTask) -> None:
        """A deterministic order reads `cycle` splits of a rank at once, mixed batches one split
        of each of `mix_splits` lanes: the buffer holds that many of the job's largest splits
        for a rank (a split is whole stripes, so it may be far larger than split_rows), else
        the pieces a rank waits for could never be made."""
        spec = processor.spec
        if spec.splits_in_flight is None:
            self.buffer.set_min_share(task.session, 0)
            return
        pieces = max(pieces_of(spec.split_rows, spec.batch_size), pieces_of(task.row_hi - task.row_lo, spec.batch_size))
        if self._largest_split[0] != task.fingerprint:
            self._largest_split = (task.fingerprint, 0)
        self._largest_split = (task.fingerprint, max(self._largest_split[1], pieces))
        self.buffer.set_min_share(task.session, spec.splits_in_flight * self._largest_split[1])

    def _produce(self, session: WorkerSession, task: SplitTask, run: Run, notify: zmq.Socket,
                 processor: Optional[SplitProcessor] = None) -> tuple[Outcome, Optional[str]]:
        """Put the split's pieces into the buffer: ``STORED`` once every one is in, else the
        outcome that ended it (``STOPPED``, or dropped), and the failure's message if it failed.

        ``processor``: the task's job's pipeline (default: the session's). Busy time is counted here, piece by piece (heartbeats see it grow during a long
        split): from the start to the end of the split, less the time inside ``put``."""
        stats, stop, clock = self.stats, self.lifecycle.stop, self.clock
        split = None  # the transformed split, once its first piece is out
        outcome = STORED
        mark = clock()
        try:
            for piece in (processor or session.processor).pieces(task):  # the first comes once the split is transformed
                self.faults.before_piece(stop)
                split = piece.source
                stats.busy_s += clock() - mark
                outcome = self.buffer.put(run, piece, stop)
                mark = clock()
                if outcome is not STORED:
                    return outcome, None
                stats.producing[2] += 1
                stats.rows += piece.rows
                stats.batches += 1
                # Wake the pusher only when it may have found this queue empty: with pieces
                # already queued it is sending them (or waits for credit, whose arrival wakes
                # it), and a wake-up per piece costs both threads the GIL.
                if self.buffer.held(run.id) == 1:
                    notify.send(b"")
            return STORED, None
        except SplitError as e:
            return outcome, str(e)
        except Exception:  # a bug in processing one split must surface in its client, not hang the job
            return outcome, f"{task.describe()}: worker error:\n{traceback.format_exc()}"
        finally:
            stats.busy_s += clock() - mark  # the last stretch (about nothing after a put that ended it)
            self.buffer.finished(split)

    def _release(self, rpc: RpcClient, session: WorkerSession, task: SplitTask, reason: str) -> None:
        self._call_quietly(rpc, M.SplitsReleased(worker_id=session.worker_id, token=session.token,
                                                 splits=[M.SplitRef(task.epoch, task.split_id)], reason=reason,
                                                 job=task.fingerprint))

    def _report_failure(self, rpc: RpcClient, session: WorkerSession, task: SplitTask, message: str) -> None:
        log.error("%s", message)
        self._call_quietly(rpc, M.SplitFailed(worker_id=session.worker_id, token=session.token, epoch=task.epoch,
                                              split_id=task.split_id, error=message[:8000], job=task.fingerprint))

    def _call_quietly(self, rpc: RpcClient, request: M.WorkerRequest) -> None:
        try:
            rpc.call(request, stop=self.lifecycle.stop)
        except (MasterUnavailable, RemoteError) as e:
            log.warning("%s: %s", M.tag(request), e)
