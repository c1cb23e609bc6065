"""The compiled pipelines of the jobs a worker serves (issue 39): a bounded LRU.

A worker of a shared fleet takes split tasks of any of its master's jobs; each names its
job's spec fingerprint, and the worker compiles that job's pipeline the first time (get_spec
with the fingerprint). A compiled pipeline holds kernels and the job's bound spec, not data
(the pieces live in the one buffer, within the worker's byte budget across all jobs), so
keeping a few is cheap and the least recently used goes first.

The jobs held here are also the ones a worker shares work between: the memo
(``core/cache/memo.py``) keeps a block only while two held pipelines read its key.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Optional

from ..core.cache.memo import BlockMemo
from ..core.processor import SplitProcessor

DEFAULT_MAX_PIPELINES = 8  # bounded: the heartbeat's job costs hold at most 16


class Pipelines:
    def __init__(self, capacity: int = DEFAULT_MAX_PIPELINES, memo: Optional[BlockMemo] = None) -> None:
        if capacity < 1:
            raise ValueError(f"a worker holds at least one pipeline, not {capacity}")
        self.capacity = capacity
        self.memo = memo  # told the block keys of the jobs held, whenever they change
        self._by_job: OrderedDict[str, SplitProcessor] = OrderedDict()

    def get(self, fingerprint: str) -> Optional[SplitProcessor]:
        """The job's pipeline if compiled, now the most recently used; None if not."""
        processor = self._by_job.get(fingerprint)
        if processor is not None:
            self._by_job.move_to_end(fingerprint)
        return processor

    def put(self, fingerprint: str, processor: SplitProcessor) -> None:
        self._by_job[fingerprint] = processor
        self._by_job.move_to_end(fingerprint)
        while len(self._by_job) > self.capacity:
            self._by_job.popitem(last=False)
        if self.memo is not None:
            self.memo.set_jobs({fp: p.cache for fp, p in self._by_job.items() if p.cache is not None})

    def items(self) -> Iterator[tuple[str, SplitProcessor]]:
        return iter(list(self._by_job.items()))

    def __contains__(self, fingerprint: str) -> bool:
        return fingerprint in self._by_job
