"""One job's view of the block cache: the keys of its blocks, lookups and background puts.

Only row-local features are cached (``FeaturePipeline.row_local``): a block holds a
feature for a whole base split in stored row order, and the epoch's shuffle is a gather
on read, which is only exact when each output row depends on its input row alone.
Raw blocks are table columns as read (label, passthrough, cached sources), after
table-level sampling; the sampling weights are an internal block beside them, kept apart
(its own key namespace and its own field here), so that no column name can collide with it.

On a worker of a shared fleet the same keys also name blocks in its ``BlockMemo``
(``memo.py``): blocks another job it serves computed moments ago, looked up before the store.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Optional

from ...columns import Column
from ..binding import BoundDataset
from ..plan import SplitTask
from .keys import feature_key, raw_key, sampling_weights_key, split_key
from .segments import MAX_BLOCKS

if TYPE_CHECKING:
    from ...spec import MixedTable
    from .memo import BlockMemo
    from .store import BlockStore
    from .writer import BlockWriter


@dataclass
class CachedBlocks:
    """What a lookup found for one split: features and raw columns by name, and the
    sampling weights (None: not asked for, or not found)."""

    split_key: str
    features: dict[str, Column] = field(default_factory=dict)
    raw: dict[str, Column] = field(default_factory=dict)
    weights: Optional[Column] = None


def job_block_keys(bound: BoundDataset) -> frozenset[str]:
    """Every block key a job's splits may read: its cacheable features, its label and
    passthrough columns, and its sampling weights. Two jobs whose sets meet share work.
    A mix of tables shares none (its splits read several tables: ``JobCache.memo``)."""
    pipeline, spec = bound.pipeline, bound.spec
    if spec.tables:
        return frozenset()
    keys = {feature_key(pipeline, f) for f in pipeline.feature_names if pipeline.row_local(f)}
    keys.update(raw_key(c, bound.schema[c]) for c in ([spec.label] if spec.label else []) + list(spec.passthrough))
    if spec.sampling and spec.sampling.get("weight"):
        keys.add(sampling_weights_key())
    return frozenset(keys)


class JobCache:
    def __init__(self, store: "Optional[BlockStore]", writer: "Optional[BlockWriter]", bound: BoundDataset,
                 memo: "Optional[BlockMemo]" = None) -> None:
        """``store``: the block cache (None: a worker without ``--cache``, whose splits use
        ``memo`` alone); ``memo``: the worker's blocks shared between the jobs it serves."""
        self.store = store
        self.writer = writer
        self._keys = [_TableKeys(bound, mixed) for mixed in bound.spec.tables or (None,)]
        # Shared work is between one-table jobs cut into the same splits: a mix's are not.
        self.memo = memo if not bound.spec.tables else None
        pipeline = bound.pipeline
        self.feature_keys = self._keys[0].features
        self.block_keys = job_block_keys(bound)
        self._pipeline = pipeline
        self._table_path = bound.spec.table.path
        self._split_rows = bound.spec.split_rows
        self._raw = ([bound.spec.label] if bound.spec.label else []) + list(bound.spec.passthrough)
        self._raw_kinds = dict(bound.schema)
        self._weights_key = sampling_weights_key()
        self._sampling = bound.spec.sampling
        self._along: tuple[int, dict[str, int]] = (-1, {})  # (memo generation, read_along's answer)

    def shared_features(self) -> list[str]:
        """The features another job this worker serves also reads (the memo keeps them)."""
        if self.memo is None:
            return []
        shared = self.memo.shared(self.feature_keys.values())
        return [f for f, key in self.feature_keys.items() if key in shared]

    def read_along(self) -> dict[str, int]:
        """The table columns other jobs this worker serves would read from this job's table
        for what they do not share with it (their other features, their label and
        passthrough columns), with how many of them would: a split of this job reads them
        along with its own and keeps them, so the others' splits of it read no table. Only
        jobs cut into the same splits (table, ``split_rows``, sampling) that share a feature."""
        if self.memo is None:
            return {}
        if self._along[0] != self.memo.generation:
            mine = set(self.feature_keys.values())
            counts: dict[str, int] = {}
            for other in self.memo.jobs():
                if (other is self or (other._table_path, other._split_rows, other._sampling) !=
                        (self._table_path, self._split_rows, self._sampling) or not mine & set(other.feature_keys.values())):
                    continue  # splits of other rows, or nothing shared: the master never sends them together
                own = [f for f in other._pipeline.feature_names if other.feature_keys.get(f) not in mine]
                wanted = other._pipeline.columns_for(own) | set(other._raw)
                for c in wanted - set(self._raw):  # this job's label and passthrough are kept anyway
                    if self._raw_kinds.get(c) == other._raw_kinds.get(c) is not None:
                        counts[c] = counts.get(c, 0) + 1
            self._along = (self.memo.generation, counts)
        return self._along[1]

    def take_columns(self, split_key: str, columns: Iterable[str]) -> dict[str, Column]:
        """Those of ``columns`` (table columns, after sampling) another job's split of this
        base split read along for this job (``read_along``)."""
        if self.memo is None:
            return {}
        keys = {self.raw_key(c): c for c in columns}
        return {keys[k]: column for k, column in self.memo.take(split_key, keys).items()}

    def raw_key(self, column: str) -> str:
        """A one-table job's raw block key (the memo's; a mix's come from ``_table``)."""
        return self._keys[0].raw(column)

    def _table(self, task: SplitTask) -> "_TableKeys":
        """The keys of the task's table (a mix names its tables' columns as each stores them)."""
        return self._keys[task.table[0] if task.table is not None and len(self._keys) > 1 else 0]

    def split_key(self, task: SplitTask) -> str:
        return split_key(task.file, task.first_unit, task.stop_unit, task.position, self._sampling)

    def lookup(self, task: SplitTask, features: Iterable[str], raw: Iterable[str],
               weights: bool = False, store: bool = True) -> CachedBlocks:
        """The cached blocks among ``features`` (those that may be cached), ``raw``
        columns and (if ``weights``) the sampling weights: first from the memo, then (with
        ``store``) the rest from the block cache; anything missing, corrupt or slow is
        simply not found."""
        keys = self._table(task)
        wanted = {keys.features[f]: ("feature", f) for f in features if f in keys.features}
        wanted.update({keys.raw(c): ("raw", c) for c in raw})
        if weights:
            wanted[self._weights_key] = ("weights", "")
        blocks = CachedBlocks(self.split_key(task))
        if not wanted:
            return blocks
        found = {} if self.memo is None else self.memo.take(blocks.split_key, wanted.keys())
        rest = [key for key in wanted if key not in found]
        if store and self.store is not None and rest:
            found.update(self.store.lookup(blocks.split_key, rest).found)
        for key, column in found.items():
            kind, name = wanted[key]
            if kind == "weights":
                blocks.weights = column
            else:
                (blocks.features if kind == "feature" else blocks.raw)[name] = column
        return blocks

    def remember(self, key: str, features: Mapping[str, Column], raw: Mapping[str, Column],
                 weights: Optional[Column] = None, along: Mapping[str, Column] = {}) -> None:
        """Keep in the memo, for the other jobs this worker serves, what a split computed or
        read that they read too, and the columns it read along for them (``read_along``)."""
        if self.memo is None:
            return
        blocks = {self.feature_keys[f]: c for f, c in features.items() if f in self.feature_keys}
        blocks.update({self.raw_key(c): column for c, column in raw.items()})
        if weights is not None:
            blocks[self._weights_key] = weights
        readers = self.read_along()
        self.memo.put(key, blocks)
        self.memo.put(key, {self.raw_key(c): column for c, column in along.items()},
                      readers={self.raw_key(c): readers[c] for c in along if c in readers})

    def put(self, task: SplitTask, key: str, features: Mapping[str, Column], raw: Mapping[str, Column],
            weights: Optional[Column] = None) -> None:
        """Queue a new segment of what ``task``'s split computed (with its sampling ``weights``,
        if given) under its split ``key``; never blocks (a full writer drops it)."""
        if self.writer is None or self.store is None:
            return
        keys = self._table(task)
        blocks = {keys.features[f]: c for f, c in features.items() if f in keys.features}
        blocks.update({keys.raw(c): column for c, column in raw.items()})
        if weights is not None:
            blocks[self._weights_key] = weights
        names = sorted(blocks)
        for i in range(0, len(names), MAX_BLOCKS):  # a segment holds at most MAX_BLOCKS: readers bound footers
            self.writer.submit(key, {k: blocks[k] for k in names[i:i + MAX_BLOCKS]})


class _TableKeys:
    """The block keys of one table's columns and features: row-local features by their
    closure, raw columns by name and type, each column named as the table stores it
    (``mixed``: a table of a mix, whose ``columns`` give the job's names other stored ones)."""

    def __init__(self, bound: BoundDataset, mixed: "Optional[MixedTable]") -> None:
        pipeline = bound.pipeline
        stored = mixed.stored if mixed is not None else str
        self.features = {f: feature_key(pipeline, f, stored) for f in pipeline.feature_names if pipeline.row_local(f)}
        self._stored, self._kinds = stored, dict(bound.schema)

    def raw(self, column: str) -> str:
        return raw_key(self._stored(column), self._kinds[column])
