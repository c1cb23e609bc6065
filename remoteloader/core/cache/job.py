"""One job's view of the block cache: the keys of its blocks, lookups and background puts.

Only row-local features are cached (``FeaturePipeline.row_local``): a block holds a
feature for a whole base split in stored row order, and the epoch's shuffle is a gather
on read, which is only exact when each output row depends on its input row alone.
Raw blocks are table columns as read (label, passthrough, cached sources), after
table-level sampling; the sampling weights are an internal block beside them, kept apart
(its own key namespace and its own field here), so that no column name can collide with it.
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


class JobCache:
    def __init__(self, store: "BlockStore", writer: "Optional[BlockWriter]", bound: BoundDataset) -> None:
        self.store = store
        self.writer = writer
        self._keys = [_TableKeys(bound, mixed) for mixed in bound.spec.tables or (None,)]
        self._weights_key = sampling_weights_key()
        self._sampling = bound.spec.sampling

    def _table(self, task: SplitTask) -> "_TableKeys":
        """The keys of the task's table (a mix names its tables' columns as each stores them)."""
        return self._keys[task.table[0] if task.table is not None and len(self._keys) > 1 else 0]

    def split_key(self, task: SplitTask) -> str:
        return split_key(task.file, task.first_unit, task.stop_unit, task.position, self._sampling)

    def lookup(self, task: SplitTask, features: Iterable[str], raw: Iterable[str],
               weights: bool = False) -> CachedBlocks:
        """The cached blocks among ``features`` (those that may be cached), ``raw``
        columns and (if ``weights``) the sampling weights; anything missing, corrupt or
        slow is simply not found."""
        keys = self._table(task)
        wanted = {keys.features[f]: ("feature", f) for f in features if f in keys.features}
        wanted.update({keys.raw(c): ("raw", c) for c in raw})
        if weights:
            wanted[self._weights_key] = ("weights", "")
        blocks = CachedBlocks(self.split_key(task))
        if not wanted:
            return blocks
        found = self.store.lookup(blocks.split_key, wanted.keys()).found
        for key, column in found.items():
            kind, name = wanted[key]
            if kind == "weights":
                blocks.weights = column
            else:
                (blocks.features if kind == "feature" else blocks.raw)[name] = column
        return blocks

    def put(self, task: SplitTask, key: str, features: Mapping[str, Column], raw: Mapping[str, Column],
            weights: Optional[Column] = None) -> None:
        """Queue a new segment of what ``task``'s split computed (with its sampling ``weights``,
        if given) under its split ``key``; never blocks (a full writer drops it)."""
        if self.writer is None:
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
