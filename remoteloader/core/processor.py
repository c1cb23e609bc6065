"""One split in, its pieces out: read, select rows, transform, cut.

The pieces of a split are a pure function of (spec, epoch, split): the row order
comes from ``epoch_rng(seed, epoch, base split)``, so a split re-processed after a
worker failure yields the very same pieces, and the new worker can skip the ones the
client already consumed. Every split yields ``rows // batch_size`` full pieces and,
if rows remain, one short tail piece that the client merges with other tails.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import msgspec
import numpy as np

from .. import jagged
from ..columns import Column, DenseColumn, SparseColumn
from ..formats import DEFAULT_COALESCE_GAP, DataFile, IOStats, TableError, read_split
from ..protocol.messages import CacheDirective
from ..transforms import FeatureOutput, sampling_keep, validate_sampling
from .binding import BoundDataset
from .cache.costs import CostMeter
from .mix import row_stream
from .plan import SplitTask, epoch_rng, pieces_of
from .schedule import OrderKey, lane_piece_key, piece_key

if TYPE_CHECKING:
    from .cache.job import JobCache


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
    order: Optional[tuple[int, int, int]] = None  # its key in the rank's deterministic schedule

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
    def __init__(self, bound: BoundDataset, coalesce_gap: int = DEFAULT_COALESCE_GAP,
                 cache: "Optional[JobCache]" = None, io: Optional[IOStats] = None) -> None:
        """``io``: the counters to add this pipeline's reads to (a worker's pipelines of
        several jobs share one set: heartbeats report them, and they never go down)."""
        self.bound = bound
        self.spec = bound.spec
        self.coalesce_gap = coalesce_gap
        self.io = io if io is not None else IOStats()  # storage requests and bytes, reported in heartbeats
        self.sampling = validate_sampling(self.spec.sampling) if self.spec.sampling else None
        self.cache = cache  # None: splits never touch the block cache, whatever their directive
        self.costs = CostMeter()  # per column and feature, reported in heartbeats (the cache policy's input)

    def pieces(self, task: SplitTask) -> Iterator[Piece]:
        split = self.transform(task)
        size = self.spec.batch_size
        for i in range(task.skip, pieces_of(task.row_hi - task.row_lo, size)):
            lo, hi = i * size, min((i + 1) * size, split.rows)
            yield Piece(task.split_id, i, hi - lo, split, lo, hi, self._key(task, i))

    def _key(self, task: SplitTask, piece: int) -> Optional[OrderKey]:
        """The piece's key in its rank's schedule (lanes, or a deterministic cycle); None: none."""
        if task.lane is not None:
            return lane_piece_key(task.lane, piece, self.spec.batch_size)
        return None if task.order is None else piece_key(task.order, piece)

    def transform(self, task: SplitTask) -> TransformedSplit:
        start = time.perf_counter()
        if task.table is not None and self.spec.tables and not task.table[0] < len(self.spec.tables):
            raise TableError(f"{task.describe()}: table {task.table[0]} of a mix of {len(self.spec.tables)} tables: "
                             "the task is not of this job")
        directive, shared = self._directive(task)
        if directive is not None:
            split = self._transform_cached(task, directive, shared)
        else:
            split = self._transform(task)
        self.costs.split(split.rows, time.perf_counter() - start)
        return split

    def _directive(self, task: SplitTask) -> tuple[Optional[CacheDirective], list[str]]:
        """What the split does with blocks: the master's directive for the block cache
        (honoured only with a store), widened by the features another job this worker
        serves also reads (looked up in, and kept for it in, the worker's memo); and those."""
        if self.cache is None:
            return None, []
        stored = task.cache if self.cache.store is not None else None
        shared = self.cache.shared_features()
        if not shared:
            return stored, []
        if stored is None:
            return CacheDirective(features=shared, sources=[], write_features=[], write_sources=[]), shared
        return msgspec.structs.replace(stored, features=list(dict.fromkeys(stored.features + shared))), shared

    def _transform(self, task: SplitTask) -> TransformedSplit:
        """The split without the cache: read, select the epoch's rows, transform them."""
        columns = self._read(task, self.bound.read_columns)
        # The epoch's rows of this split, as indices into the stored rows: sampling first,
        # then the shuffle's order within what sampling kept, composed into one gather.
        selection = self._row_selection(task)
        weights = None
        if self.sampling is not None:
            keep, row_weights = self._keep(columns, task.position, task.raw_rows)
            index = self._kept(task, keep)[selection]
            columns = {k: c.take(index) for k, c in columns.items()}
            weights = row_weights[index] if self.sampling["weight"] else None
        else:
            columns = {k: _select(c, selection, task.raw_rows) for k, c in columns.items()}
        n = task.row_hi - task.row_lo
        done = self._run(task, columns, {})
        return self._build(self.bound.pipeline.assemble(done, n), columns, weights, n)

    def _transform_cached(self, task: SplitTask, directive: CacheDirective,
                          shared: Sequence[str] = ()) -> TransformedSplit:
        """The split through the block cache: cached features and raw columns are looked
        up, only the columns that uncached features still need are read, the rest is
        computed with the cached blocks filled in. A whole split is computed in stored row
        order (what blocks hold, so what it computes can be put) and the epoch's shuffle is
        one gather at the end; a part of a split is gathered first and puts nothing.
        ``shared``: features another job on this worker reads, kept in its memo for it (with
        the columns it would read of this split, read along); such a split looks in the memo
        for the columns it needs too."""
        assert self.cache is not None
        spec, pipeline = self.spec, self.bound.pipeline
        weighted = self.sampling is not None and self.sampling["weight"]
        raw_names = list(dict.fromkeys(([spec.label] if spec.label else []) + list(spec.passthrough)
                                       + list(directive.sources)))
        store = self.cache.store is not None and task.cache is not None
        blocks = self.cache.lookup(task, directive.features, raw_names, weights=weighted, store=store)
        weights = blocks.weights
        missing = [f for f in pipeline.feature_names if f not in blocks.features]
        need = pipeline.columns_for(missing, blocks.features)
        need.update(c for c in raw_names if c not in directive.sources)
        need -= blocks.raw.keys()
        if shared and need:  # columns another job's split of this base split read along for this job
            blocks.raw.update(self.cache.take_columns(blocks.split_key, need))
            need -= blocks.raw.keys()
        # The whole split is computed in stored order (what blocks hold) when it is the
        # task, or when the task is its first part and blocks are to be written, so that a
        # split cut between ranks is cached too; another part gathers its rows first.
        writing = bool(directive.write_features or directive.write_sources)
        in_order = (task.row_lo, task.row_hi) == (0, task.base_rows) or ((writing or bool(shared)) and task.row_lo == 0)
        # A split that reads the table anyway reads along what the other jobs sharing its
        # blocks would read of it (opening a stripe costs most of reading it), and keeps it.
        along = set(self.cache.read_along()) - need - set(raw_names) if shared and need and in_order else set()
        sample = self.sampling is not None and bool(need or (weighted and weights is None))
        if sample and self.sampling["label_value"] is not None:
            need.add(spec.label)  # the sampling mask compares the stored labels
        columns = self._read(task, sorted(need | along)) if need else {}
        if sample:
            keep, row_weights = self._keep(columns, task.position, task.raw_rows)
            kept = self._kept(task, keep)
            columns = {k: c.take(kept) for k, c in columns.items()}
            if weighted and weights is None:
                weights = DenseColumn(row_weights[kept])
        base = {**blocks.raw, **columns}  # the base split's rows (after sampling), stored order
        selection = self._row_selection(task)
        given = blocks.features
        if not in_order:
            base = {k: _select(c, selection, task.base_rows) for k, c in base.items()}
            given = {k: _select(c, selection, task.base_rows) for k, c in given.items()}
            weights = None if weights is None else _select(weights, selection, task.base_rows)
        done = self._run(task, base, given)
        if in_order and writing:
            computed = {f: done[f] for f in directive.write_features if f in done and f not in given}
            stored = set(directive.write_sources) | {c for c in raw_names if c not in directive.sources}
            raw = {c: base[c] for c in stored if c in columns}
            self.cache.put(task, blocks.split_key, computed, raw, weights if blocks.weights is None else None)
        if in_order and shared:
            self.cache.remember(blocks.split_key, {f: done[f] for f in shared if f not in given},
                                {c: base[c] for c in raw_names if c in columns},
                                weights if blocks.weights is None else None, {c: columns[c] for c in along})
        rows = task.row_hi - task.row_lo
        features = pipeline.assemble(done, task.base_rows if in_order else rows)
        if in_order and not _is_all(selection, task.base_rows):
            features = FeatureOutput(features.dense[selection],
                                     [_select(c, selection, task.base_rows) for c in features.sparse])
            base = {k: _select(base[k], selection, task.base_rows) for k in raw_names if k in base}
            weights = None if weights is None else _select(weights, selection, task.base_rows)
        return self._build(features, base, None if weights is None else weights.values, rows)

    def _run(self, task: SplitTask, columns: dict[str, Column], given: dict[str, Column]) -> dict[str, Column]:
        seconds: dict[str, float] = {}
        try:
            done = self.bound.pipeline.run_nodes(columns, given, seconds)
        except (ValueError, ArithmeticError) as e:
            raise SplitError(f"{task.describe()}: transform failed: {e}") from None
        self.costs.transformed(seconds, done)
        return done

    def _build(self, features: FeatureOutput, columns: dict[str, Column], weights: Optional[np.ndarray],
               rows: int) -> TransformedSplit:
        labels = _float_rows(columns[self.spec.label]) if self.spec.label else np.zeros(rows, np.float32)
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

    def _read(self, task: SplitTask, names: Sequence[str]) -> dict[str, Column]:
        start = time.perf_counter()
        mixed = self.spec.tables[task.table[0]] if task.table is not None and self.spec.tables else None
        stored = [mixed.stored(n) for n in names] if mixed is not None else list(names)
        columns = read_checked(task.file, task.first_unit, task.stop_unit, list(dict.fromkeys(stored)), task.raw_rows,
                               task.describe(), self.coalesce_gap, self.io)
        if mixed is not None:  # the table's columns under the job's names (tables[i].columns)
            columns = {name: columns[s] for name, s in zip(names, stored)}
        self.costs.read(columns, time.perf_counter() - start)
        return columns

    def _kept(self, task: SplitTask, keep: np.ndarray) -> np.ndarray:
        kept = np.flatnonzero(keep)
        if kept.shape[0] != task.base_rows:
            raise SplitError(f"{task.describe()}: sampling kept {kept.shape[0]} rows, the plan expects {task.base_rows}")
        return kept

    def _keep(self, columns: dict[str, Column], position: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        return sampling_mask(self.sampling, self.spec.label, columns, position, rows)

    def _row_selection(self, task: SplitTask) -> "slice | np.ndarray":
        """This epoch split's rows of the base split (after sampling): a contiguous range
        when not shuffled, else the shuffled order's share."""
        if self.spec.shuffle:
            order = epoch_rng(self.spec.seed, task.epoch, row_stream(task.base, task.table)).permutation(task.base_rows)
            return order[task.row_lo : task.row_hi]
        return slice(task.row_lo, task.row_hi)


def _select(column: Column, selection: "slice | np.ndarray", rows: int) -> Column:
    """The rows ``selection`` picks: views for a range, no copy at all for every row."""
    if _is_all(selection, rows):
        return column
    if isinstance(selection, slice):
        return column.slice(selection.start, selection.stop)
    return column.take(selection)


def _is_all(selection: "slice | np.ndarray", rows: int) -> bool:
    return isinstance(selection, slice) and (selection.start, selection.stop) == (0, rows)


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
