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
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Generator, Iterator, Optional, Union

import torch
import zmq

from .assembly import EpochAssembler
from .batch import Batch
from .embedded import EmbeddedCluster, discover_master, publish_master, resolve_rank
from .fetch import WorkerFetcher
from ..protocol.rpc import MasterUnavailable, RemoteError, RpcClient
from ..spec import DatasetSpec, load_spec

log = logging.getLogger(__name__)
HEARTBEAT_S = 0.25


@dataclass
class ClientStats:
    """Cumulative counters; the master turns deltas between heartbeats into rates."""

    wait_s: float = 0.0  # time the training loop spent blocked waiting for a batch (mid-epoch)
    epoch_start_s: float = 0.0  # time spent waiting for the first batch of an epoch
    batches: int = 0
    rows: int = 0

    def to_wire(self, queued: int) -> dict:
        return {"wait_s": self.wait_s, "epoch_start_s": self.epoch_start_s, "batches": self.batches,
                "rows": self.rows, "queued": queued,
                "time": time.monotonic()}


def _acks_of(consumed: dict[int, tuple[int, int]]) -> list[list[int]]:
    return [[sid, pieces] for sid, (pieces, _) in sorted(consumed.items())]


class RemoteDataLoader:
    """A DataLoader whose batches come from remoteloader workers.

    Args:
        spec: a ``DatasetSpec``, its dict form, or the path of a YAML/JSON spec.
        master: ``tcp://host:port`` of a running master; ``None`` starts an embedded one.
        num_workers: local workers of the embedded master (default: CPU count).
        batch_size, shuffle, seed, drop_last: override the spec's values.
        rank, world_size: this trainer's share; default from torch.distributed, then the
            ``RANK``/``WORLD_SIZE`` environment variables, then 0/1.
        pin_memory: return batches in pinned memory (ignored with a warning without an accelerator).
        inflight: requests kept outstanding per worker (prefetch depth).
        timeout: seconds without any progress (no batch, no master answer) before an error.
        connect_timeout: seconds to wait for the master's first answer.
    """

    def __init__(self, spec: Union[DatasetSpec, dict, str, os.PathLike], *, master: Optional[str] = None,
                 num_workers: Optional[int] = None, batch_size: Optional[int] = None,
                 shuffle: Optional[bool] = None, seed: Optional[int] = None, drop_last: Optional[bool] = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None, pin_memory: bool = False,
                 inflight: int = 2, timeout: float = 300.0, connect_timeout: float = 60.0) -> None:
        spec = load_spec(spec)
        overrides = {k: v for k, v in dict(batch_size=batch_size, shuffle=shuffle, seed=seed,
                                            drop_last=drop_last).items() if v is not None}
        self.spec = spec.replace(**overrides) if overrides else spec
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.batch_size = self.spec.batch_size
        self.drop_last = self.spec.drop_last
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.inflight = inflight
        self.pin_memory = pin_memory and self._can_pin()
        self.client_id = f"c-{uuid.uuid4().hex[:10]}"
        self._cluster: Optional[EmbeddedCluster] = None
        self._finalizer = None
        if master is None:
            master = self._start_or_find_master(num_workers)
        self.master = master
        self._ctx = zmq.Context.instance()
        self._rpc = RpcClient(self._ctx, master, connect_timeout)
        self._job: Optional[dict] = None
        self._next_epoch = 0
        self._resume: dict[int, dict[int, tuple[int, int]]] = {}
        self._current: Optional[tuple[int, EpochAssembler]] = None
        self._active: Optional[Generator[Batch, None, None]] = None
        self._batches_yielded = 0
        self._plan: Optional[str] = None
        self._closed = False
        self.warnings: list[str] = []  # skipped splits etc., also issued as Python warnings
        self.stats = ClientStats()

    # -- cluster and session ---------------------------------------------------------------
    def _start_or_find_master(self, num_workers: Optional[int]) -> str:
        fingerprint = self.spec.fingerprint()
        if self.rank != 0:
            return discover_master(fingerprint, self.connect_timeout)
        if os.environ.get("REMOTELOADER_MASTER"):
            return os.environ["REMOTELOADER_MASTER"]
        scaling = self.spec.autoscale
        extra = () if scaling is None else ("--autoscale", "--min-workers", str(scaling.get("min_workers", 1)),
                                            "--max-workers", str(scaling.get("max_workers", os.cpu_count() or 1)))
        self._cluster = EmbeddedCluster(num_workers or os.cpu_count() or 1, extra_args=extra)
        self._finalizer = weakref.finalize(self, self._cluster.close)
        publish_master(self._cluster.addr, fingerprint)
        return self._cluster.addr

    @staticmethod
    def _can_pin() -> bool:
        if torch.cuda.is_available():
            return True
        warnings.warn("pin_memory=True but no accelerator is available: batches are not pinned", stacklevel=3)
        return False

    def _hello(self) -> dict:
        if self._job is None:
            try:
                reply = self._rpc.call("hello", client_id=self.client_id, rank=self.rank, world_size=self.world_size,
                                       spec=self.spec.to_dict(), fingerprint=self.spec.fingerprint(),
                                       timeout_s=self.connect_timeout)
            except MasterUnavailable as e:
                raise MasterUnavailable(f"{e}: is a remoteloader-master running there?") from None
            except RemoteError as e:
                raise RuntimeError(f"the master refused this loader: {e}") from None
            self._job = reply["job"]
            self._check_plan(self._job)
        return self._job

    def __len__(self) -> int:
        rows = self._hello()["rank_rows"]
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    @property
    def sparse_keys(self) -> list[str]:
        return list(self._hello()["sparse_keys"])

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise RuntimeError("this RemoteDataLoader is closed")
        if self._active is not None:
            self._active.close()  # an abandoned epoch releases its sockets before the next starts
        epoch = self._next_epoch
        self._next_epoch += 1
        self._active = self._epoch(epoch)
        return self._active

    def _epoch(self, epoch: int) -> Iterator[Batch]:
        job = self._hello()
        consumed = self._resume.pop(epoch, {}) if self._resume else {}
        reply = self._call("start_epoch", client_id=self.client_id, epoch=epoch, consumed=_acks_of(consumed))
        splits = [(int(sid), int(rows)) for sid, rows in reply["splits"]]
        assembler = EpochAssembler(splits, self.batch_size, self.drop_last, consumed=consumed)
        fetcher = WorkerFetcher(self._ctx, self.rank, self.inflight, job["sparse_keys"])
        fetcher.start_epoch(epoch)
        self._current = (epoch, assembler)
        last_beat = 0.0
        try:
            last_progress = time.monotonic()
            while not assembler.exhausted:
                now = time.monotonic()
                if now - last_beat >= HEARTBEAT_S or not fetcher.sockets:
                    self._heartbeat(epoch, assembler, fetcher)
                    last_beat = now
                fetcher.top_up()  # keep every worker `inflight` requests ahead, also while batches are ready
                ready = assembler.next_ready()
                if ready is None:
                    arrivals = fetcher.poll(int(HEARTBEAT_S * 1000))
                    # The training loop is waiting on us: the stall the autoscaler minimizes.
                    # Waiting for the first batch of an iteration is kept apart: the time to
                    # produce one split, which no number of workers shortens.
                    if self._batches_yielded:
                        self.stats.wait_s += time.monotonic() - now
                    else:
                        self.stats.epoch_start_s += time.monotonic() - now
                else:
                    arrivals = fetcher.poll(0)
                for header, batch in arrivals:
                    if assembler.wants(header["split_id"], header["piece"]):
                        assembler.add(header["split_id"], header["piece"], batch)
                        last_progress = time.monotonic()
                if ready is not None:
                    assembler.consume(ready)
                    self._batches_yielded += 1
                    self.stats.batches += 1
                    self.stats.rows += len(ready.batch)
                    last_progress = time.monotonic()
                    yield ready.batch.pin_memory() if self.pin_memory else ready.batch
                elif time.monotonic() - last_progress > self.timeout:
                    raise TimeoutError(
                        f"rank {self.rank} epoch {epoch}: no batch for {self.timeout:g} s "
                        f"({assembler.received_rows} of {assembler.expected_rows} rows received); "
                        f"master status: {self._status_summary()}")
            self._heartbeat(epoch, assembler, fetcher)
            self._call("finish_epoch", client_id=self.client_id, epoch=epoch)
        finally:
            self._current = None
            self._batches_yielded = 0
            fetcher.close()

    def _heartbeat(self, epoch: int, assembler: EpochAssembler, fetcher: WorkerFetcher) -> None:
        try:
            reply = self._call("client_heartbeat", client_id=self.client_id, epoch=epoch, acks=assembler.take_acks(),
                               stats=self.stats.to_wire(assembler.ready_count))
        except RemoteError as e:
            if e.code != "unknown_client":
                raise
            # The master restarted without a journal: rejoin and tell it what this rank has
            # consumed, which is all it needs to continue the epoch exactly where it was.
            log.warning("master forgot this client (restart?); rejoining epoch %d", epoch)
            self._job = None
            self._hello()
            self._call("start_epoch", client_id=self.client_id, epoch=epoch, consumed=_acks_of(assembler.consumed_state()))
            reply = self._call("client_heartbeat", client_id=self.client_id, epoch=epoch, acks=[])
        fetcher.set_workers(reply["workers"])
        for err in reply["errors"]:
            if not err["skipped"]:
                raise RuntimeError(f"rank {self.rank} epoch {epoch}: {err['message']}")
            if err["message"] in self.warnings:
                continue
            if err["split_id"] >= 0:  # a split quarantined this epoch; -1: a file left out at job start
                assembler.skip_split(err["split_id"])
            self.warnings.append(err["message"])
            warnings.warn(f"remoteloader skipped data (on_error: skip): {err['message']}", RuntimeWarning, stacklevel=2)

    # -- checkpointing (torchdata StatefulDataLoader protocol) ------------------------------
    def state_dict(self) -> dict:
        """What the training loop has consumed: small, plain data, ``torch.save``-able.

        Batches prefetched but not yet yielded are not in it: after ``load_state_dict``
        they are delivered again, so the rows before and after add up to the epoch exactly.
        """
        job = self._hello()
        if self._current is not None and not self._current[1].exhausted:
            epoch, assembler = self._current
            consumed = [[sid, p, r] for sid, (p, r) in sorted(assembler.consumed_state().items())]
            yielded = self._batches_yielded
        else:
            epoch, consumed, yielded = self._next_epoch, [], 0
        return {"version": 1, "fingerprint": job["fingerprint"], "plan": job["plan"], "rank": self.rank,
                "world_size": self.world_size, "epoch": epoch, "consumed": consumed, "batches_yielded": yielded}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next ``iter()`` resumes its epoch where it stopped."""
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("not a RemoteDataLoader state (missing or unknown 'version')")
        job = self._hello()
        for key, mine in (("fingerprint", job["fingerprint"]), ("rank", self.rank), ("world_size", self.world_size)):
            if state[key] != mine:
                raise ValueError(f"state_dict {key} {state[key]!r} does not match this loader's {mine!r}")
        self._check_plan(job, state["plan"])
        self._next_epoch = int(state["epoch"])
        self._resume = {self._next_epoch: {int(sid): (int(p), int(r)) for sid, p, r in state["consumed"]}}

    def _check_plan(self, job: dict, plan: Optional[str] = None) -> None:
        expected = plan if plan is not None else self._plan
        if expected is not None and job["plan"] != expected:
            raise RuntimeError(f"the table's split plan changed ({expected} -> {job['plan']}): files were added or "
                               "removed, so the epoch in progress cannot be continued exactly")
        self._plan = job["plan"]

    def _call(self, t: str, **fields: Any) -> dict:
        """A master call that retries until ``timeout`` (a master restart is survivable)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self._rpc.call(t, timeout_s=min(5.0, self.timeout), **fields)
            except MasterUnavailable as e:
                if time.monotonic() >= deadline:
                    raise MasterUnavailable(f"{e}; gave up after {self.timeout:g} s") from None
                log.warning("%s; retrying", e)

    def _status_summary(self) -> str:
        try:
            return str(self._rpc.call("status", timeout_s=2.0)["status"])[:2000]
        except (MasterUnavailable, RemoteError) as e:
            return f"unavailable ({e})"

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the embedded master and workers (if this loader started them)."""
        if self._closed:
            return
        self._closed = True
        if self._active is not None:
            self._active.close()
        self._rpc.close()
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "RemoteDataLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
