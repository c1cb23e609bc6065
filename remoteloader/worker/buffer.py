"""The worker's bounded buffer of finished batches, between the producer and the server.

Keyed by (rank, epoch): a piece is only ever handed to the trainer rank whose split it
came from. A full buffer blocks the producer (backpressure: no reading ahead of demand).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Optional

from ..core.processor import Piece

Key = tuple[int, int]  # (rank, epoch)


class BatchBuffer:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._queues: dict[Key, deque] = {}
        self._count = 0
        self._latest: dict[int, int] = {}  # rank -> newest epoch a client asked for
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return self._count

    def put(self, key: Key, piece: Piece, stop: threading.Event) -> bool:
        """Add a piece, waiting while full; False if ``stop`` was set while waiting."""
        with self._cond:
            # Pieces of an epoch the rank has not asked for yet (a prefetched next epoch)
            # never wait: blocking on them could starve the epoch the trainer is in. The
            # master hands a worker a next-epoch split only while it holds none ahead, so
            # this overshoots the capacity by about one split.
            ahead = self._is_ahead(key)
            while self._current_count() >= self.capacity and not ahead and not stop.is_set():
                self._cond.wait(0.1)
            if stop.is_set():
                return False
            if key[1] < self._latest.get(key[0], key[1]):
                return True  # that client has moved on to a later epoch: nobody will ask for this
            self._queues.setdefault(key, deque()).append(piece)
            self._count += 1
            return True

    def wait_for_room(self, stop: threading.Event) -> bool:
        """Wait until pieces of epochs that clients are reading leave room; pieces held for
        a next epoch do not count, so they can never keep the worker from the current one."""
        with self._cond:
            while self._current_count() >= self.capacity and not stop.is_set():
                self._cond.wait(0.1)
            return not stop.is_set()

    def ahead_count(self) -> int:
        """Pieces held for epochs their rank has not started reading (prefetched)."""
        with self._cond:
            return self._count - self._current_count()

    def _is_ahead(self, key: Key) -> bool:
        rank, epoch = key
        return rank in self._latest and epoch > self._latest[rank]

    def _current_count(self) -> int:
        return self._count - sum(len(q) for k, q in self._queues.items() if self._is_ahead(k))

    def pop(self, key: Key) -> Optional[Piece]:
        with self._cond:
            queue = self._queues.get(key)
            if not queue:
                return None
            self._count -= 1
            self._cond.notify_all()
            return queue.popleft()

    def put_back(self, key: Key, piece: Piece) -> None:
        """Return a piece that could not be delivered to the front of its queue."""
        with self._cond:
            self._queues.setdefault(key, deque()).appendleft(piece)
            self._count += 1

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
