"""Cutting a table into splits, and an epoch into each rank's share of them.

``plan_base_splits`` runs once per job, from file metadata: successive ORC stripes /
Parquet row groups of one file are grouped until a split holds about ``split_rows``
rows, so a worker reads whole units and never a unit twice.

``plan_epoch`` is a pure function of (base splits, epoch, seed, shuffle, the ranks'
shares, and the rows already consumed when an epoch is resumed on another world size):
the master, a restarted master and the tests all compute the same plan, so it is never
journaled. The epoch's rows, taken split by split in (shuffled) order, are cut into
contiguous ranges, one per rank; a split that straddles a boundary is shared by two
ranks as two row ranges of the same base split.

``rank_shares`` sizes those ranges so that, under DDP, every rank yields the same
number of batches (a rank that runs out first hangs the job in its next collective):
see ``even_batches`` in docs/spec.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

import numpy as np

from ..formats import DataFile, Unit
from ..protocol.messages import CacheDirective, FileRecord, SplitTaskRecord, UnitRecord
from .schedule import lane_bounds, pieces_of  # noqa: F401 (pieces_of: imported from here too)


@dataclass(frozen=True)
class BaseSplit:
    id: int
    file: int  # index into the job's file list
    first_unit: int
    stop_unit: int
    rows: int  # rows the split yields: after table-level sampling, if the spec samples
    raw_rows: int  # rows stored in its units
    position: int  # canonical position of its first stored row (files sorted by path)

    def to_wire(self) -> list:
        return [self.file, self.first_unit, self.stop_unit, self.rows, self.raw_rows, self.position]


@dataclass(frozen=True)
class EpochSplit:
    id: int  # unique within the epoch
    rank: int
    base: int  # BaseSplit.id
    row_lo: int  # rows [row_lo, row_hi) of the base split, after its per-epoch shuffle
    row_hi: int
    padding: bool = False  # repeats a row of the epoch to even out batch counts (even_batches: pad)
    table: Optional[tuple[int, int]] = None  # tables mixed by weight: (table, pass) (core/mix.py)
    lane: Optional[tuple[int, int, int]] = None  # tables mixed by weight: its lane key (core/mix.py)

    @property
    def rows(self) -> int:
        return self.row_hi - self.row_lo


@dataclass(frozen=True)
class SplitTask:
    epoch: int
    split_id: int
    rank: int
    base: int
    file: DataFile
    first_unit: int
    stop_unit: int
    raw_rows: int  # rows stored in the units
    position: int  # canonical position of the first of them (sampling hashes it)
    base_rows: int  # rows after sampling: the space row_lo/row_hi index
    row_lo: int
    row_hi: int
    skip: int  # leading pieces already consumed by the client
    # Who the pieces are for: the client session and its epoch run (master-issued), and the job
    # (spec fingerprint) the split belongs to. Empty for local mode, which has no master.
    session: str = ""
    seq: int = 0
    fingerprint: str = ""
    cache: Optional[CacheDirective] = None  # what the split does with the block cache; None: nothing
    order: Optional[list[int]] = None  # (cycle group, slot) in the rank's deterministic schedule; None: arrival order
    lane: Optional[list[int]] = None  # mix_splits: (lane, offset, share) in the rank's lanes (core/schedule.py)
    table: Optional[list[int]] = None  # tables mixed by weight: (table, pass) of the split (core/mix.py)

    def to_wire(self) -> SplitTaskRecord:
        """The task as ``get_split`` answers it: its file lists only the split's units (a
        file of 2,000 stripes would otherwise travel whole with every split)."""
        f = self.file
        units = [UnitRecord(u.index, u.first_row, u.num_rows, u.nbytes)
                 for u in f.unit_range(self.first_unit, self.stop_unit)]
        fields = {k: v for k, v in self.__dict__.items() if k != "file"}
        return SplitTaskRecord(file=FileRecord(f.path, f.format, f.partition, f.num_rows, f.nbytes, units, f.tail_digest,
                                               f.identity), **fields)

    @classmethod
    def from_wire(cls, record: SplitTaskRecord) -> "SplitTask":
        f = record.file
        file = DataFile(f.path, f.format, f.partition, f.num_rows, f.nbytes,
                        tuple(Unit(u.index, u.first_row, u.num_rows, u.nbytes) for u in f.units), f.tail_digest,
                        f.identity)
        fields = {name: getattr(record, name) for name in record.__struct_fields__ if name != "file"}
        return cls(file=file, **fields)

    def describe(self) -> str:
        return f"split {self.split_id} of epoch {self.epoch} ({self.file.path}, units {self.first_unit}..{self.stop_unit - 1})"


def plan_base_splits(files: Sequence[DataFile], split_rows: int) -> list[BaseSplit]:
    splits: list[BaseSplit] = []
    position = 0
    for fi, f in enumerate(files):
        start, rows = 0, 0
        for u in f.units:
            if rows and rows + u.num_rows > split_rows:
                splits.append(BaseSplit(len(splits), fi, start, u.index, rows, rows, position))
                position += rows
                start, rows = u.index, 0
            rows += u.num_rows
        if rows:
            splits.append(BaseSplit(len(splits), fi, start, len(f.units), rows, rows, position))
            position += rows
    return splits


def with_sampled_rows(splits: Sequence[BaseSplit], kept: Sequence[int]) -> list[BaseSplit]:
    """The same splits yielding ``kept[i]`` rows each after table-level sampling."""
    return [replace(s, rows=int(k)) for s, k in zip(splits, kept)]


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    """Deterministic randomness for (seed, epoch, stream); stream 0 orders splits, base id + 1 shuffles rows."""
    return np.random.default_rng([seed, epoch, stream])


@dataclass(frozen=True)
class RankShares:
    """How many rows of an epoch each rank reads."""

    rows: tuple[int, ...]  # real rows per rank, in rank order (contiguous in the epoch's row order)
    padding: tuple[int, ...]  # repeated rows per rank (0 or 1): even_batches "pad"
    dropped: int  # rows of the epoch no rank reads: even_batches "drop", or drop_last

    def batches(self, rank: int, batch_size: int, drop_last: bool) -> int:
        n = self.rows[rank] + self.padding[rank]
        return n // batch_size if drop_last else -(-n // batch_size)


def rank_shares(total: int, world_size: int, batch_size: int = 1, drop_last: bool = False,
                even: str = "off") -> RankShares:
    """Split ``total`` rows between ranks, near-equal, so that batch counts agree when asked.

    Near-equal shares (sizes differ by at most one) already give every rank the same
    number of batches unless the last round of batches holds fewer rows than there are
    ranks (e.g. 20,001 rows, 2 ranks, batches of 1,000: 10,001 and 10,000 rows, 11 and 10
    batches). Then ``pad`` gives each rank left without such a row one repeated row, and
    ``drop`` leaves those few rows out. With ``drop_last`` every rank reads exactly
    ``k * batch_size`` rows, k the batches the smallest share fills.
    """
    near = tuple(total * (r + 1) // world_size - total * r // world_size for r in range(world_size))
    zeros = (0,) * world_size
    if even == "off" or world_size == 1:
        return RankShares(near, zeros, 0)
    if drop_last:
        k = total // (world_size * batch_size)
        return RankShares((k * batch_size,) * world_size, zeros, total - world_size * k * batch_size)
    k = -(-total // (world_size * batch_size))
    last = total - world_size * (k - 1) * batch_size  # rows in the last round of batches
    if last >= world_size:
        return RankShares(near, zeros, 0)
    full = (k - 1) * batch_size
    extra = tuple(last * (r + 1) // world_size - last * r // world_size for r in range(world_size))
    if even == "pad":
        return RankShares(tuple(full + e for e in extra), tuple(1 - e for e in extra), 0)
    return RankShares((full,) * world_size, zeros, last)


Intervals = Mapping[int, Sequence[tuple[int, int]]]  # base split id -> sorted, disjoint [lo, hi) row ranges


def remaining_rows(base: BaseSplit, done: Intervals) -> list[tuple[int, int]]:
    """The row ranges of ``base`` not in ``done`` (rows consumed before a resume)."""
    out, lo = [], 0
    for a, b in done.get(base.id, ()):
        if a > lo:
            out.append((lo, a))
        lo = max(lo, b)
    if lo < base.rows:
        out.append((lo, base.rows))
    return out


def plan_epoch(base: Sequence[BaseSplit], epoch: int, seed: int, shuffle: bool, world_size: int,
               batch_size: int = 1, drop_last: bool = False, even: str = "off",
               done: Optional[Intervals] = None, mix_splits: int = 1, stream: int = 0) -> list[EpochSplit]:
    """Every rank's epoch splits; ``done`` leaves out rows consumed before a resume;
    ``mix_splits`` > 1 cuts each rank's splits at its lanes' boundaries (``cut_into_lanes``);
    ``stream``: the randomness of the split order (a mixed table's pass has its own)."""
    order = epoch_rng(seed, epoch, stream).permutation(len(base)) if shuffle else np.arange(len(base))
    # Epoch splits name their base split by id: ``base`` may be a window of the job's (following a
    # table) or one table's of a mix.
    ranges = [(base[int(i)].id, lo, hi) for i in order for lo, hi in remaining_rows(base[int(i)], done or {})]
    shares = rank_shares(sum(hi - lo for _, lo, hi in ranges), world_size, batch_size, drop_last, even)
    bounds = np.concatenate([[0], np.cumsum(shares.rows)]).tolist()
    out: list[EpochSplit] = []
    pos, rank = 0, 0
    for b, lo, hi in ranges:
        while lo < hi and rank < world_size:
            if pos >= bounds[rank + 1]:
                rank += 1
                continue
            take = min(hi - lo, bounds[rank + 1] - pos)
            out.append(EpochSplit(len(out), rank, b, lo, lo + take))
            lo += take
            pos += take
    if any(shares.padding):
        b, lo, _ = ranges[0]  # the epoch's first row stands in for the missing ones
        for r in range(world_size):
            if shares.padding[r]:
                out.append(EpochSplit(len(out), r, b, lo, lo + 1, padding=True))
    return out if mix_splits == 1 else cut_into_lanes(out, world_size, batch_size, mix_splits)


def cut_into_lanes(splits: Sequence[EpochSplit], world_size: int, batch_size: int,
                   lanes: int) -> list[EpochSplit]:
    """The same rows with each rank's splits (in plan order, its padding last) cut where its
    ``lanes`` lanes begin (``core.schedule.lane_bounds``), as a split is cut where a rank's
    share begins: every split then lies in one lane. Ids are renumbered, rank by rank."""
    by_rank: list[list[EpochSplit]] = [[] for _ in range(world_size)]
    for s in splits:
        by_rank[s.rank].append(s)
    out: list[EpochSplit] = []
    for mine in by_rank:
        bounds = lane_bounds(sum(s.rows for s in mine), batch_size, lanes)[1:-1]
        start = 0  # the split's first row in the rank's sequence
        for s in mine:
            lo = s.row_lo
            for bound in bounds:
                if start < bound < start + s.rows:  # a lane begins inside the split
                    cut = s.row_lo + bound - start
                    out.append(replace(s, id=len(out), row_lo=lo, row_hi=cut))
                    lo = cut
            out.append(replace(s, id=len(out), row_lo=lo))
            start += s.rows
    return out


def make_task(files: Sequence[DataFile], base: BaseSplit, split: EpochSplit, epoch: int, skip: int = 0,
              session: str = "", seq: int = 0, fingerprint: str = "", cache: Optional[CacheDirective] = None,
              order: Optional[tuple[int, int]] = None, lane: Optional[Sequence[int]] = None) -> SplitTask:
    """What a worker needs to produce one epoch split (for the run ``seq`` of client ``session``)."""
    return SplitTask(epoch=epoch, split_id=split.id, rank=split.rank, base=base.id, file=files[base.file],
                     first_unit=base.first_unit, stop_unit=base.stop_unit, raw_rows=base.raw_rows,
                     position=base.position, base_rows=base.rows, row_lo=split.row_lo, row_hi=split.row_hi,
                     skip=skip, session=session, seq=seq, fingerprint=fingerprint, cache=cache,
                     order=None if order is None else list(order), lane=None if lane is None else list(lane),
                     table=None if split.table is None else list(split.table))
