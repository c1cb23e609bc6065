"""Shared work between a master's jobs (issue 39): the same base split of two jobs on one worker.

Two jobs that read the same table with some of the same features (the same block keys,
``core/cache/job.py``) compute the same blocks of each base split. A worker keeps the
blocks it computed for one job that another job it serves reads (``core/cache/memo.py``,
for up to 30 s), so the second job's split of that base split costs only what it does not
share, if it reaches the same worker soon. This module makes it do so when a worker asks
for work, choosing among the jobs' next splits (each job's own next split, as its plan
orders them: nothing here reorders a job's splits, so each job keeps its order,
deterministic or not, and its exactly-once books):

1. **Leave it to its holder**: a job whose next split was given to another live worker (one
   that serves the job's rank) for another sharing job within ``DEFER_S`` is passed over
   while another job has work for this worker: that worker takes it when it asks next, as
   its own job's turn comes (the passed-over job keeps its place in the fair share,
   ``JobShares.served(behind=...)``). Bounded in time, so a holder that cannot take it (its
   buffer full for that job) delays it by at most ``DEFER_S``. That window is a third of
   how long the holder's memo keeps the blocks (30 s, within its bytes), not just as long
   as a split takes: two jobs
   reading flat out run seconds apart (one starts or reads ahead into an epoch first), and a
   job that trails the other by more than the window lost the blocks of about half its
   splits (the other worker took them: 35 of 158 base splits in one run with a 2-s window,
   11 with this one; benchmarks/RESULTS.md, issue 39).
2. Else, when every job's next split is another worker's and one of them is still in flight
   there (given less than ``WAIT_S`` ago, not yet produced), the worker waits (the master
   answers ``no_split``; it asks again in ``no_split_retry_ms``) rather than compute it twice;
   past that, or once it is produced, the worker takes it and computes it.

Nothing here moves a job ahead of its fair share: the split handed out is the first job's
in fair-share order that is not another worker's.

A misjudged choice costs time, never rows: what a split computes is a pure function of its
keys, and each job's splits are assigned, produced and acknowledged exactly as before. Like
the fair share's passes this is a scheduling decision, not state: nothing is journaled, and
a restarted master starts without history (and shares again from the next splits on).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Collection, Optional, Sequence

from ..core.cache.memo import TTL_S
from ..core.plan import BaseSplit
from ..formats import DataFile

WAIT_S = 1.0  # how long a worker with nothing else waits for a split in flight on another
# How long a split is left to the worker given it for another job, while others have work:
# a third of the time that worker's memo keeps the blocks (core/cache/memo.py), so that the
# holder still finds them when it takes the split.
DEFER_S = TTL_S / 3
MAX_RECENT = 4096  # base splits remembered (each a few handed-out records): bounded memory

SplitIdentity = tuple  # what names a base split's stored rows, as the block cache's split key does


def split_identity(files: Sequence[DataFile], base: BaseSplit, sampling: Optional[dict]) -> SplitIdentity:
    """The base split's rows, as ``core.cache.keys.split_key`` names them (the file's path,
    size, tail digest and identity, its units, and table-level sampling with the position
    it hashes): two jobs' splits of equal identity are the same blocks' rows."""
    f = files[base.file]
    rows = (f.path, f.nbytes, f.tail_digest, f.identity, f.format, base.first_unit, base.stop_unit)
    if not sampling:
        return rows
    return rows + (base.position, json.dumps(sampling, sort_keys=True))


@dataclass
class Candidate:
    """A job's next split for the asking worker: its job, identity, and the workers that
    may produce it (its rank's partition)."""

    job: str
    identity: SplitIdentity
    takers: Collection[str]


@dataclass
class _Handed:
    job: str
    worker: str
    at: float
    produced: bool = False


@dataclass
class SharedWorkCounters:
    deferred: int = 0  # times a job's next split was left to the worker holding its blocks
    waited: int = 0  # no_split answers given to wait for a split in flight elsewhere

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class SharedWork:
    def __init__(self, wait_s: float = WAIT_S, defer_s: float = DEFER_S, max_recent: int = MAX_RECENT) -> None:
        self.wait_s, self.defer_s, self.max_recent = wait_s, defer_s, max_recent
        self.counters = SharedWorkCounters()
        self._keys: dict[str, frozenset[str]] = {}  # job -> its block keys
        self._recent: OrderedDict[SplitIdentity, list[_Handed]] = OrderedDict()  # oldest first
        self._by_split: dict[tuple[str, int, int], _Handed] = {}  # (job, epoch, split id) -> its record

    @property
    def jobs(self) -> Collection[str]:
        return self._keys.keys()

    def add_job(self, job: str, block_keys: frozenset[str]) -> None:
        self._keys[job] = block_keys

    def forget(self, job: str) -> None:
        self._keys.pop(job, None)

    def sharing(self, job: str, other: str) -> bool:
        return job != other and bool(self._keys.get(job, frozenset()) & self._keys.get(other, frozenset()))

    def pick(self, worker: str, candidates: Sequence[Candidate], now: float,
             live: Callable[[str], bool]) -> Optional[int]:
        """Which of ``candidates`` (at least one: the jobs' next splits for ``worker``, in
        fair-share order) to hand out: its index, or None for the worker to wait a moment."""
        elsewhere = [self._elsewhere(worker, c, now, live) for c in candidates]
        free = [i for i, held in enumerate(elsewhere) if not held]
        if free:
            self.counters.deferred += free[0]
            return free[0]
        if any(not h.produced and now - h.at <= self.wait_s for held in elsewhere for h in held):
            self.counters.waited += 1
            return None
        return 0

    def _elsewhere(self, worker: str, c: Candidate, now: float, live: Callable[[str], bool]) -> list[_Handed]:
        """Who else was given this base split within ``defer_s`` for another job sharing
        blocks with ``c.job``, on a live worker that could produce ``c``'s split too."""
        return [h for h in self._recent.get(c.identity, ()) if h.worker != worker and now - h.at <= self.defer_s
                and h.worker in c.takers and self.sharing(c.job, h.job) and live(h.worker)]

    def handed(self, job: str, identity: SplitIdentity, worker: str, epoch: int, split_id: int, now: float) -> None:
        """A split of ``job`` was given to ``worker``."""
        handed = _Handed(job, worker, now)
        entries = self._recent.pop(identity, [])
        self._recent[identity] = [h for h in entries if h.job != job and now - h.at <= self.defer_s] + [handed]
        self._by_split[(job, epoch, split_id)] = handed
        while len(self._recent) > self.max_recent:
            self._recent.popitem(last=False)
        if len(self._by_split) > 4 * self.max_recent:  # records of splits never reported produced
            kept = {id(h) for hs in self._recent.values() for h in hs}
            self._by_split = {k: h for k, h in self._by_split.items() if id(h) in kept}

    def produced(self, job: str, epoch: int, split_id: int) -> None:
        handed = self._by_split.pop((job, epoch, split_id), None)
        if handed is not None:
            handed.produced = True
