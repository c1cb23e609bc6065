"""Re-listing a following job's table on its own thread, so the master's loop never waits
for a listing (thousands of files, footers of new ones, maybe on an object store).

The thread only plans (``core.follow.plan_growth``); the loop's tick takes each growth and
commits it as one journaled ``TableGrew``, in the order planned: a growth plans from the
lists as the previous growth left them, and the state refuses one that does not continue
them, so none is applied twice. A master restarted on its journal starts a new follower
from the replayed lists: files listed by a growth it never journaled are found again.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional

from ..core.binding import BoundDataset
from ..core.follow import Growth, plan_growth
from ..core.plan import BaseSplit
from ..core.redact import redact_text
from ..formats import DataFile, TableError

log = logging.getLogger(__name__)


@dataclass
class ListingStats:
    """The follower's last re-listing, for ``status``."""

    listings: int = 0
    last_at: Optional[float] = None  # wall clock of its end
    last_s: float = 0.0  # its wall time
    last_cpu_s: float = 0.0  # CPU time of the follower's thread for it
    last_files: int = 0  # data files the listing saw
    error: Optional[str] = None  # why the last listing failed (it is tried again at the next interval)


class Follower:
    """One job's re-listings, every ``table.follow.every`` seconds, until its ``until``
    partition is listed or ``stop()``."""

    def __init__(self, bound: BoundDataset, files: list[DataFile], splits: list[BaseSplit], split_rows: int,
                 reported: Optional[set[str]] = None) -> None:
        self.bound, self.split_rows = bound, split_rows
        self.every = float(bound.spec.table.follow["every"])
        self._files, self._splits = list(files), list(splits)
        self._reported: set[str] = set(reported or ())
        self.growths: "queue.Queue[Growth]" = queue.Queue()
        self.stats = ListingStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="remoteloader-follow", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (a listing under way finishes first: never waited for here)."""
        self._stop.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def take(self) -> list[Growth]:
        """The growths planned since the last call, in order (the loop commits each)."""
        out = []
        while True:
            try:
                out.append(self.growths.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if self.relist_once().ended:
                return

    def relist_once(self) -> Growth:
        """List the table once and plan what is new (queued when there is anything to say)."""
        wall, cpu = time.monotonic(), time.thread_time()
        try:
            growth, listing = plan_growth(self.bound, self._files, self._splits, self.split_rows, self._reported)
        except Exception as e:  # a table briefly unlistable, or any failure: the thread lives on and lists again
            self.stats.error = redact_text(f"{type(e).__name__}: {e}" if not isinstance(e, TableError) else str(e))[:500]
            log.warning("following %s: re-listing failed (%s); trying again in %g s",
                        redact_text(self.bound.spec.table.path), self.stats.error, self.every)
            return Growth(len(self._files), len(self._splits), [], [])
        self.stats = ListingStats(self.stats.listings + 1, time.time(), time.monotonic() - wall,
                                  time.thread_time() - cpu, len(listing.new) + len(self._files), None)
        if growth.files or growth.problems or growth.ended:
            self._files += growth.files
            self._splits += growth.splits
            self.growths.put(growth)
        return growth
