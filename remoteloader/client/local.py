"""Local mode: the same spec as an in-process ``IterableDataset``.

    dataset = LocalDataset("spec.yaml")
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=4)

It runs the worker's own split processor, so it yields the same rows and values as
``RemoteDataLoader``; it is the benchmark baseline and the fallback when no service is
wanted. A rank's splits are dealt round robin to the DataLoader's worker processes
(``get_worker_info()``); each of them merges its own split tails, so with N DataLoader
workers up to N batches of an epoch can be short (the DataLoader's usual behaviour for
iterable datasets). Call ``set_epoch(e)`` before each epoch, as with DistributedSampler.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional, Union

from torch.utils.data import IterableDataset, get_worker_info

from ..core.binding import BoundDataset, bind, bind_schema
from ..core.plan import make_task, plan_epoch, rank_rows
from ..core.processor import SplitProcessor
from ..core.sampling import plan_job_splits
from ..spec import DatasetSpec, load_spec
from .assembly import EpochAssembler
from .batch import Batch
from .embedded import resolve_rank


class LocalDataset(IterableDataset):
    def __init__(self, spec: Union[DatasetSpec, dict, str, os.PathLike], *, rank: Optional[int] = None,
                 world_size: Optional[int] = None, epoch: int = 0) -> None:
        self.spec = load_spec(spec)
        self.rank, self.world_size = resolve_rank(rank, world_size)
        bound = bind(self.spec)
        self.schema = bound.schema
        self.files = list(bound.files or [])
        self.base = plan_job_splits(bound)
        self.epoch = epoch
        self._bound: Optional[BoundDataset] = bound

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getstate__(self) -> dict:
        # DataLoader workers rebuild the compiled pipeline from the schema rather than pickling it.
        return {k: v for k, v in self.__dict__.items() if k != "_bound"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._bound = None

    def __len__(self) -> int:
        """Batches of this rank per epoch when read by a single process."""
        rows = rank_rows(sum(s.rows for s in self.base), self.world_size, self.rank)
        bs = self.spec.batch_size
        return rows // bs if self.spec.drop_last else -(-rows // bs)

    def __iter__(self) -> Iterator[Batch]:
        if self._bound is None:
            self._bound = bind_schema(self.spec, self.schema)
        processor = SplitProcessor(self._bound)
        info = get_worker_info()
        shard, shards = (info.id, info.num_workers) if info is not None else (0, 1)
        plan = [s for s in plan_epoch(self.base, self.epoch, self.spec.seed, self.spec.shuffle, self.world_size)
                if s.rank == self.rank][shard::shards]
        assembler = EpochAssembler([(s.id, s.rows) for s in plan], self.spec.batch_size, self.spec.drop_last)
        keys = self._bound.sparse_keys
        for split in plan:
            task = make_task(self.files, self.base[split.base], split, self.epoch)
            for piece in processor.pieces(task):
                assembler.add(piece.split_id, piece.index, Batch.from_numpy(piece.arrays, keys))
                yield from self._drain(assembler)
        yield from self._drain(assembler)

    @staticmethod
    def _drain(assembler: EpochAssembler) -> Iterator[Batch]:
        while (ready := assembler.next_ready()) is not None:
            assembler.consume(ready)
            yield ready.batch
