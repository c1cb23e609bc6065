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

Memory is bounded in bytes (``budget_bytes``, the worker's ``--buffer-bytes``). A piece is
a view into its transformed split, so what the worker holds is whole splits: a split
counts, with the sum of its tensors' bytes, from its first piece (right after the
producer transformed it) until its last piece has left the buffer (popped, dropped or
discarded) and the producer is done with it. ``held`` counts them all, ``ahead`` those of
runs their client has not started reading (a next epoch read ahead). The producer takes
a new split only while held bytes plus the largest split seen so far fit the budget
(``wait_for_room``), and asks for a split read ahead only while two more fit
(``room_to_read_ahead``), so reading ahead never takes the room the current epoch needs.
Three exceptions keep the worker moving: with nothing held it always takes one split
(a single split larger than the budget still progresses); a split read ahead alone never
blocks the epoch it waits for; and while a rank waits with nothing buffered or held, the
splits of other ranks may take held bytes up to ``HARD_LIMIT`` times the budget, as they
may take pieces past the capacity.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Collection, Optional

from ..core.processor import Piece, TransformedSplit
from ..core.sizing import DEFAULT_BUFFER_BYTES, format_size, split_nbytes
from .runs import SESSION_GONE, Run, RunId, Sessions

log = logging.getLogger(__name__)

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


class _HeldSplit:
    """A transformed split the worker holds: its bytes, its pieces in the buffer, and
    whether the producer is still cutting it."""

    __slots__ = ("run", "nbytes", "pieces", "producing")

    def __init__(self, run: RunId, nbytes: int, producing: bool) -> None:
        self.run, self.nbytes, self.pieces, self.producing = run, nbytes, 0, producing


class PieceBuffer:
    def __init__(self, capacity: int, silent_after_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, budget_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        self.capacity = capacity
        self.budget_bytes = budget_bytes
        self.silent_after_s = silent_after_s
        self._clock = clock
        self._sessions = Sessions()
        self._queues: dict[RunId, deque] = {}
        self._runs: dict[RunId, Run] = {}  # rank and epoch of each queued run
        self._count = 0
        self._hungry: frozenset = frozenset()  # sessions holding credit with nothing buffered
        self._discarded: Counter = Counter()  # reason -> pieces, cumulative
        # reason -> (epoch, split id[, job])s to hand back (the job when the run names one)
        self._unreleased: dict[str, set[tuple]] = {}
        self._splits: dict[int, _HeldSplit] = {}  # id of a TransformedSplit -> what is held of it
        self._largest = 0  # bytes of the largest split seen (of this job): the next one's estimate
        # Deterministic order: a rank reads `cycle` splits at once, so its share holds at least
        # that many splits' pieces (bytes still bound what is held: a piece is a view of its split).
        # By session: a worker of a shared fleet holds runs of jobs in other orders too.
        self.min_shares: dict[str, int] = {}
        self._warned_oversized = False
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
        """Add a piece, waiting while its rank's share (or the whole buffer) is full. Its
        split is held from its first piece on, until ``finished`` and its last piece leaves."""
        with self._cond:
            self._hold(run, piece)
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
            _enqueue(self._queues.setdefault(run.id, deque()), piece)
            self._runs[run.id] = run
            self._count += 1
            self._enter(run.id, piece)
            return STORED

    def finished(self, split: Optional[TransformedSplit]) -> None:
        """The producer is done with ``split`` (every piece put, or it gave up): it stays
        held only while pieces of it are in the buffer."""
        with self._cond:
            held = self._splits.get(id(split)) if split is not None else None
            if held is not None:
                held.producing = False
                if not held.pieces:
                    del self._splits[id(split)]
                    self._cond.notify_all()

    def wait_for_room(self, stop: threading.Event) -> bool:
        """Wait until there is room for another split: pieces of runs that clients are
        reading leave room (or a run waits with nothing buffered: the one holding the room
        is over its share, the new split is for another), and held bytes plus the next
        split's estimate fit the budget (module docstring). Pieces held ahead do not count
        against the pieces' room, and a split read ahead alone never blocks: they can
        never keep the worker from the current epoch."""
        with self._cond:
            while not stop.is_set() and not (self._room_for_pieces() and self._room_for_bytes()):
                self._cond.wait(0.1)
            return not stop.is_set()

    def room_to_read_ahead(self) -> bool:
        """Whether a split read ahead (a next epoch) fits now and still leaves one split's
        room for the current epoch: held + 2 x estimate <= budget (``get_split.read_ahead``).
        No estimate yet (no split seen), no reading ahead."""
        with self._cond:
            return 0 < self._largest and self._held_bytes() + 2 * self._largest <= self.budget_bytes

    def expect_split_bytes(self, nbytes: int) -> None:
        """An estimate of the job's largest split (the master's, at bind time): the
        estimate of the next split is never below it."""
        with self._cond:
            self._largest = max(self._largest, int(nbytes))

    def blocked_ranks(self) -> list[int]:
        """Ranks the producer should not take a split of now: silent, or at their share."""
        with self._cond:
            return sorted({self._sessions.get(session).rank for session in self._blocked_sessions()})

    def blocked_sessions(self) -> list[str]:
        """The same by session (a master of several jobs: their ranks share numbers)."""
        with self._cond:
            return sorted(self._blocked_sessions())

    def _blocked_sessions(self) -> set[str]:
        held = self._held_sessions()
        return {session for session, state in self._sessions.items() if state.rank is not None
                and (state.silent or (session in held and self._full_for(session)))}

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
            piece = queue.popleft()
            self._leave(piece)
            return piece

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
            queue = self._queues.setdefault(run, deque())
            if pieces and pieces[0].order is not None:
                for piece in pieces:
                    _enqueue(queue, piece)
            else:
                queue.extendleft(reversed(pieces))
            self._count += len(pieces)
            for piece in pieces:
                self._enter(run, piece)
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
                for piece in queue:
                    self._leave(piece)
            self._queues.clear()
            self._runs.clear()
            self._count = 0
            self._largest = 0  # another job: other splits
            self._warned_oversized = False
            self._cond.notify_all()

    def take_released(self) -> dict[str, list[tuple]]:
        """Reason -> (epoch, split id)s of discarded pieces, with their job when their run
        names one (``(epoch, split id, job)``), for ``splits_released``."""
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

    def held_bytes(self) -> int:
        """Bytes of the transformed splits the worker holds (module docstring)."""
        with self._cond:
            return self._held_bytes()

    def ahead_bytes(self) -> int:
        """Of those, the bytes of splits of runs their client has not started reading."""
        with self._cond:
            return self._ahead_bytes()

    def byte_stats(self) -> dict[str, int]:
        """``held_bytes``, ``ahead_bytes`` and ``budget_bytes``, read together (heartbeat stats)."""
        with self._cond:
            return {"held_bytes": self._held_bytes(), "ahead_bytes": self._ahead_bytes(),
                    "budget_bytes": self.budget_bytes}

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
        epoch, job = self._runs[run].epoch, self._runs[run].job
        if queue:
            self._discarded[reason] += len(queue)
            self._unreleased.setdefault(reason, set()).update((epoch, p.split_id, *((job,) if job else ()))
                                                              for p in queue)
            self._count -= len(queue)
            for piece in queue:
                self._leave(piece)
            self._cond.notify_all()

    def _held_sessions(self) -> set[str]:
        return {run[0] for run, queue in self._queues.items() if queue}

    def _current_count(self) -> int:
        return self._count - sum(len(q) for r, q in self._queues.items() if self._sessions.is_ahead(r))

    def _session_current(self, session: str) -> int:
        return sum(len(q) for r, q in self._queues.items() if r[0] == session and not self._sessions.is_ahead(r))

    def set_min_share(self, session: str, pieces: int) -> None:
        """The least share of ``session`` (0: none): what its order needs held at once.
        Entries of sessions the worker no longer knows go."""
        with self._cond:
            known = {s for s, _ in self._sessions.items()}
            self.min_shares = {s: n for s, n in self.min_shares.items() if s in known and s != session}
            if pieces:
                self.min_shares[session] = pieces

    def _share(self, session: str) -> int:
        """The capacity split evenly over the sessions heard from recently (at least one piece)."""
        cutoff = self._clock() - self.silent_after_s
        live = sum(1 for _, state in self._sessions.items()
                   if state.rank is not None and state.heard > cutoff and not state.silent)
        return max(1, self.capacity // max(1, live), self.min_shares.get(session, 0))

    # Bytes: a handful of splits are held at a time, so these sums are short.
    def _hold(self, run: Run, piece: Piece) -> None:
        """The producer offers a piece of ``piece.source``: from its first piece on, the split is held."""
        split = piece.source
        if split is None or id(split) in self._splits:
            return
        nbytes = split_nbytes(split.tensors)
        self._splits[id(split)] = _HeldSplit(run.id, nbytes, producing=True)
        self._largest = max(self._largest, nbytes)
        if nbytes > self.budget_bytes and not self._warned_oversized:
            self._warned_oversized = True
            log.warning("split %d of epoch %d is %s transformed, above this worker's --buffer-bytes %s: it is held "
                        "alone. Plan smaller splits (the master's --buffer-bytes, or the spec's split_rows), or give "
                        "workers a larger budget", piece.split_id, run.epoch, format_size(nbytes),
                        format_size(self.budget_bytes))

    def _enter(self, run: RunId, piece: Piece) -> None:
        """A piece entered the buffer (stored, or put back after a pop)."""
        split = piece.source
        if split is None:
            return
        held = self._splits.get(id(split))
        if held is None:  # put back after its split's last piece had left
            held = self._splits[id(split)] = _HeldSplit(run, split_nbytes(split.tensors), producing=False)
        held.pieces += 1

    def _leave(self, piece: Piece) -> None:
        """A piece left the buffer (popped, dropped or discarded)."""
        held = self._splits.get(id(piece.source)) if piece.source is not None else None
        if held is None:
            return
        held.pieces -= 1
        if held.pieces <= 0 and not held.producing:
            del self._splits[id(piece.source)]

    def _held_bytes(self) -> int:
        return sum(h.nbytes for h in self._splits.values())

    def _ahead_bytes(self) -> int:
        return sum(h.nbytes for h in self._splits.values() if self._sessions.is_ahead(h.run))

    def _capacity(self) -> int:
        """The capacity, raised to every live rank's minimum share in deterministic order."""
        if not self.min_shares:
            return self.capacity
        floor = sum(self.min_shares.get(s, 0) for s in self._held_sessions() | self._hungry)
        return max(self.capacity, floor or max(self.min_shares.values()))

    def _room_for_pieces(self) -> bool:
        count, capacity = self._current_count(), self._capacity()
        return count < HARD_LIMIT * capacity and (count < capacity or bool(self._hungry))

    def _room_for_bytes(self) -> bool:
        """Whether the producer may take another split, by bytes (module docstring)."""
        held = self._held_bytes()
        if not held:
            return True  # a single split larger than the budget still progresses
        need = held + self._largest
        if need <= self.budget_bytes:
            return True
        ahead = [h for h in self._splits.values() if self._sessions.is_ahead(h.run)]
        if len(ahead) == len(self._splits) == 1:
            return True  # only a split read ahead: it waits for the epoch the producer must make
        # A rank waits with nothing buffered and nothing held: the room is other ranks' pieces.
        starving = self._hungry - {h.run[0] for h in self._splits.values()}
        return bool(starving) and need <= HARD_LIMIT * self.budget_bytes

    def _full_for(self, session: str) -> bool:
        return self._session_current(session) >= self._share(session) or self._current_count() >= HARD_LIMIT * self._capacity()


def _enqueue(queue: deque, piece: Piece) -> None:
    """Append ``piece``, or in deterministic order insert it by its schedule key, so the
    pusher always sends the rank's earliest piece it holds (pieces mostly come in order:
    the scan from the right is short)."""
    if piece.order is None or not queue or queue[-1].order is None or queue[-1].order <= piece.order:
        queue.append(piece)
        return
    i = len(queue)
    while i > 0 and queue[i - 1].order > piece.order:
        i -= 1
    queue.insert(i, piece)
