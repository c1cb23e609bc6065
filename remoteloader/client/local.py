"""Local mode: the same spec as an in-process ``IterableDataset``.

    dataset = LocalDataset("spec.yaml")
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=4)

It runs the worker's own split processor, so it yields the same rows and values as
``RemoteDataLoader``; it is the benchmark baseline and the fallback when no service is
wanted. Call ``set_epoch(e)`` before each epoch, as with DistributedSampler; the epoch
lives in shared memory, so DataLoader workers kept alive between epochs
(``persistent_workers=True``) see it too.

DataLoader workers are dealt rows, not splits. Every worker computes the same plan; the
rank's epoch is its splits' rows in plan order (padding rows last), cut into the
``len()`` batches a single process would yield, and worker ``k`` of ``n`` takes the
contiguous run of batches ``[len * k // n, len * (k + 1) // n)``: the splits, or the
parts of splits, that hold those rows. A split straddling two runs is read by both
workers, each for its own rows. Every run but the last is whole batches, so a worker
merges its split tails into full batches and only the last run can end short (or drop
its remainder with ``drop_last``). So a rank yields exactly ``len()`` batches with any
number of DataLoader workers, and under DDP (``even_batches``) every rank yields the
same number, each selected row exactly once.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..core.binding import BoundDataset, bind, bind_schema
from ..core.plan import EpochSplit, make_task, pieces_of, plan_epoch, rank_shares
from ..core.mix import plan_mixed_epoch
from ..core.schedule import lane_bounds, lane_piece_key, lane_schedule, proportional
from ..core.cache.job import JobCache
from ..core.cache.location import ENV_CACHE, allowed_caches, open_cache, user_cache_dir
from ..core.cache.writer import BlockWriter
from ..core.processor import SplitProcessor
from ..protocol import auth as cluster_auth
from ..protocol.auth import ENV_AUTH
from ..protocol.messages import CacheDirective
from ..core.sampling import plan_job_splits
from ..spec import DatasetSpec, SpecError, load_spec
from .assembly import EpochAssembler
from .batch import Batch
from .embedded import resolve_rank

CLOSE_WRITER_S = 60.0


class LocalDataset(IterableDataset):
    def __init__(self, spec: Union[DatasetSpec, dict, str, os.PathLike], *, rank: Optional[int] = None,
                 world_size: Optional[int] = None, epoch: int = 0, cache: Optional[str] = None) -> None:
        """``cache``: the block cache's location (else ``$REMOTELOADER_CACHE``, else this
        user's cache directory if the spec has a ``cache`` section); see ``_directive``."""
        self.spec = load_spec(spec)
        if self.spec.table.follow is not None:
            raise SpecError("table.follow: a LocalDataset reads a fixed table; following a growing table needs a "
                            "master, which journals what each re-listing adds (RemoteDataLoader)")
        self.cache = None if self.spec.cache_mode == "off" else (
            cache or os.environ.get(ENV_CACHE) or (user_cache_dir() if self.spec.cache is not None else None))
        self.rank, self.world_size = resolve_rank(rank, world_size)
        bound = bind(self.spec)
        self.schema = bound.schema
        self.files = list(bound.files or [])
        self.file_tables = list(bound.file_tables)
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
        """Batches of this rank per epoch, whatever the number of DataLoader workers."""
        if self.spec.tables:  # a mix's rows per rank are the same every epoch (core/mix.py)
            rows = sum(s.rows for s in self._plan(0))
            return rows // self.spec.batch_size if self.spec.drop_last else -(-rows // self.spec.batch_size)
        shares = rank_shares(sum(s.rows for s in self.base), self.world_size, self.spec.batch_size,
                             self.spec.drop_last, self.spec.even_batches)
        return shares.batches(self.rank, self.spec.batch_size, self.spec.drop_last)

    def __iter__(self) -> Iterator[Batch]:
        if self._bound is None:
            self._bound = bind_schema(self.spec, self.schema)
        cache = self._open_cache()
        processor = SplitProcessor(self._bound, cache=cache)
        directive = None if cache is None else _directive(self.spec, self._bound.pipeline.feature_names)
        info = get_worker_info()
        shard, shards = (info.id, info.num_workers) if info is not None else (0, 1)
        spec, epoch = self.spec, self.epoch
        mine = self._plan(epoch)
        rows = sum(s.rows for s in mine)
        batches = rows // spec.batch_size if spec.drop_last else -(-rows // spec.batch_size)
        first, stop = batches * shard // shards, batches * (shard + 1) // shards
        plan = _mixed_between(mine, first, stop) if spec.tables else \
            _batches_between(mine, spec.batch_size, spec.mix_splits, first, stop)
        # One reader of the rank's whole plan yields the deterministic schedule's sequence (the
        # same as RemoteDataLoader's); several DataLoader workers each take a run of batches.
        # Mixed batches are the lanes' schedule's in any case (the run's own lanes).
        lanes = {s.id: s.lane for s in plan} if spec.tables else None
        assembler = EpochAssembler([(s.id, s.rows) for s in plan], spec.batch_size, spec.drop_last,
                                   cycle=spec.cycle if shards == 1 else None,
                                   padding=[s.id for s in plan if s.padding], mix_splits=spec.mix_splits, lanes=lanes)
        keys = self._bound.sparse_keys
        by_id = {s.id: s for s in plan}
        try:
            # Splits are read in the order their pieces are needed: with lanes, one split of each
            # lane at a time (as workers hold them), so no lane waits for another's whole split.
            producing: dict[int, Iterator] = {}
            for sid, _ in _piece_order(plan, spec.batch_size, spec.mix_splits, lanes):
                split = by_id[sid]
                if sid not in producing:
                    task = make_task(self.files, self.base[split.base], split, epoch, cache=directive)
                    producing[sid] = processor.pieces(task)
                piece = next(producing[sid])  # a split's pieces come in order, as the schedule takes them
                if piece.index == pieces_of(split.rows, spec.batch_size) - 1:
                    del producing[sid]
                batch = Batch.from_numpy(piece.arrays, keys, self._bound.pipeline.sparse_scored)
                assembler.add(piece.split_id, piece.index, batch.as_padding() if split.padding else batch)
                yield from self._drain(assembler)
            yield from self._drain(assembler)
        finally:
            if cache is not None:
                cache.writer.close(CLOSE_WRITER_S)  # this process may end with the epoch: finish the puts
                cache.store.close()

    def _plan(self, epoch: int) -> list[EpochSplit]:
        """This rank's splits of ``epoch``, in plan order."""
        spec = self.spec
        if spec.tables:
            mixed = plan_mixed_epoch(self.base, [self.file_tables[b.file] for b in self.base],
                                     [t.weight for t in spec.tables], [t.when_done for t in spec.tables], epoch,
                                     spec.seed, spec.shuffle, self.world_size, spec.batch_size, spec.even_batches)
            return mixed[self.rank].splits
        return [s for s in plan_epoch(self.base, epoch, spec.seed, spec.shuffle, self.world_size, spec.batch_size,
                                      spec.drop_last, spec.even_batches, mix_splits=spec.mix_splits)
                if s.rank == self.rank]

    def _open_cache(self) -> Optional[JobCache]:
        if self.cache is None:
            return None
        auth_dir = os.environ.get(ENV_AUTH)
        store = open_cache(self.cache, allowed_caches(None), cluster_auth.load(auth_dir) if auth_dir else None)
        return JobCache(store, BlockWriter(store), self._bound)

    @staticmethod
    def _drain(assembler: EpochAssembler) -> Iterator[Batch]:
        while (ready := assembler.next_ready()) is not None:
            assembler.consume(ready)
            yield ready.batch


def _directive(spec: DatasetSpec, features: Sequence[str]) -> Optional[CacheDirective]:
    """Local mode has no master, so no measured policy: ``auto`` writes what it computes
    when the spec expects more than one epoch and only reads otherwise; ``read`` reads;
    ``write-all`` reads and writes."""
    mode = spec.cache_mode
    write = mode == "write-all" or (mode == "auto" and spec.expected_epochs > 1)
    return CacheDirective(features=list(features), sources=[], write_features=list(features) if write else [],
                          write_sources=[])


def _piece_order(splits: Sequence[EpochSplit], batch_size: int, mix_splits: int,
                 lanes: Optional[Mapping[int, Sequence[int]]] = None) -> list[tuple[int, int]]:
    """(split id, piece) of ``splits`` in the order the assembler routes them."""
    if lanes is not None:
        return sorted(((s.id, i) for s in splits for i in range(pieces_of(s.rows, batch_size))),
                      key=lambda sp: lane_piece_key(lanes[sp[0]], sp[1], batch_size))
    if mix_splits > 1:
        return lane_schedule([(s.id, s.rows) for s in splits], batch_size, mix_splits)
    return [(s.id, i) for s in splits for i in range(pieces_of(s.rows, batch_size))]


def _batches_between(splits: Sequence[EpochSplit], batch_size: int, mix_splits: int, first: int,
                     stop: int) -> list[EpochSplit]:
    """The rows of the rank's batches ``[first, stop)`` (``splits`` its plan): a run of its
    row sequence, or with lanes, that run of every lane (batch b takes rows
    ``[b * share, (b + 1) * share)`` of lane j, and the short last batch the lanes' rest). The
    result's lanes are those runs, so its own mixed batches are the rank's."""
    rows = sum(s.rows for s in splits)
    if mix_splits == 1:
        return _rows_between(splits, first * batch_size, min(stop * batch_size, rows))
    bounds, full = lane_bounds(rows, batch_size, mix_splits), rows // batch_size
    out: list[EpochSplit] = []
    for j, share in enumerate(proportional(batch_size, mix_splits)):
        hi = bounds[j + 1] if stop > full else bounds[j] + stop * share
        out += _rows_between(splits, bounds[j] + first * share, hi)
    return out


def _mixed_between(splits: Sequence[EpochSplit], first: int, stop: int) -> list[EpochSplit]:
    """A mix of tables' rows of batches ``[first, stop)``: of each split with lane key (t, o, c),
    the rows its segment gives those batches, keyed as if batch ``first`` were the first."""
    out = []
    for s in splits:
        table, offset, share = s.lane
        lo, hi = max(0, first * share - offset), min(s.rows, stop * share - offset)
        if lo < hi:
            out.append(replace(s, row_lo=s.row_lo + lo, row_hi=s.row_lo + hi,
                               lane=(table, offset + lo - first * share, share)))
    return out


def _rows_between(splits: Sequence[EpochSplit], lo: int, hi: int) -> list[EpochSplit]:
    """Rows ``[lo, hi)`` of the concatenated ``splits``, as the splits (narrowed to their part) that hold them."""
    starts = np.cumsum([0, *(s.rows for s in splits)]).tolist()
    out = []
    for split, start in zip(splits, starts):
        a, b = max(lo, start), min(hi, start + split.rows)
        if a < b:
            out.append(replace(split, row_lo=split.row_lo + a - start, row_hi=split.row_lo + b - start))
    return out
