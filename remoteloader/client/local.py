"""Local mode: the same spec as an in-process ``IterableDataset``.

    dataset = LocalDataset("spec.yaml")
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=4)

It runs the worker's own split processor, so it yields the same rows and values as
``RemoteDataLoader``; it is the benchmark baseline and the fallback when no service is
wanted. A rank's splits are dealt round robin to the DataLoader's worker processes
(``get_worker_info()``); each of them merges its own split tails, so with N DataLoader
workers up to N batches of an epoch can be short (the DataLoader's usual behaviour for
iterable datasets). Call ``set_epoch(e)`` before each epoch, as with DistributedSampler;
the epoch lives in shared memory, so DataLoader workers kept alive between epochs
(``persistent_workers=True``) see it too.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional, Union

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..core.binding import BoundDataset, bind, bind_schema
from ..core.plan import make_task, plan_epoch, rank_shares
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
        # A shared-memory tensor, not an int: pickled into DataLoader worker processes, it
        # stays the same memory, so set_epoch reaches persistent workers.
        self._epoch = torch.tensor([epoch], dtype=torch.int64).share_memory_()
        self._bound: Optional[BoundDataset] = bound

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        self._epoch[0] = epoch

    def __getstate__(self) -> dict:
        # DataLoader workers rebuild the compiled pipeline from the schema rather than pickling it.
        return {k: v for k, v in self.__dict__.items() if k != "_bound"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._bound = None

    def __len__(self) -> int:
        """Batches of this rank per epoch when read by a single process."""
        shares = rank_shares(sum(s.rows for s in self.base), self.world_size, self.spec.batch_size,
                             self.spec.drop_last, self.spec.even_batches)
        return shares.batches(self.rank, self.spec.batch_size, self.spec.drop_last)

    def __iter__(self) -> Iterator[Batch]:
        if self._bound is None:
            self._bound = bind_schema(self.spec, self.schema)
        processor = SplitProcessor(self._bound)
        info = get_worker_info()
        shard, shards = (info.id, info.num_workers) if info is not None else (0, 1)
        spec, epoch = self.spec, self.epoch
        plan = [s for s in plan_epoch(self.base, epoch, spec.seed, spec.shuffle, self.world_size, spec.batch_size,
                                      spec.drop_last, spec.even_batches) if s.rank == self.rank][shard::shards]
        assembler = EpochAssembler([(s.id, s.rows) for s in plan], self.spec.batch_size, self.spec.drop_last)
        keys = self._bound.sparse_keys
        for split in plan:
            task = make_task(self.files, self.base[split.base], split, epoch)
            for piece in processor.pieces(task):
                batch = Batch.from_numpy(piece.arrays, keys, self._bound.pipeline.sparse_scored)
                assembler.add(piece.split_id, piece.index, batch.as_padding() if split.padding else batch)
                yield from self._drain(assembler)
        yield from self._drain(assembler)

    @staticmethod
    def _drain(assembler: EpochAssembler) -> Iterator[Batch]:
        while (ready := assembler.next_ready()) is not None:
            assembler.consume(ready)
            yield ready.batch
