"""The worker's bounded buffer of finished batches, between the producer and the server.

Keyed by (rank, epoch): a piece is only ever handed to the trainer rank whose split it
came from. A full buffer blocks the producer (backpressure: no reading ahead of demand).

No rank can starve another (security.md, "fair share"):

* each rank the worker serves holds at most its **share** of the capacity (the capacity
  split evenly over the ranks that asked recently), so a rank that stops reading fills
  its share and no more. A rank that filled a larger share before others arrived keeps
  it until it reads; meanwhile the others may take the buffer up to twice its capacity;
* the producer, blocked on a full share while another rank waits with nothing buffered,
  **yields** the split (the master hands it out again, from what was consumed);
* a rank **silent** past ``silent_after_s`` (no request since its pieces arrived) is
  released: its pieces are dropped and its splits handed back to the master, to be
  produced again should it return. The rank's next request takes it back.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

from ..core.processor import Piece

Key = tuple[int, int]  # (rank, epoch)

# What ``put`` reports.
STORED = "stored"
STOPPED = "stopped"  # the worker is stopping
RELEASED = "released"  # the rank is silent: this split goes back to the master
YIELDED = "yielded"  # the rank's share is full while another rank starves: hand the split back
YIELD_AFTER_S = 0.5  # how long a full share may block the producer while another rank starves
# A rank under its share may add pieces past the capacity while one over it (holding
# more than it is owed since others arrived) drains: this bounds that overshoot.
HARD_LIMIT = 2


class BatchBuffer:
    def __init__(self, capacity: int, silent_after_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.silent_after_s = silent_after_s
        self._clock = clock
        self._queues: dict[Key, deque] = {}
        self._count = 0
        self._latest: dict[int, int] = {}  # rank -> newest epoch a client asked for
        self._heard: dict[int, float] = {}  # rank we hold work for -> when it last asked (or its first piece came)
        self._released: set[int] = set()  # silent ranks: nothing is kept for them until they ask again
        self._hungry: frozenset = frozenset()  # ranks holding credit with nothing buffered
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return self._count

    # -- producer side -----------------------------------------------------------------
    def put(self, key: Key, piece: Piece, stop: threading.Event) -> str:
        """Add a piece, waiting while its rank's share (or the whole buffer) is full."""
        rank = key[0]
        with self._cond:
            self._heard.setdefault(rank, self._clock())
            # Pieces of an epoch the rank has not asked for yet (a prefetched next epoch)
            # never wait: blocking on them could starve the epoch the trainer is in. The
            # master hands a worker a next-epoch split only while it holds none ahead, so
            # this overshoots the capacity by about one split.
            ahead = self._is_ahead(key)
            blocked_since = None
            while not ahead and not stop.is_set() and rank not in self._released and self._full_for(rank):
                now = self._clock()
                blocked_since = now if blocked_since is None else blocked_since
                if self._hungry - {rank} and now - blocked_since >= YIELD_AFTER_S:
                    return YIELDED
                self._cond.wait(0.1)
            if stop.is_set():
                return STOPPED
            if rank in self._released:
                return RELEASED
            if key[1] < self._latest.get(rank, key[1]):
                return STORED  # that client has moved on to a later epoch: nobody will ask for this
            self._queues.setdefault(key, deque()).append(piece)
            self._count += 1
            return STORED

    def wait_for_room(self, stop: threading.Event) -> bool:
        """Wait until pieces of epochs that clients are reading leave room, or a rank waits
        with nothing buffered (the rank holding the room is over its share: the new split
        is for another). Pieces held for a next epoch do not count, so they can never keep
        the worker from the current one."""
        with self._cond:
            while not stop.is_set() and (self._current_count() >= HARD_LIMIT * self.capacity
                                         or (self._current_count() >= self.capacity and not self._hungry)):
                self._cond.wait(0.1)
            return not stop.is_set()

    def blocked_ranks(self) -> list[int]:
        """Ranks the producer should not take a split of now: silent, or at their share."""
        with self._cond:
            ranks = {k[0] for k in self._queues} | self._released
            return sorted(r for r in ranks if r in self._released or self._full_for(r))

    # -- server side -------------------------------------------------------------------
    def heard_from(self, rank: int) -> None:
        """A request of ``rank`` arrived: it is reading, and is owed its share again."""
        with self._cond:
            if rank in self._heard:  # only ranks the master gave us work for count (a flood of made-up ranks does not)
                self._heard[rank] = self._clock()
            self._released.discard(rank)

    def set_hungry(self, ranks: frozenset) -> None:
        with self._cond:
            self._hungry = ranks

    def release_silent(self) -> list[tuple[int, int]]:
        """Drop the pieces of ranks silent past ``silent_after_s``; their (epoch, split id)s,
        which the master must hand out again."""
        with self._cond:
            cutoff = self._clock() - self.silent_after_s
            silent = {k[0] for k, q in self._queues.items() if q and self._heard.get(k[0], cutoff) <= cutoff}
            released: set[tuple[int, int]] = set()
            for key in [k for k in self._queues if k[0] in silent]:
                queue = self._queues.pop(key)
                released.update((key[1], p.split_id) for p in queue)
                self._count -= len(queue)
            self._released |= silent
            held = {k[0] for k in self._queues}
            self._heard = {r: t for r, t in self._heard.items() if t > cutoff or r in held}
            if silent:
                self._cond.notify_all()
            return sorted(released)

    def ahead_count(self) -> int:
        """Pieces held for epochs their rank has not started reading (prefetched)."""
        with self._cond:
            return self._count - self._current_count()

    def pop(self, key: Key) -> Optional[Piece]:
        with self._cond:
            queue = self._queues.get(key)
            if not queue:
                return None
            self._count -= 1
            self._cond.notify_all()
            return queue.popleft()

    def held(self, key: Key) -> int:
        """Pieces queued for (rank, epoch)."""
        with self._cond:
            queue = self._queues.get(key)
            return len(queue) if queue else 0

    def put_back(self, key: Key, pieces: list[Piece]) -> None:
        """Return pieces that could not be delivered to the front of their queue, in order."""
        with self._cond:
            self._queues.setdefault(key, deque()).extendleft(reversed(pieces))
            self._count += len(pieces)

    def drop_before(self, rank: int, epoch: int) -> int:
        """Forget pieces of a rank's earlier epochs: that client has moved on, so they are stale."""
        with self._cond:
            self._latest[rank] = max(epoch, self._latest.get(rank, epoch))
            stale = [k for k in self._queues if k[0] == rank and k[1] < epoch]
            dropped = sum(len(self._queues.pop(k)) for k in stale)
            self._count -= dropped
            if dropped:
                self._cond.notify_all()
            return dropped

    # -- internals (called holding the lock) ----------------------------------------------
    def _is_ahead(self, key: Key) -> bool:
        rank, epoch = key
        return rank in self._latest and epoch > self._latest[rank]

    def _current_count(self) -> int:
        return self._count - sum(len(q) for k, q in self._queues.items() if self._is_ahead(k))

    def _rank_current(self, rank: int) -> int:
        return sum(len(q) for k, q in self._queues.items() if k[0] == rank and not self._is_ahead(k))

    def _share(self) -> int:
        """The capacity split evenly over the ranks heard from recently (at least one piece)."""
        cutoff = self._clock() - self.silent_after_s
        live = sum(1 for r, t in self._heard.items() if t > cutoff and r not in self._released)
        return max(1, self.capacity // max(1, live))

    def _full_for(self, rank: int) -> bool:
        return self._rank_current(rank) >= self._share() or self._current_count() >= HARD_LIMIT * self.capacity
