"""The worker's bounded buffer of pieces, between the producer and the pusher.

Keyed by run, ``(session, seq)``: a piece is only ever handed to the client session and
epoch run its split was produced for. Which runs are still wanted is ``runs.Sessions``'s
call; a piece of a run that is not is never stored (``put`` says ``dropped``), and pieces
already stored when their run goes stale are discarded, counted by reason, and their
splits queued to be handed back to the master (which requeues those still needed). So a
discarded piece is never reported stored.

A full buffer blocks the producer (backpressure: no reading ahead of demand). No rank can
starve another (security.md, "fair share"):

* each rank the worker serves holds at most its **share** of the capacity (the capacity
  split evenly over the sessions heard from recently; a rank has one live session), so a
  rank that stops reading fills its share and no more. One that filled a larger share
  before others arrived keeps it until it reads; meanwhile the others may take the buffer
  up to twice its capacity;
* the producer, blocked on a full share while another run waits with nothing buffered,
  **yields** the split (the master hands it out again, from what was consumed);
* a session **silent** past ``silent_after_s`` (no credit since its pieces arrived) is
  released: its pieces are discarded and its splits handed back. Its next credit takes it back.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Collection, Optional

from ..core.processor import Piece
from .runs import SESSION_GONE, Run, RunId, Sessions

SILENT, YIELDED, WRONG_JOB = "silent", "yielded", "wrong_job"
YIELD_AFTER_S = 0.5  # how long a full share may block the producer while another run starves
# A rank under its share may add pieces past the capacity while one over it (holding
# more than it is owed since others arrived) drains: this bounds that overshoot.
HARD_LIMIT = 2


@dataclass(frozen=True)
class Outcome:
    """What ``put`` did with a piece: ``stored``, ``stopped`` (the worker is stopping) or
    ``dropped`` (``reason``, one of ``wire.DISCARD_REASONS``: the split goes back to the master)."""

    kind: str
    reason: str = ""

    @property
    def dropped(self) -> bool:
        return self.kind == "dropped"


STORED, STOPPED = Outcome("stored"), Outcome("stopped")


class PieceBuffer:
    def __init__(self, capacity: int, silent_after_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.silent_after_s = silent_after_s
        self._clock = clock
        self._sessions = Sessions()
        self._queues: dict[RunId, deque] = {}
        self._runs: dict[RunId, Run] = {}  # rank and epoch of each queued run
        self._count = 0
        self._hungry: frozenset = frozenset()  # sessions holding credit with nothing buffered
        self._discarded: Counter = Counter()  # reason -> pieces, cumulative
        self._unreleased: dict[str, set[tuple[int, int]]] = {}  # reason -> (epoch, split id)s to hand back
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return self._count

    # -- producer side -----------------------------------------------------------------
    def admit(self, run: Run) -> Optional[str]:
        """A task of ``run`` arrived; why it must not be produced, or None."""
        with self._cond:
            for session in self._sessions.admit(run, self._clock()):
                self._discard(session, SESSION_GONE)
            return self._sessions.stale(run.id)

    def put(self, run: Run, piece: Piece, stop: threading.Event) -> Outcome:
        """Add a piece, waiting while its rank's share (or the whole buffer) is full."""
        with self._cond:
            blocked_since = None
            while True:
                reason = self._unwanted(run)
                if stop.is_set() or reason is not None or self._sessions.is_ahead(run.id) \
                        or not self._full_for(run.session):
                    break
                # Pieces a client has not asked for yet (a prefetched next epoch) never wait
                # (above): blocking on them could starve the epoch the trainer is in.
                now = self._clock()
                blocked_since = now if blocked_since is None else blocked_since
                if self._hungry - {run.session} and now - blocked_since >= YIELD_AFTER_S:
                    reason = YIELDED
                    break
                self._cond.wait(0.1)
            if stop.is_set():
                return STOPPED
            if reason is not None:
                self._discarded[reason] += 1
                return Outcome("dropped", reason)
            self._queues.setdefault(run.id, deque()).append(piece)
            self._runs[run.id] = run
            self._count += 1
            return STORED

    def wait_for_room(self, stop: threading.Event) -> bool:
        """Wait until pieces of runs that clients are reading leave room, or a run waits
        with nothing buffered (the one holding the room is over its share: the new split
        is for another). Pieces held ahead do not count, so they can never keep the
        worker from the current epoch."""
        with self._cond:
            while not stop.is_set() and (self._current_count() >= HARD_LIMIT * self.capacity
                                         or (self._current_count() >= self.capacity and not self._hungry)):
                self._cond.wait(0.1)
            return not stop.is_set()

    def blocked_ranks(self) -> list[int]:
        """Ranks the producer should not take a split of now: silent, or at their share."""
        with self._cond:
            held = self._held_sessions()
            return sorted({state.rank for session, state in self._sessions.items() if state.rank is not None
                           and (state.silent or (session in held and self._full_for(session)))})

    # -- pusher side -------------------------------------------------------------------
    def credited(self, run: RunId) -> bool:
        """A client granted credit for ``run``: it reads that run, so its session's older
        runs are stale and it is owed its share again. False if the run is not wanted."""
        with self._cond:
            if not self._sessions.credit(run, self._clock()):
                return False
            self._discard_stale(run[0])
            return True

    def stale(self, run: RunId) -> bool:
        with self._cond:
            return self._sessions.stale(run) is not None

    def set_hungry(self, runs: Collection[RunId]) -> None:
        with self._cond:
            self._hungry = frozenset(session for session, _ in runs)

    def pop(self, run: RunId) -> Optional[Piece]:
        with self._cond:
            queue = self._queues.get(run)
            if not queue:
                return None
            self._count -= 1
            self._cond.notify_all()
            return queue.popleft()

    def held(self, run: RunId) -> int:
        with self._cond:
            queue = self._queues.get(run)
            return len(queue) if queue else 0

    def put_back(self, run: RunId, pieces: list[Piece]) -> None:
        """Return pieces that could not be delivered to the front of their queue, in order
        (or discard them, if their run went stale meanwhile)."""
        with self._cond:
            if run not in self._runs:  # its session went away meanwhile: nobody needs these pieces
                self._discarded[SESSION_GONE] += len(pieces)
                return
            self._queues.setdefault(run, deque()).extendleft(reversed(pieces))
            self._count += len(pieces)
            self._discard_stale(run[0])

    # -- control side ------------------------------------------------------------------
    def mark(self) -> int:
        """Call before sending a heartbeat; pass the result to ``keep_sessions`` with its reply."""
        with self._cond:
            return self._sessions.mark()

    def keep_sessions(self, live: Collection[str], mark: int) -> None:
        """The master's live sessions: pieces of every other session seen before ``mark`` go."""
        with self._cond:
            for session in self._sessions.keep(live, mark):
                self._discard(session, SESSION_GONE)

    def release_silent(self) -> None:
        """Discard the pieces of sessions silent past ``silent_after_s``; forget sessions
        silent twice that long with nothing held."""
        with self._cond:
            now = self._clock()
            held = self._held_sessions()
            silent = [s for s, state in self._sessions.items()
                      if s in held and state.heard <= now - self.silent_after_s]
            for session in silent:
                self._sessions.get(session).silent = True
                self._discard(session, SILENT)
            self._sessions.expire([s for s, state in self._sessions.items()
                                   if s not in held and state.heard <= now - 2 * self.silent_after_s])
            # A dropped run's epoch stays known until here, for pieces the pusher puts back.
            self._runs = {run: r for run, r in self._runs.items() if run in self._queues}

    def discard_all(self, reason: str) -> None:
        """Discard every piece (the worker now serves another job). Nothing is queued to be
        handed back: those splits belong to a job the master no longer runs."""
        with self._cond:
            for queue in self._queues.values():
                self._discarded[reason] += len(queue)
            self._queues.clear()
            self._runs.clear()
            self._count = 0
            self._cond.notify_all()

    def take_released(self) -> dict[str, list[tuple[int, int]]]:
        """Reason -> (epoch, split id)s of discarded pieces, for ``splits_released``."""
        with self._cond:
            released, self._unreleased = self._unreleased, {}
            return {reason: sorted(splits) for reason, splits in released.items()}

    def discarded(self) -> dict[str, int]:
        """Pieces discarded so far, by reason (heartbeat ``stats.discarded``)."""
        with self._cond:
            return dict(self._discarded)

    def ahead_count(self) -> int:
        """Pieces held for runs their client has not started reading (prefetched)."""
        with self._cond:
            return self._count - self._current_count()

    # -- internals (called holding the lock) ----------------------------------------------
    def _unwanted(self, run: Run) -> Optional[str]:
        state = self._sessions.get(run.session)
        if state is not None and state.silent:
            return SILENT
        return self._sessions.stale(run.id)

    def _discard_stale(self, session: str) -> None:
        for run in [r for r in self._queues if r[0] == session]:
            reason = self._sessions.stale(run)
            if reason is not None:
                self._drop_queue(run, reason)

    def _discard(self, session: str, reason: str) -> None:
        for run in [r for r in self._queues if r[0] == session]:
            self._drop_queue(run, reason)

    def _drop_queue(self, run: RunId, reason: str) -> None:
        queue = self._queues.pop(run)
        epoch = self._runs[run].epoch
        if queue:
            self._discarded[reason] += len(queue)
            self._unreleased.setdefault(reason, set()).update((epoch, p.split_id) for p in queue)
            self._count -= len(queue)
            self._cond.notify_all()

    def _held_sessions(self) -> set[str]:
        return {run[0] for run, queue in self._queues.items() if queue}

    def _current_count(self) -> int:
        return self._count - sum(len(q) for r, q in self._queues.items() if self._sessions.is_ahead(r))

    def _session_current(self, session: str) -> int:
        return sum(len(q) for r, q in self._queues.items() if r[0] == session and not self._sessions.is_ahead(r))

    def _share(self) -> int:
        """The capacity split evenly over the sessions heard from recently (at least one piece)."""
        cutoff = self._clock() - self.silent_after_s
        live = sum(1 for _, state in self._sessions.items()
                   if state.rank is not None and state.heard > cutoff and not state.silent)
        return max(1, self.capacity // max(1, live))

    def _full_for(self, session: str) -> bool:
        return self._session_current(session) >= self._share() or self._current_count() >= HARD_LIMIT * self.capacity
