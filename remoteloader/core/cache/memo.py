"""Shared work between the jobs a worker serves (issue 39): a bounded, short-lived memo of blocks.

Two concurrent jobs over the same table with the same features compute the same blocks:
a feature block is a pure function of (split key, block key), the block cache's content
addresses (``keys.py``: the file's identity and the feature's whole closure), whatever the
job, epoch, shuffle or rank. A worker of a shared fleet keeps the blocks it computed for one
job that another job it serves also reads (the keys of two or more of its compiled
pipelines), and the other job's split of the same base split takes them instead of
computing them again. The master sends both jobs' splits of one base split to the same
worker close in time (``master/shared_work.py``), so the memo need only hold a few splits.

It is bounded three ways: by bytes (the oldest blocks go first), by age (``TTL_S``: a block
is a hit only within it, the window the master co-schedules in), and by readers (a block
is dropped once every other job that shares its key has read it). Besides the blocks two
jobs share, a split reads along, from its own table read, the columns another job would
otherwise read from the table for what it does not share (its other features, its label
and passthrough columns: ``JobCache.read_along``): a table's stripe costs about as much to
open and decode for 2 columns as for 10, so the other job's split then opens no file at all.
Keys name the file's
version and the feature's closure, so no block of another file version or another
computation is ever served; the memo is only ever a shortcut to the same values. Columns
are never mutated in place (``columns.py``), so one block can feed several jobs' splits.
One thread (the worker's producer) reads and writes it; counters are read by heartbeats.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Optional

from ...columns import Column
from .writer import column_nbytes

if TYPE_CHECKING:
    from .job import JobCache

TTL_S = 30.0  # a block is shared within this long of being computed (master/shared_work.py co-schedules within it)
DEFAULT_MEMO_BYTES = 256 << 20


@dataclass
class _Entry:
    column: Column
    nbytes: int
    at: float
    readers: int  # other jobs that may still read it


@dataclass
class SharedBlockCounters:
    """Cumulative, as heartbeats report them (``held_bytes`` is the memo's size now)."""

    hits: int = 0  # blocks a job took that another job computed
    hit_bytes: int = 0
    puts: int = 0  # blocks kept for another job
    put_bytes: int = 0
    expired: int = 0  # blocks dropped unread: too old, or pushed out by the byte bound
    held_bytes: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class BlockMemo:
    def __init__(self, max_bytes: int = DEFAULT_MEMO_BYTES, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 0:
            raise ValueError(f"the shared block memo holds at least 0 bytes, not {max_bytes}")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.counters = SharedBlockCounters()
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()  # oldest first
        self._jobs: dict[str, "JobCache"] = {}  # the jobs whose pipelines this worker holds
        self._readers: Counter[str] = Counter()  # block key -> jobs reading it
        self.generation = 0  # changes with the jobs held

    # -- which blocks are shared --------------------------------------------------------
    def set_jobs(self, jobs: Mapping[str, "JobCache"]) -> None:
        """The jobs whose pipelines this worker holds, each with its block keys: a block is
        kept only if another of them reads it too."""
        self._jobs = dict(jobs)
        self._readers = Counter(key for job in self._jobs.values() for key in job.block_keys)
        self.generation += 1

    def jobs(self) -> list["JobCache"]:
        return list(self._jobs.values())

    def shared(self, keys: Iterable[str]) -> set[str]:
        """Those of ``keys`` that two or more held jobs read."""
        return {k for k in keys if self._readers[k] > 1} if self.max_bytes else set()

    # -- blocks -------------------------------------------------------------------------
    def take(self, split_key: str, block_keys: Iterable[str]) -> dict[str, Column]:
        """The held blocks of ``block_keys`` for ``split_key`` (counted as hits); a block
        every sharing job has now read is dropped."""
        self._expire()
        found: dict[str, Column] = {}
        for key in block_keys:
            entry = self._entries.get((split_key, key))
            if entry is None:
                continue
            found[key] = entry.column
            self.counters.hits += 1
            self.counters.hit_bytes += entry.nbytes
            entry.readers -= 1
            if entry.readers <= 0:
                self._drop((split_key, key), expired=False)
        return found

    def put(self, split_key: str, blocks: Mapping[str, Column], readers: Optional[Mapping[str, int]] = None) -> None:
        """Keep the blocks of ``blocks`` that another held job reads (the rest are ignored);
        ``readers``: how many other jobs will read each (else: the other held jobs whose
        block keys name it)."""
        now = self.clock()
        for key, column in blocks.items():
            others = self._readers[key] - 1 if readers is None else readers.get(key, 0)
            if others <= 0 or (split_key, key) in self._entries:
                continue
            nbytes = column_nbytes(column)
            if nbytes > self.max_bytes:
                continue
            self._entries[(split_key, key)] = _Entry(column, nbytes, now, others)
            self.counters.puts += 1
            self.counters.put_bytes += nbytes
            self.counters.held_bytes += nbytes
        self._expire()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        oldest = self.clock() - self.ttl_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.at >= oldest and self.counters.held_bytes <= self.max_bytes:
                return
            self._drop(key, expired=True)

    def _drop(self, key: tuple[str, str], expired: bool) -> None:
        entry = self._entries.pop(key)
        self.counters.held_bytes -= entry.nbytes
        if expired:
            self.counters.expired += 1
