"""One split in, its batches out: read, select rows, transform, cut.

The pieces of a split are a pure function of (spec, epoch, split): the row order
comes from ``epoch_rng(seed, epoch, base split)``, so a split re-processed after a
worker failure yields the very same pieces, and the new worker can skip the ones the
client already consumed. Every split yields ``rows // batch_size`` full batches and,
if rows remain, one short tail piece that the client merges with other tails.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..columns import Column, DenseColumn, SparseColumn
from ..dataset import BoundDataset, file_from_wire
from ..formats import TableError, read_split
from ..master.planner import SplitTask, epoch_rng, pieces_of


class SplitError(RuntimeError):
    """A split that cannot be processed; the message names the file, the split and the cause."""


@dataclass
class Piece:
    split_id: int
    index: int
    rows: int
    arrays: dict[str, np.ndarray]


class SplitProcessor:
    def __init__(self, bound: BoundDataset) -> None:
        self.bound = bound
        self.spec = bound.spec

    def pieces(self, task: SplitTask) -> Iterator[Piece]:
        batch = self.transform(task)
        size = self.spec.batch_size
        for i in range(task.skip, pieces_of(task.row_hi - task.row_lo, size)):
            lo, hi = i * size, min((i + 1) * size, batch.rows)
            yield Piece(task.split_id, i, hi - lo, batch.arrays(lo, hi))

    def transform(self, task: SplitTask) -> "SplitBatch":
        file = file_from_wire(task.file)
        try:
            columns = read_split(file, task.first_unit, task.stop_unit, self.bound.read_columns)
        except TableError as e:
            raise SplitError(f"{task.describe()}: {e}") from None
        got = len(next(iter(columns.values()))) if columns else 0
        if got != task.base_rows:
            raise SplitError(f"{task.describe()}: read {got} rows, the file's metadata promised {task.base_rows}")
        columns = self._select_rows(columns, task)
        try:
            features = self.bound.pipeline.run(columns)
        except (ValueError, ArithmeticError) as e:
            raise SplitError(f"{task.describe()}: transform failed: {e}") from None
        labels = _float_rows(columns[self.spec.label]) if self.spec.label else np.zeros(task.row_hi - task.row_lo, np.float32)
        passthrough = {name: columns[name].values for name in self.spec.passthrough}
        return SplitBatch(features.dense, labels, features.sparse, passthrough)

    def _select_rows(self, columns: dict[str, Column], task: SplitTask) -> dict[str, Column]:
        if self.spec.shuffle:
            order = epoch_rng(self.spec.seed, task.epoch, task.base + 1).permutation(task.base_rows)
            rows = order[task.row_lo : task.row_hi]
            return {k: c.take(rows) for k, c in columns.items()}
        if task.row_lo == 0 and task.row_hi == task.base_rows:
            return columns
        return {k: c.slice(task.row_lo, task.row_hi) for k, c in columns.items()}


def _float_rows(column: Column) -> np.ndarray:
    assert isinstance(column, DenseColumn)
    return column.values.astype(np.float32, copy=False)


@dataclass
class SplitBatch:
    """A whole split after transforms, in wire layout; ``arrays(lo, hi)`` cuts one piece."""

    dense: np.ndarray  # float32 [rows, D]
    labels: np.ndarray  # float32 [rows]
    sparse: list[SparseColumn]
    passthrough: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])

    def arrays(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        out = {"dense": self.dense[lo:hi], "labels": self.labels[lo:hi]}
        # Key-major like torchrec's KeyedJaggedTensor: all rows of feature 0, then feature 1...
        bounds = [(int(c.offsets[lo]), int(c.offsets[hi])) for c in self.sparse]
        out["sparse.values"] = _concat([c.values[a:b] for c, (a, b) in zip(self.sparse, bounds)], np.int64)
        out["sparse.lengths"] = _concat([np.diff(c.offsets[lo : hi + 1]) for c in self.sparse], np.int32)
        if any(c.weights is not None for c in self.sparse):
            out["sparse.weights"] = _concat(
                [c.weights[a:b] if c.weights is not None else np.ones(b - a, np.float32)
                 for c, (a, b) in zip(self.sparse, bounds)], np.float32)
        for name, values in self.passthrough.items():
            out["pt." + name] = values[lo:hi]
        return out


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
