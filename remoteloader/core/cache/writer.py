"""Cache writes off the split's path: a bounded queue drained by one daemon thread.

Writing a segment costs encoding, MACs and a storage round trip; a split must not wait for
any of it, nor fail when it fails. ``submit`` only queues (the blocks are immutable
columns, so they are queued by reference, not copied); past ``max_pending_bytes`` of
queued blocks it drops the write and counts it, so a slow cache costs some puts, never
the worker's memory or time. With ``--cache-max-bytes`` the store itself evicts least
recently used splits before each write, or drops (and counts) one that cannot fit: that
happens here, on the writer's thread, never on the split's.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Mapping

from ...columns import Column, DenseColumn
from .store import BlockStore

log = logging.getLogger(__name__)


def column_nbytes(column: Column) -> int:
    """The bytes of a column's arrays: what a queued write holds in memory."""
    arrays = ((column.values, column.valid) if isinstance(column, DenseColumn)
              else (column.values, column.offsets, column.weights, column.valid))
    return sum(int(a.nbytes) for a in arrays if a is not None)


class BlockWriter:
    """Writes blocks to ``store`` in the background (see the module docstring)."""

    def __init__(self, store: BlockStore, max_pending_bytes: int = 256 << 20):
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self._queue: deque[tuple[str, Mapping[str, Column], int]] = deque()
        self._pending_bytes = 0  # queued plus the write in progress
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="cache-writer", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return self._pending_bytes

    def submit(self, split_key: str, blocks: Mapping[str, Column]) -> bool:
        """Queues one segment's write; False (dropped, counted) if it would take the
        queued bytes past the bound or the writer is closed. Never blocks on storage."""
        nbytes = sum(column_nbytes(c) for c in blocks.values())
        with self._cond:
            if self._stopping or self._pending_bytes + nbytes > self.max_pending_bytes:
                self.store.counters.add(dropped=1)
                return False
            self._queue.append((split_key, blocks, nbytes))
            self._pending_bytes += nbytes
            self._cond.notify_all()
        return True

    def flush(self, timeout: float) -> bool:
        """Waits until every queued write is done (written or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending_bytes == 0 and not self._queue, timeout)

    def close(self, timeout: float) -> bool:
        """Finishes the queued writes within ``timeout``, then stops the thread; writes
        still queued then are dropped (counted). True if the thread has stopped."""
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    self.store.counters.add(dropped=len(self._queue))
                    self._queue.clear()
                    self._pending_bytes = 0
                    self._cond.notify_all()
                    return
                split_key, blocks, nbytes = self._queue.popleft()
            self._write(split_key, blocks)
            with self._cond:
                self._pending_bytes -= nbytes
                self._cond.notify_all()

    def _write(self, split_key: str, blocks: Mapping[str, Column]) -> None:
        try:
            self.store.write(split_key, blocks)
        except Exception:  # a failed put costs a future hit, never the split that produced it
            self.store.counters.add(faults=1)
            log.warning("cache write of split %s failed", split_key, exc_info=True)
