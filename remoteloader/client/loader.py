"""``RemoteDataLoader``: iterate batches preprocessed by remote workers, like a DataLoader.

    with RemoteDataLoader("spec.yaml") as loader:        # embedded master + local workers
        for epoch in range(3):
            for batch in loader:                         # one epoch per iteration
                loss = model(batch.dense_features, batch.sparse_features)

Each ``iter(loader)`` starts the next epoch for this rank: the master answers with the
rank's splits, workers of the rank's partition stream their pieces, and an
``EpochAssembler`` turns them into batches of exactly ``batch_size`` rows (the last
batch of the epoch may be short, or is dropped with ``drop_last``).
"""
from __future__ import annotations

import logging
import os
import warnings
import weakref
from typing import Any, Generator, Iterator, Optional, Union

import torch
import zmq

from . import jobname, resume, staging
from .arena import ArenaLinks
from .assembly import EpochAssembler
from .batch import Batch
from .credit import CreditWindow
from .embedded import EmbeddedCluster, resolve_rank
from .placement import MasterPlacement
from .epoch import EpochPlan, EpochRun
from .position import Position
from .session import ClientSession
from .stats import ClientStats
from .stream import EpochStream, StreamConfig
from ..protocol import auth as cluster_auth
from ..protocol.messages import JobInfo
from ..protocol.rpc import RpcClient
from ..spec import DatasetSpec, load_spec

log = logging.getLogger(__name__)
GOODBYE_S = 2.0  # a goodbye is a courtesy (the master times a silent client out): never wait long


class EpochIterator:
    """The iterator of one ``iter(loader)``. Replaced by a newer ``iter()``, it raises rather
    than stop: a plain ``StopIteration`` would look like a short epoch."""

    def __init__(self, batches: Generator[Batch, None, None], epoch: int) -> None:
        self._batches, self.epoch = batches, epoch
        self._replaced = False

    def __iter__(self) -> "EpochIterator":
        return self

    def __next__(self) -> Batch:
        if self._replaced:
            raise RuntimeError(f"this iterator of epoch {self.epoch} was replaced by a newer iter() of the "
                               "RemoteDataLoader, which took over its data: iterate the newest one")
        return next(self._batches)

    def replace(self) -> None:
        self._replaced = True
        self._batches.close()

    def close(self) -> None:
        self._batches.close()


class RemoteDataLoader:
    """A DataLoader whose batches come from remoteloader workers.

    Args:
        spec: a ``DatasetSpec``, its dict form, or the path of a YAML/JSON spec.
        master: ``tcp://host:port`` of a running master; ``None`` starts an embedded one.
        num_workers: local workers of the embedded master (default: CPU count); in a multi-node
            job, the workers of each node.
        batch_size, shuffle, seed, drop_last, even_batches: override the spec's values.
            ``even_batches`` ("pad", the default, "drop", or "off"; True/False mean pad/off)
            gives every rank the same number of batches per epoch, as DDP needs.
        rank, world_size: this trainer's share; default from torch.distributed, then the
            ``RANK``/``WORLD_SIZE`` environment variables, then 0/1.
        pin_memory: return batches in pinned memory (ignored with a warning without an accelerator):
            a staging thread copies each batch once into reused pinned slabs as it arrives, so
            the training thread gets it already pinned (see ``staging.py``). A slab is reused
            once no tensor of its batch is referenced any more.
        pin_bytes: the most pinned memory staging holds (default: ``prefetch_bytes``); when
            it is all in use the staging thread waits for batches to be released.
        device: ``"cuda"`` (or ``"cuda:N"``): hand out batches already on that device, copied
            from pinned slabs on a side CUDA stream while the model trains on the current
            batch (the current stream waits for the copy; ``record_stream`` keeps its memory).
            ``None`` or ``"cpu"``: no copy. Without CUDA, a CUDA device is a ``ValueError``.
        inflight: pieces of credit per worker to start with; the client grows its credit
            window while the training loop waits on batches a worker holds but may not send,
            and shrinks it back (never below this) while its queue of batches never empties.
        prefetch_bytes: the most the credit window may hold (batches in flight and queued).
        timeout: seconds without any progress (no batch, no master answer) before an error.
        connect_timeout: seconds to wait for the master's first answer.
        auth: key directory (``remoteloader keygen DIR``) of a cluster started with ``--auth``;
            default ``$REMOTELOADER_AUTH``. The embedded default needs none: it talks over
            Unix sockets in a private 0700 directory (with a directory given, CURVE runs on
            them too); a multi-node job's master is keyed with a per-job key set that rank 0
            makes and shares through torch.distributed's store, unless a directory is given.
        job: the job's name on a shared fleet (a master without ``--spec``): loaders of one spec
            are one job only under one name, so a sweep's trials of the same spec run side by
            side, each getting every row once. Default: torchrun's ``TORCHELASTIC_RUN_ID``, else
            under torch.distributed a name the ranks agree on through its store, else none (the
            spec alone). Every rank of a job must give the same; a master of one job ignores it.
            See ``jobname.py``.
    """

    def __init__(self, spec: Union[DatasetSpec, dict, str, os.PathLike], *, master: Optional[str] = None,
                 num_workers: Optional[int] = None, batch_size: Optional[int] = None,
                 shuffle: Optional[bool] = None, seed: Optional[int] = None, drop_last: Optional[bool] = None,
                 even_batches: Union[bool, str, None] = None, rank: Optional[int] = None, world_size: Optional[int] = None, pin_memory: bool = False,
                 inflight: int = 2, prefetch_bytes: int = 256 << 20, timeout: float = 300.0,
                 connect_timeout: float = 60.0,
                 auth: Union[str, os.PathLike, None] = None, device: Union[str, torch.device, None] = None,
                 pin_bytes: Optional[int] = None, job: Optional[str] = None) -> None:
        spec = load_spec(spec)
        if isinstance(even_batches, bool):
            even_batches = "pad" if even_batches else "off"
        overrides = {k: v for k, v in dict(batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                            even_batches=even_batches).items() if v is not None}
        self.spec = spec.replace(**overrides) if overrides else spec
        self.rank, self.world_size = resolve_rank(rank, world_size)
        # ValueError for a name that is none, before anything starts.
        named = jobname.resolve_job_name(job, self.spec.fingerprint(), self.rank, self.world_size)
        self.job, self._job_given = named.name, named.given
        # Its slot of the spec's open loaders is free again at close (or if never closed, once collected).
        self._job_slot = weakref.finalize(self, jobname.release, self.spec.fingerprint(), named.slot)
        self.batch_size = self.spec.batch_size
        self.drop_last = self.spec.drop_last
        self.timeout, self.connect_timeout = timeout, connect_timeout
        # Kept across epochs: what it learned holds. Lanes: the sources each batch mixes.
        self.credit = CreditWindow(inflight, prefetch_bytes, lanes=max(self.spec.mix_splits, len(self.spec.tables)))
        self.device = staging.resolve_device(device)  # None: batches stay on the host
        self.pin_memory = pin_memory and self._can_pin()
        # Pinned slabs for the staging thread, reused across epochs (None: no staging).
        self.pin_pool = staging.SlabPool(pin_bytes if pin_bytes is not None else prefetch_bytes) \
            if self.pin_memory or self.device is not None else None
        self.pin_stats = staging.StagingStats() if self.pin_pool is not None else None
        auth_dir = os.fspath(auth) if auth is not None else os.environ.get(cluster_auth.ENV_AUTH) or None
        if auth_dir:
            cluster_auth.load(auth_dir)  # AuthError (a ValueError, one line) before anything starts
        self._placement = MasterPlacement.resolve(self, self.spec, self.rank, self.world_size, master, num_workers,
                                                  auth_dir, connect_timeout)
        self.master = master = self._placement.addr
        auth_dir = self._placement.auth_dir
        self._auth = cluster_auth.load(auth_dir) if auth_dir else None
        self._ctx = zmq.Context.instance()
        self._rpc = RpcClient(self._ctx, master, connect_timeout, auth=self._auth)
        # Where this rank is (epoch, loaded position, the run being iterated): the loader's alone.
        self.position = Position(self.spec, self.rank, self.world_size, self.job)
        self.session = ClientSession(self._rpc, self.spec, self.rank, self.world_size, timeout, connect_timeout,
                                     on_welcome=self._welcomed, node=self._placement.node, job=self.job)
        self._active: Optional[EpochIterator] = None
        self._closed = False
        self.warnings: list[str] = []  # skipped splits etc., also issued as Python warnings
        self.stats = ClientStats()
        self._arenas = ArenaLinks()  # workers' shared-memory arenas on this host, kept across epochs

    # -- session -----------------------------------------------------------------------------
    @property
    def _cluster(self) -> Optional[EmbeddedCluster]:
        """The embedded master and workers, on the rank that started them."""
        return self._placement.cluster

    @staticmethod
    def _can_pin() -> bool:
        if torch.cuda.is_available():
            return True
        warnings.warn("pin_memory=True but no accelerator is available: batches are not pinned", stacklevel=3)
        return False

    def _hello(self) -> JobInfo:
        return self.session.hello()

    def _welcomed(self, job: JobInfo) -> None:
        self.position.check_plan(job.plan)
        if job.dropped_rows:
            self._warn(f"{job.dropped_rows} rows of each epoch are left out so that every rank "
                       f"gets the same number of batches (even_batches: {self.spec.even_batches}"
                       f"{', drop_last' if self.drop_last else ''})")

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            warnings.warn(f"remoteloader: {message}", RuntimeWarning, stacklevel=3)

    def __len__(self) -> int:
        """Batches this rank's iteration of the epoch yields (the one under way, else the next):
        a whole epoch's, equal on every rank with ``even_batches``, or after ``load_state_dict``
        the batches still to come of the resumed epoch (see ``Position.rows_ahead``)."""
        rows = self.position.rows_ahead(self._hello())
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    @property
    def sparse_keys(self) -> list[str]:
        return list(self._hello().sparse_keys)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise RuntimeError("this RemoteDataLoader is closed")
        if self._active is not None:
            self._active.replace()  # an abandoned epoch releases its sockets before the next starts
        epoch = self.position.take_epoch()
        self._active = EpochIterator(self._epoch(epoch), epoch)
        return self._active

    def set_epoch(self, epoch: int) -> None:
        """The next ``iter()`` yields epoch ``epoch`` (without it, each ``iter()`` takes the next).
        After ``load_state_dict``, only the loaded position's epoch may be chosen."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.position.choose(epoch)

    def _epoch(self, epoch: int) -> Iterator[Batch]:
        self._hello()
        start, resumed = self.position.begin(epoch)
        plan = EpochPlan.of(start, self.session.start_epoch(start))
        consumed = self.position.consumed_at_start(resumed, plan)
        assembler = EpochAssembler([(sid, s.rows) for sid, s in plan.splits.items()], self.batch_size, self.drop_last,
                                   consumed=consumed, cycle=self.spec.cycle, padding=plan.padding_ids,
                                   mix_splits=self.spec.mix_splits, lanes=plan.lanes)
        assembler.dirty.update(consumed)  # told to the master at the first beat
        run = EpochRun(plan, assembler, rows=assembler.expected_rows - assembler.received_rows)
        # The stream never pins: with pin_memory (or device) the stager after it does (staging.py).
        config = StreamConfig(self.rank, self.master, self.timeout, self._auth)
        stream = EpochStream(self._ctx, self.session, run, config, self.credit, self.stats, self.warnings,
                             arenas=self._arenas)
        node = stream if self.pin_pool is None else \
            staging.StagedBatches(stream, self.pin_pool, self.device, self.timeout, self.pin_stats)
        self.position.run = run
        try:
            for item in node:
                yield item.batch if self.pin_pool is None else item
        finally:
            node.close()
            self.position.run = None

    # -- checkpointing (torchdata StatefulDataLoader protocol; see position.py and resume.py) ---
    def state_dict(self) -> dict:
        """What the training loop has consumed, as small plain data: under torch.distributed
        the job's position (the same on every rank: a collective that every rank calls, as
        DCP does; DCP saves it once and a job of any world size loads it), else this rank's
        part keyed ``rank_<r>``. Batches prefetched but not yet yielded are not in it."""
        return resume.state_of(self.position.part(self._hello().plan), self.spec.fingerprint())

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next ``iter()`` resumes its epoch where it stopped
        (see ``Position.load``), as the job the state was saved by (see ``_resume_job``), or,
        for a loader given another ``job=``, as that job: a fork, which starts there."""
        saved = resume.saved_job(state)
        if saved is not None and saved != self.job and self._job_given:
            log.info("rank %d: job %r starts from a position of job %r (a fork)", self.rank, self.job, saved)
            saved = None  # the rows the state names as consumed are consumed in this job's epoch too

        def plan() -> Optional[str]:
            # The state fits the spec: the plan it must fit is its own job's (a following job's grows).
            self._resume_job(saved)
            return self._hello().plan

        before = self.job
        try:
            self.position.load(state, plan)
        except Exception:
            if self.job != before:  # a refused state leaves the loader's job as it was
                self._switch_job(before)
            raise

    def _resume_job(self, saved: Optional[str]) -> None:
        """A checkpoint resumes its own job, never another one: a loader without a name given
        takes the checkpoint's (a relaunch of the job is that job again, whatever its new
        run id), saying goodbye first if it met the master under its default name (DCP asks
        ``state_dict()`` before it loads). A state saved before job names (None) resumes as this
        loader's job, as does one loaded by a loader given another name (a fork)."""
        if saved is None or saved == self.job:
            return
        log.info("rank %d: resuming job %r of the loaded state (its default name was %r)", self.rank, saved, self.job)
        self._switch_job(saved)

    def _switch_job(self, name: str) -> None:
        self.session.goodbye(GOODBYE_S)  # the next call says hello as that job
        self.job = self.position.job = self.session.job_name = name
        self.position.plan = None  # the plan met under the old name was that job's (a stream's grows its own way)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Say goodbye to the master; stop the embedded master and workers if this loader started them,
        once every rank's loader has closed (bounded: ``ranks.CLOSE_WAIT_S``)."""
        if self._closed:
            return
        self._closed = True
        self.session.stop.set()
        if self._active is not None:
            self._active.close()  # stops its staging thread, if any
        if self.pin_pool is not None:
            self.pin_pool.close()
        self._arenas.close()
        self.session.goodbye(GOODBYE_S)
        self._job_slot()
        self._rpc.close()
        self._placement.close(self.world_size)

    def __enter__(self) -> "RemoteDataLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
