"""One epoch run of a rank: pieces from the partition's workers, credit, exact batches.

The training thread iterates an ``EpochStream`` (a node): it grants workers credit
(``fetch.py``), assembles their pieces into batches of exactly ``batch_size`` rows
(``assembly.py``), and leaves acks and heartbeats to the control thread
(``control.py``), so a slow or restarting master never holds up batches that workers
already have. The session (``session.py``) makes the master calls and rejoins.
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import zmq

from ..protocol.auth import Credentials
from ..protocol.rpc import RemoteError
from .arena import ArenaLinks
from .assembly import Ready
from .control import ControlChannel
from .credit import CreditWindow
from .epoch import EpochRun
from .fetch import WorkerFetcher
from .node import Node
from .session import ClientSession, acks_of
from .stats import ClientStats

log = logging.getLogger(__name__)
HEARTBEAT_S = 0.25
WAIT_LOG_S = 10.0  # a waiting training loop is told what it waits for this often (logging WARNING)
# Once every batch of an epoch is delivered, its closing handshake gets this long: the data is
# all there, so a master gone (rank 0 closing, a restart) must not stall the rank or raise.
FINISH_S = 2.0
# While this many batches wait for the training loop, it takes the next without polling its
# sockets (pieces arrive several to a message: a poll per batch is waste).
QUEUED_ENOUGH = 4
# A sealed batch that claimed this run was refused (altered on the way, so possibly a genuine
# one lost) and no batch came for this long: the rank rejoins, so the master has the pieces
# it has not consumed produced again (the assembler drops those it already has).
LOST_RECOVER_S = 5.0


@dataclass(frozen=True)
class StreamConfig:
    rank: int
    master: str
    timeout: float
    auth: Optional[Credentials]


class EpochStream(Node[Ready]):
    """The piece source and its assembler: batches of one ``EpochRun``, in order, exactly once.

    ``get_state()`` is what the training loop consumed of the run (the assembler's state and
    the batches yielded); ``reset(state)`` starts the run again at the master from it (a new
    run of the same epoch: the master has every piece not consumed produced again), so a
    stream reset to a state continues exactly where that state was taken."""

    def __init__(self, ctx: zmq.Context, session: ClientSession, run: EpochRun, config: StreamConfig,
                 credit: CreditWindow, stats: ClientStats, warned: list[str],
                 arenas: Optional[ArenaLinks] = None) -> None:
        self.ctx, self.session, self.run, self.config = ctx, session, run, config
        self.credit, self.stats, self.warned = credit, stats, warned
        job = session.job
        self.fetcher = WorkerFetcher(ctx, config.rank, session.run, credit, job.sparse_keys, job.sparse_scored,
                                     auth=config.auth, arenas=arenas)
        self.master_seen: Optional[str] = None  # the master process heard from last (membership.master)
        self.holders: dict[int, str] = {}  # split id -> the worker producing it (membership.holders)
        self._loop: Optional[Iterator[Ready]] = None

    # -- node ----------------------------------------------------------------------------------
    @property
    def on_ready(self) -> Optional[Callable[[Ready], None]]:
        """Called with each batch as it joins the assembler's queue (the stager's submit)."""
        return self.run.assembler.on_ready

    @on_ready.setter
    def on_ready(self, hook: Optional[Callable[[Ready], None]]) -> None:
        self.run.assembler.on_ready = hook

    def get_state(self) -> dict:
        return {"epoch": self.run.epoch, "yielded": self.run.yielded, "assembler": self.run.assembler.get_state()}

    def reset(self, state: Optional[dict] = None) -> None:
        started = self._loop is not None
        self.close()
        if state is not None and state["epoch"] != self.run.epoch:
            raise ValueError(f"a state of epoch {state['epoch']} for a stream of epoch {self.run.epoch}")
        if state is not None or started:
            self.run.assembler.reset(state["assembler"] if state is not None else None)
            self.run.yielded = state["yielded"] if state is not None else 0
            self.session.restart_run(self.run.resume_point())
        self._loop = self._readies()

    def next(self) -> Ready:
        if self._loop is None:
            self.reset()
        return next(self._loop)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # -- the loop ------------------------------------------------------------------------------
    def _readies(self) -> Iterator[Ready]:
        """The run's batches in the order the training loop takes them: each is consumed (in
        the checkpoint, acked) as it is yielded."""
        run, assembler, fetcher = self.run, self.run.assembler, self.fetcher
        self.session.resume_point = run.resume_point
        control: Optional[ControlChannel] = None
        batch_wait = 0.0  # the training loop's wait for the batch it is waiting for now
        window_checked = False
        try:
            # One synchronous beat first, for the partition's workers (with what a resume in
            # place consumed before: the master retires those pieces).
            self._apply(self.session.heartbeat(assembler.take_acks(), self._wire_stats(0)))
            control = ControlChannel(self.ctx, self.config.master, lambda: self.session.run,
                                     lambda: self._wire_stats(assembler.ready_count), HEARTBEAT_S,
                                     auth=self.config.auth)
            last_progress = last_log = time.monotonic()
            while not assembler.exhausted:
                now = time.monotonic()
                if not fetcher.sockets:  # no worker to take from yet: wait for the partition, do not spin
                    control.report([], urgent=True)
                    control.wait_reply(HEARTBEAT_S)
                self._take_control_reply(control)
                ready = assembler.next_ready()
                # Deterministic order: the worker producing the schedule's head must never be
                # out of credit, and only its lack of credit is the window's fault (pieces of
                # other splits arriving early would otherwise grow the window to its cap).
                head = self._head_holder()
                if ready is None and run.yielded and not window_checked:
                    window_checked = True  # once per wait, before granting more: was credit the limit?
                    if (head is not None and fetcher.credit_limited(only=head)) if assembler.ordered \
                            else fetcher.credit_limited():
                        self.credit.starved()
                # Credit for what the loop will take next; also the keepalive that tells workers
                # this rank is alive while it works through a deep queue. Pieces waiting for
                # their turn count against the window like queued batches.
                # When no worker holds the head yet (its split is not produced), what others push
                # must not be held against them: their buffers full of this rank's later splits
                # could keep them from ever taking the head's split. Deterministic order holds up
                # to a cycle of the rank's splits, at the workers or here.
                waiting = assembler.waiting if head is not None or assembler.head is None else 0
                fetcher.top_up(assembler.ready_count, urgent=head, waiting=waiting)
                if ready is None:
                    starved = not fetcher.holding()
                    arrivals = fetcher.poll(int(HEARTBEAT_S * 1000))
                    # The training loop is waiting on us: the stall the autoscaler minimizes.
                    # Waiting for the first batch of an iteration is kept apart: the time to
                    # produce one split, which no number of workers shortens.
                    if run.yielded:
                        waited = time.monotonic() - now
                        self.stats.wait_s += waited
                        self.stats.starved_s += waited if starved else 0.0
                        batch_wait += waited
                    else:
                        self.stats.epoch_start_s += time.monotonic() - now
                elif assembler.ready_count < QUEUED_ENOUGH:
                    arrivals = fetcher.poll(0)
                else:  # batches queued here already: receive on a later batch
                    arrivals = []
                for split_id, piece, batch in arrivals:
                    if assembler.wants(split_id, piece):
                        if run.plan.splits[split_id].padding:
                            batch = batch.as_padding()
                        assembler.add(split_id, piece, batch)
                        last_progress = time.monotonic()
                if ready is not None:
                    assembler.consume(ready)
                    control.report(assembler.take_acks())
                    run.yielded += 1
                    self.stats.delivered(len(ready), batch_wait)
                    batch_wait = 0.0
                    window_checked = False
                    last_progress = time.monotonic()
                    yield ready
                else:
                    now = time.monotonic()
                    if now - last_progress > self.config.timeout:
                        raise self._timeout_error(control)
                    if fetcher.lost and now - last_progress > LOST_RECOVER_S:
                        self._recover_lost()
                        last_progress = time.monotonic()
                    if now - max(last_progress, last_log) >= WAIT_LOG_S:
                        last_log = now
                        log.warning("%s", self._waiting(control, now - last_progress))
            # The epoch's last acks go before the master is told it is over.
            leftover, control = control.close(), None
            self.session.finish_run(leftover + assembler.take_acks(), FINISH_S)
        finally:
            if control is not None:
                control.close()
            self.session.resume_point = None
            fetcher.close()

    def _head_holder(self) -> Optional[str]:
        """The worker producing the split at the head of the schedule (deterministic order):
        as the master last said, else the one its pieces came from; None if unknown or unordered."""
        head = self.run.assembler.head
        if head is None:
            return None
        return self.holders.get(head) or self.fetcher.sender_of.get(head)

    def _wire_stats(self, queued: int):
        stats = self.stats.to_wire(queued)
        if self.fetcher.refused:
            stats.refused = self.fetcher.refused
        return stats

    def _recover_lost(self) -> None:
        """A refused sealed batch may have been a genuine one altered on its way: its pieces
        are gone from the worker. A rejoin (a new session, the run restarted from what the
        training loop consumed) has them produced again; exactly once still holds, as the
        assembler takes each piece once."""
        self.fetcher.lost = False
        log.warning("rank %d epoch %d: a sealed batch was refused and no batch has come for %.0f s since; "
                    "rejoining so that the pieces it may have held are produced again",
                    self.config.rank, self.run.epoch, LOST_RECOVER_S)
        self.session.rejoin("a sealed batch was refused and may have been a genuine one")
        self._apply(self.session.heartbeat([]))

    def _waiting(self, control: ControlChannel, waited_s: float) -> str:
        """One line: what this rank has been waiting for, for ``waited_s``."""
        assembler, fetcher = self.run.assembler, self.fetcher
        if control.unreachable_s > 2 * HEARTBEAT_S + 2.0:
            reason = f"the master at {self.config.master} has not answered for {control.unreachable_s:.0f} s"
        elif not fetcher.sockets:
            reason = ("no worker registered in this rank's partition (no worker is running, or the master "
                      "was started without --workers or --autoscale)")
        elif not fetcher.holding():
            reason = (f"none of the partition's {len(fetcher.sockets)} workers holds data of this rank "
                      "(its splits are still being read, or no worker has one)")
        else:
            reason = "workers hold data of this rank that does not arrive (credit, transport or a busy worker)"
        return (f"rank {self.config.rank} epoch {self.run.epoch}: no batch for {waited_s:.0f} s "
                f"({assembler.received_rows} of {assembler.expected_rows} rows received): {reason}")

    def _timeout_error(self, control: ControlChannel) -> TimeoutError:
        # The message stays one line; what the master knows goes to the log.
        log.warning("rank %d: master status at the timeout: %s", self.config.rank, self.session.status())
        return TimeoutError(self._waiting(control, self.config.timeout))

    def _take_control_reply(self, control: ControlChannel) -> None:
        try:
            reply = control.take_reply()
        except RemoteError as e:
            self.session.rejoin_after(e)
            reply = self.session.heartbeat([])
        if reply is not None:
            self._apply(reply, control)

    def _apply(self, reply: dict, control: Optional[ControlChannel] = None) -> None:
        """Follow a ``membership`` reply: the partition, the errors, a master restart."""
        if self.fetcher.run is not self.session.run:
            self.fetcher.retarget(self.session.run)  # the session rejoined: a new run
        rank, epoch, assembler = self.config.rank, self.run.epoch, self.run.assembler
        master = reply.master
        if self.master_seen not in (None, master):
            # Another master process (a restart on its journal): consumption is not
            # journaled, so it hears everything this rank has consumed again.
            log.info("master restarted; reporting what rank %d consumed in epoch %d", rank, epoch)
            everything = acks_of(assembler.consumed_state())
            if control is not None:
                control.report(everything, urgent=True)
            else:
                reply = self.session.heartbeat(everything)
        self.master_seen = master
        self.holders = {h.split_id: h.worker_id for h in reply.holders}
        self.fetcher.set_workers([(w.worker_id, w.addr, w.key, w.arena) for w in reply.workers])
        for err in reply.errors:
            if not err.skipped:
                raise RuntimeError(f"rank {rank} epoch {epoch}: {err.message}")
            if err.message in self.warned:
                continue
            if err.split_id >= 0:  # a split quarantined this epoch; -1: a file left out at job start
                assembler.skip_split(err.split_id)
            self.warned.append(err.message)
            warnings.warn(f"remoteloader skipped data (on_error: skip): {err.message}", RuntimeWarning, stacklevel=2)
