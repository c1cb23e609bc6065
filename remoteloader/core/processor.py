"""One split in, its pieces out: read, select rows, transform, cut.

The pieces of a split are a pure function of (spec, epoch, split): the row order
comes from ``epoch_rng(seed, epoch, base split)``, so a split re-processed after a
worker failure yields the very same pieces, and the new worker can skip the ones the
client already consumed. Every split yields ``rows // batch_size`` full pieces and,
if rows remain, one short tail piece that the client merges with other tails.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Optional, Sequence

import numpy as np

from .. import jagged
from ..columns import Column, DenseColumn, SparseColumn
from ..formats import DEFAULT_COALESCE_GAP, DataFile, IOStats, TableError, read_split
from ..transforms import sampling_keep, validate_sampling
from .binding import BoundDataset
from .plan import SplitTask, epoch_rng, pieces_of


class SplitError(RuntimeError):
    """A split that cannot be processed; the message names the file, the split and the cause."""


@dataclass
class Piece:
    """Rows ``[lo, hi)`` of a transformed split: piece ``index`` of ``split_id``."""

    split_id: int
    index: int
    rows: int
    source: "TransformedSplit"
    lo: int
    hi: int

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return self.source.arrays(self.lo, self.hi)

    @cached_property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def follows(self, other: "Piece") -> bool:
        """Whether this piece starts where ``other`` ends, in the same split: the two are
        one contiguous range of its arrays (one set of frames on the wire)."""
        return self.source is other.source and self.lo == other.hi


class SplitProcessor:
    def __init__(self, bound: BoundDataset, coalesce_gap: int = DEFAULT_COALESCE_GAP) -> None:
        self.bound = bound
        self.spec = bound.spec
        self.coalesce_gap = coalesce_gap
        self.io = IOStats()  # storage requests and bytes, reported in heartbeats
        self.sampling = validate_sampling(self.spec.sampling) if self.spec.sampling else None

    def pieces(self, task: SplitTask) -> Iterator[Piece]:
        split = self.transform(task)
        size = self.spec.batch_size
        for i in range(task.skip, pieces_of(task.row_hi - task.row_lo, size)):
            lo, hi = i * size, min((i + 1) * size, split.rows)
            yield Piece(task.split_id, i, hi - lo, split, lo, hi)

    def transform(self, task: SplitTask) -> TransformedSplit:
        columns = self._read(task.file, task.first_unit, task.stop_unit, self.bound.read_columns, task.raw_rows,
                             task.describe())
        # The epoch's rows of this split, as indices into the stored rows: sampling first,
        # then the shuffle's order within what sampling kept, composed into one gather.
        selection = self._row_selection(task)
        weights = None
        if self.sampling is not None:
            keep, row_weights = self._keep(columns, task.position, task.raw_rows)
            kept = np.flatnonzero(keep)
            if kept.shape[0] != task.base_rows:
                raise SplitError(f"{task.describe()}: sampling kept {kept.shape[0]} rows, the plan expects {task.base_rows}")
            index = kept[selection]
            columns = {k: c.take(index) for k, c in columns.items()}
            weights = row_weights[index] if self.sampling["weight"] else None
        elif isinstance(selection, slice):
            if (selection.start, selection.stop) != (0, task.raw_rows):
                columns = {k: c.slice(selection.start, selection.stop) for k, c in columns.items()}  # views
        else:
            columns = {k: c.take(selection) for k, c in columns.items()}
        try:
            features = self.bound.pipeline.run(columns)
        except (ValueError, ArithmeticError) as e:
            raise SplitError(f"{task.describe()}: transform failed: {e}") from None
        n = task.row_hi - task.row_lo
        labels = _float_rows(columns[self.spec.label]) if self.spec.label else np.zeros(n, np.float32)
        passthrough = {name: columns[name].values for name in self.spec.passthrough}
        return TransformedSplit.build(features.dense, labels, features.sparse, passthrough, weights, self.spec.batch_size)

    def warm_up(self) -> None:
        """Run the pipeline once on a few synthetic rows so that its kernels are compiled
        (or loaded from numba's cache) before the first split arrives."""
        columns = {name: _synthetic(kind) for name, kind in self.bound.schema.items()
                   if name in self.bound.pipeline.input_columns}
        try:
            features = self.bound.pipeline.run(columns)
            # And the piece layout's copy kernel, for the dtypes this pipeline produces.
            TransformedSplit.build(features.dense, np.zeros(3, np.float32), features.sparse, {}, None, 2)
        except (ValueError, ArithmeticError):
            pass  # synthetic values may not suit every parameter; real splits report real errors

    def _read(self, file: DataFile, first: int, stop: int, names: Sequence[str], rows: int, where: str) -> dict[str, Column]:
        return read_checked(file, first, stop, names, rows, where, self.coalesce_gap, self.io)

    def _keep(self, columns: dict[str, Column], position: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        return sampling_mask(self.sampling, self.spec.label, columns, position, rows)

    def _row_selection(self, task: SplitTask) -> "slice | np.ndarray":
        """This epoch split's rows of the base split (after sampling): a contiguous range
        when not shuffled, else the shuffled order's share."""
        if self.spec.shuffle:
            order = epoch_rng(self.spec.seed, task.epoch, task.base + 1).permutation(task.base_rows)
            return order[task.row_lo : task.row_hi]
        return slice(task.row_lo, task.row_hi)


def read_checked(file: DataFile, first: int, stop: int, names: Sequence[str], rows: int, where: str,
                 coalesce_gap: int = DEFAULT_COALESCE_GAP, io: Optional[IOStats] = None) -> dict[str, Column]:
    """Units ``[first, stop)`` of ``file``, only the named columns; errors name ``where``."""
    try:
        columns = read_split(file, first, stop, names, coalesce_gap=coalesce_gap, io_stats=io)
    except TableError as e:
        raise SplitError(f"{where}: {e}") from None
    got = len(next(iter(columns.values()))) if columns else rows
    if got != rows:
        raise SplitError(f"{where}: read {got} rows, the file's metadata promised {rows}")
    return columns


def sampling_mask(sampling: dict, label: Optional[str], columns: dict[str, Column], position: int,
                  rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(keep, weight) per stored row of a split whose first row has canonical ``position``."""
    labels = columns[label].values if sampling["label_value"] is not None else None
    return sampling_keep(np.arange(position, position + rows, dtype=np.int64), sampling["rate"], sampling["seed"],
                         labels, sampling["label_value"])


def _synthetic(kind: str) -> Column:
    """Three rows of a column of this kind, in the dtypes readers produce."""
    offsets = np.array([0, 2, 2, 3], np.int64)
    if kind == "id_list":
        return SparseColumn(np.array([1, 2, 3], np.int64), offsets)
    if kind == "float_list":
        return SparseColumn(np.array([0.5, 1.0, 2.0], np.float32), offsets)
    if kind == "int":
        return DenseColumn(np.array([1, 2, 3], np.int64))
    return DenseColumn(np.array([0.25, 0.5, 2.0], np.float32))


def _float_rows(column: Column) -> np.ndarray:
    assert isinstance(column, DenseColumn)
    return column.values.astype(np.float32, copy=False)


@dataclass
class TransformedSplit:
    """A whole split after transforms, in the wire's layout: ``tensors`` by their wire names,
    the sparse ones a run of pieces (``jagged``), so the tensors of any run of consecutive
    pieces are views (``arrays(lo, hi)``) and a message of many pieces is one frame per
    tensor, with no copy."""

    tensors: dict[str, np.ndarray]
    keys: int
    piece_rows: int  # the batch size: every piece but a short last one has this many rows
    value_starts: list[int]  # [pieces + 1]: where each piece's sparse values start (Python ints: read per piece)

    @classmethod
    def build(cls, dense: np.ndarray, labels: np.ndarray, sparse: list[SparseColumn],
              passthrough: dict[str, np.ndarray], weights: Optional[np.ndarray], batch_size: int
              ) -> "TransformedSplit":
        run, value_starts = jagged.piece_major(sparse, int(labels.shape[0]), batch_size)
        tensors = {"dense": dense, "labels": labels, jagged.VALUES: run.values, jagged.LENGTHS: run.lengths}
        if run.weights is not None:
            tensors[jagged.WEIGHTS] = run.weights
        tensors.update({"pt." + name: column for name, column in passthrough.items()})
        if weights is not None:  # per-row sampling weights (sampling.weight: true)
            tensors["weights"] = weights
        return cls(tensors, len(sparse), batch_size, value_starts.tolist())

    @property
    def rows(self) -> int:
        return int(self.tensors["labels"].shape[0])

    def arrays(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Rows ``[lo, hi)``, which must start and end on piece boundaries (views)."""
        values = self.value_starts[lo // self.piece_rows], self.value_starts[-(-hi // self.piece_rows)]
        return jagged.take_rows(self.tensors, self.keys, (lo, hi), values)
