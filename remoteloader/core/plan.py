"""Cutting a table into splits, and an epoch into each rank's share of them.

``plan_base_splits`` runs once per job, from file metadata: successive ORC stripes /
Parquet row groups of one file are grouped until a split holds about ``split_rows``
rows, so a worker reads whole units and never a unit twice.

``plan_epoch`` is a pure function of (base splits, epoch, seed, shuffle, world size):
the master, a restarted master and the tests all compute the same plan, so it is never
journaled. The epoch's rows, taken split by split in (shuffled) order, are cut into
``world_size`` contiguous ranges whose sizes differ by at most one row; a split that
straddles a boundary is shared by two ranks as two row ranges of the same base split.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

from ..formats import DataFile


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

    def to_wire(self) -> dict:
        return {**self.__dict__, "file": self.file.to_wire()}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> "SplitTask":
        ints = ("epoch", "split_id", "rank", "base", "first_unit", "stop_unit", "raw_rows", "position", "base_rows",
                "row_lo", "row_hi", "skip")
        if set(data) != set(ints) | {"file"} or not all(type(data[k]) is int for k in ints):
            raise ValueError(f"malformed split task: {sorted(data)}")
        return cls(**{**data, "file": DataFile.from_wire(data["file"])})

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


def rank_rows(total_rows: int, world_size: int, rank: int) -> int:
    return total_rows * (rank + 1) // world_size - total_rows * rank // world_size


def plan_epoch(base: Sequence[BaseSplit], epoch: int, seed: int, shuffle: bool, world_size: int) -> list[EpochSplit]:
    order = epoch_rng(seed, epoch).permutation(len(base)) if shuffle else np.arange(len(base))
    total = sum(s.rows for s in base)
    bounds = [total * r // world_size for r in range(world_size + 1)]
    out: list[EpochSplit] = []
    pos, rank = 0, 0
    for i in order:
        s = base[int(i)]
        lo = 0
        while lo < s.rows:
            while pos >= bounds[rank + 1]:
                rank += 1
            take = min(s.rows - lo, bounds[rank + 1] - pos)
            out.append(EpochSplit(len(out), rank, s.id, lo, lo + take))
            lo += take
            pos += take
    return out


def make_task(files: Sequence[DataFile], base: BaseSplit, split: EpochSplit, epoch: int, skip: int = 0) -> SplitTask:
    """What a worker needs to produce one epoch split."""
    return SplitTask(epoch=epoch, split_id=split.id, rank=split.rank, base=base.id, file=files[base.file],
                     first_unit=base.first_unit, stop_unit=base.stop_unit, raw_rows=base.raw_rows,
                     position=base.position, base_rows=base.rows, row_lo=split.row_lo, row_hi=split.row_hi,
                     skip=skip)


def pieces_of(rows: int, batch_size: int) -> int:
    """A split's rows travel as full batches plus one short tail piece."""
    return -(-rows // batch_size)
