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
        pipeline = bound.pipeline
        self.feature_keys = {f: feature_key(pipeline, f) for f in pipeline.feature_names if pipeline.row_local(f)}
        self._raw_kinds = dict(bound.schema)
        self._weights_key = sampling_weights_key()
        self._sampling = bound.spec.sampling

    def raw_key(self, column: str) -> str:
        return raw_key(column, self._raw_kinds[column])

    def split_key(self, task: SplitTask) -> str:
        return split_key(task.file, task.first_unit, task.stop_unit, task.position, self._sampling)

    def lookup(self, task: SplitTask, features: Iterable[str], raw: Iterable[str],
               weights: bool = False) -> CachedBlocks:
        """The cached blocks among ``features`` (those that may be cached), ``raw``
        columns and (if ``weights``) the sampling weights; anything missing, corrupt or
        slow is simply not found."""
        wanted = {self.feature_keys[f]: ("feature", f) for f in features if f in self.feature_keys}
        wanted.update({self.raw_key(c): ("raw", c) for c in raw})
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

    def put(self, key: str, features: Mapping[str, Column], raw: Mapping[str, Column],
            weights: Optional[Column] = None) -> None:
        """Queue a new segment of what a split computed (with its sampling ``weights``, if
        given); never blocks (a full writer drops it)."""
        if self.writer is None:
            return
        blocks = {self.feature_keys[f]: c for f, c in features.items() if f in self.feature_keys}
        blocks.update({self.raw_key(c): column for c, column in raw.items()})
        if weights is not None:
            blocks[self._weights_key] = weights
        names = sorted(blocks)
        for i in range(0, len(names), MAX_BLOCKS):  # a segment holds at most MAX_BLOCKS: readers bound footers
            self.writer.submit(key, {k: blocks[k] for k in names[i:i + MAX_BLOCKS]})
