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

import bisect
import logging
import os
import sys
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Generator, Iterator, Optional, Union

import torch
import zmq

from . import resume
from .assembly import EpochAssembler
from .batch import Batch
from .control import ControlChannel
from .credit import CreditWindow
from .embedded import EmbeddedCluster, discover_master, publish_master, resolve_rank
from .fetch import WorkerFetcher
from ..protocol import auth as cluster_auth
from ..protocol.rpc import MasterUnavailable, RemoteError, RpcClient
from ..spec import DatasetSpec, SpecError, load_spec

log = logging.getLogger(__name__)
HEARTBEAT_S = 0.25
# Upper bounds of the per-batch wait histogram (seconds) reported to the master's metrics.
WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
# While this many batches wait for the training loop, it takes the next without polling its
# sockets (pieces arrive several to a message: a poll per batch is waste).
QUEUED_ENOUGH = 4


@dataclass
class ClientStats:
    """Cumulative counters; the master turns deltas between heartbeats into rates."""

    wait_s: float = 0.0  # time the training loop spent blocked waiting for a batch (mid-epoch)
    # The part of wait_s during which no worker of the partition held a piece for this rank
    # (by the ``held`` of its last message): waits more producers would shorten. The rest
    # is data held at a worker or on its way (credit, transport, a busy worker thread).
    starved_s: float = 0.0
    epoch_start_s: float = 0.0  # time spent waiting for the first batch of an epoch
    batches: int = 0
    rows: int = 0
    wait_buckets: list = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS_S) + 1))  # per-batch waits

    def to_wire(self, queued: int) -> dict:
        return {"wait_s": self.wait_s, "starved_s": self.starved_s, "epoch_start_s": self.epoch_start_s,
                "batches": self.batches, "rows": self.rows, "queued": queued, "time": time.monotonic(),
                "wait_le": list(WAIT_BUCKETS_S), "wait_buckets": list(self.wait_buckets)}


def _acks_of(consumed: dict[int, tuple[int, int]]) -> list[list[int]]:
    return [[sid, pieces] for sid, (pieces, _) in sorted(consumed.items())]


@dataclass
class EpochRun:
    """The epoch being iterated: its plan as the master sent it, and the assembler."""

    epoch: int
    done: list  # rows consumed before an elastic resume, [[base, lo, hi], ...] (sent in start_epoch)
    splits: dict[int, tuple[int, int, int, bool]]  # split id -> (rows, base, row_lo, padding)
    assembler: EpochAssembler


class RemoteDataLoader:
    """A DataLoader whose batches come from remoteloader workers.

    Args:
        spec: a ``DatasetSpec``, its dict form, or the path of a YAML/JSON spec.
        master: ``tcp://host:port`` of a running master; ``None`` starts an embedded one.
        num_workers: local workers of the embedded master (default: CPU count).
        batch_size, shuffle, seed, drop_last, even_batches: override the spec's values.
            ``even_batches`` ("pad", the default, "drop", or "off"; True/False mean pad/off)
            gives every rank the same number of batches per epoch, as DDP needs.
        rank, world_size: this trainer's share; default from torch.distributed, then the
            ``RANK``/``WORLD_SIZE`` environment variables, then 0/1.
        pin_memory: return batches in pinned memory (ignored with a warning without an accelerator).
        inflight: pieces of credit per worker to start with; the client grows its credit
            window while the training loop waits on batches a worker holds but may not send.
        prefetch_bytes: the most the credit window may hold (batches in flight and queued).
        timeout: seconds without any progress (no batch, no master answer) before an error.
        connect_timeout: seconds to wait for the master's first answer.
        auth: key directory (``remoteloader keygen DIR``) of a cluster started with ``--auth``;
            default ``$REMOTELOADER_AUTH``. The embedded default is always authenticated: it
            uses this directory if given, else ephemeral keys it makes and removes itself.
    """

    def __init__(self, spec: Union[DatasetSpec, dict, str, os.PathLike], *, master: Optional[str] = None,
                 num_workers: Optional[int] = None, batch_size: Optional[int] = None,
                 shuffle: Optional[bool] = None, seed: Optional[int] = None, drop_last: Optional[bool] = None,
                 even_batches: Union[bool, str, None] = None, rank: Optional[int] = None, world_size: Optional[int] = None, pin_memory: bool = False,
                 inflight: int = 2, prefetch_bytes: int = 256 << 20, timeout: float = 300.0,
                 connect_timeout: float = 60.0,
                 auth: Union[str, os.PathLike, None] = None) -> None:
        spec = load_spec(spec)
        if isinstance(even_batches, bool):
            even_batches = "pad" if even_batches else "off"
        overrides = {k: v for k, v in dict(batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                            even_batches=even_batches).items() if v is not None}
        self.spec = spec.replace(**overrides) if overrides else spec
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.batch_size = self.spec.batch_size
        self.drop_last = self.spec.drop_last
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.credit = CreditWindow(inflight, prefetch_bytes)  # kept across epochs: what it learned holds
        self.pin_memory = pin_memory and self._can_pin()
        self.client_id = f"c-{uuid.uuid4().hex[:10]}"
        self._cluster: Optional[EmbeddedCluster] = None
        self._finalizer = None
        auth_dir = os.fspath(auth) if auth is not None else os.environ.get(cluster_auth.ENV_AUTH) or None
        if auth_dir:
            cluster_auth.load(auth_dir)  # AuthError (a ValueError, one line) before anything starts
        if master is None:
            master, auth_dir = self._start_or_find_master(num_workers, auth_dir)
        self.master = master
        self._auth = cluster_auth.load(auth_dir) if auth_dir else None
        self._ctx = zmq.Context.instance()
        self._rpc = RpcClient(self._ctx, master, connect_timeout, auth=self._auth)
        self._job: Optional[dict] = None
        self._next_epoch = 0
        self._pending: Optional[dict] = None  # a loaded position, used by the next iter() of its epoch
        self._current: Optional[EpochRun] = None
        self._active: Optional[Generator[Batch, None, None]] = None
        self._batches_yielded = 0
        self._master_seen: Optional[str] = None  # the master process heard from last (membership.master)
        self._plan: Optional[str] = None
        self._closed = False
        self.warnings: list[str] = []  # skipped splits etc., also issued as Python warnings
        self.stats = ClientStats()

    # -- cluster and session ---------------------------------------------------------------
    def _start_or_find_master(self, num_workers: Optional[int], auth_dir: Optional[str]) -> tuple[str, Optional[str]]:
        """The master's address and key directory: rank 0's embedded cluster, or one found."""
        fingerprint = self.spec.fingerprint()
        if self.rank != 0:
            addr, published = discover_master(fingerprint, self.connect_timeout)
            return addr, published or auth_dir
        if os.environ.get("REMOTELOADER_MASTER"):
            return os.environ["REMOTELOADER_MASTER"], auth_dir
        scaling = self.spec.autoscale
        extra = ("--allow-table", self.spec.table.path)  # the embedded master serves this table only
        extra += () if scaling is None else ("--autoscale", "--min-workers", str(scaling.get("min_workers", 1)),
                                            "--max-workers", str(scaling.get("max_workers", os.cpu_count() or 1)))
        workers = num_workers or os.cpu_count() or 1
        if not os.environ.get("REMOTELOADER_QUIET"):
            # One line rather than seconds of silence: a first start compiles the kernels.
            print(f"remoteloader: starting an embedded master and {workers} local workers for "
                  f"{self.spec.table.path} (a first start on this machine compiles the transform kernels; "
                  "later ones load them from the cache)", file=sys.stderr, flush=True)
        self._cluster = EmbeddedCluster(workers, extra_args=extra, auth_dir=auth_dir)
        self._finalizer = weakref.finalize(self, self._cluster.close)
        publish_master(self._cluster.addr, fingerprint, self._cluster.auth_dir)
        return self._cluster.addr, self._cluster.auth_dir

    @staticmethod
    def _can_pin() -> bool:
        if torch.cuda.is_available():
            return True
        warnings.warn("pin_memory=True but no accelerator is available: batches are not pinned", stacklevel=3)
        return False

    def _hello(self) -> dict:
        if self._job is None:
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    reply = self._rpc.call("hello", client_id=self.client_id, rank=self.rank,
                                           world_size=self.world_size, spec=self.spec.to_dict(),
                                           fingerprint=self.spec.fingerprint(), timeout_s=self.connect_timeout)
                    break
                except MasterUnavailable as e:
                    raise MasterUnavailable(f"{e}: is a remoteloader-master running there?") from None
                except RemoteError as e:
                    if e.code == "binding" and time.monotonic() < deadline:
                        time.sleep(0.2)  # the master is reading the table's metadata
                        continue
                    if e.code == "bad_spec":  # the message names the spec key or column at fault
                        raise SpecError(str(e)) from None
                    raise RuntimeError(f"the master refused this loader: {e}") from None
            self._job = reply["job"]
            self._check_plan(self._job)
            if self._job.get("dropped_rows"):
                self._warn(f"{self._job['dropped_rows']} rows of each epoch are left out so that every rank "
                           f"gets the same number of batches (even_batches: {self.spec.even_batches}"
                           f"{', drop_last' if self.drop_last else ''})")
        return self._job

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            warnings.warn(f"remoteloader: {message}", RuntimeWarning, stacklevel=3)

    def __len__(self) -> int:
        """Batches of this rank in a whole epoch; equal on every rank with ``even_batches``.
        (A resumed epoch yields only its remaining batches.)"""
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

    def set_epoch(self, epoch: int) -> None:
        """The next ``iter()`` yields epoch ``epoch`` (without it, each ``iter()`` takes the next)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self._next_epoch = epoch

    def _start_epoch(self, epoch: int, done: list, consumed: dict[int, tuple[int, int]]) -> EpochRun:
        reply = self._call("start_epoch", client_id=self.client_id, epoch=epoch, consumed=_acks_of(consumed),
                           done=done)
        splits = {int(sid): (int(rows), int(base), int(lo), bool(pad)) for sid, rows, base, lo, pad in reply["splits"]}
        assembler = EpochAssembler([(sid, s[0]) for sid, s in splits.items()], self.batch_size, self.drop_last,
                                   consumed=consumed)
        return EpochRun(epoch, done, splits, assembler)

    def _epoch(self, epoch: int) -> Iterator[Batch]:
        job = self._hello()
        pending, self._pending = self._pending, None
        if pending is not None and pending["epoch"] == epoch:
            run = self._start_epoch(epoch, pending["done"], pending["consumed"])
        else:
            run = self._start_epoch(epoch, [], {})
        assembler = run.assembler
        fetcher = WorkerFetcher(self._ctx, self.rank, epoch, self.credit, job["sparse_keys"],
                                job.get("sparse_scored"), auth=self._auth)
        self._current = run
        # Acks and heartbeats go on the control thread: a slow or restarting master never
        # holds up batches that workers already have. One synchronous beat first, for the
        # partition's workers.
        control: Optional[ControlChannel] = None
        batch_wait = 0.0  # the training loop's wait for the batch it is waiting for now
        window_checked = False
        try:
            self._apply_membership(epoch, assembler, fetcher, self._heartbeat(epoch, []))
            control = ControlChannel(self._ctx, self.master, self.client_id, epoch,
                                     lambda: self.stats.to_wire(assembler.ready_count), HEARTBEAT_S, auth=self._auth)
            last_progress = time.monotonic()
            while not assembler.exhausted:
                now = time.monotonic()
                if not fetcher.sockets:  # no worker to take from yet: wait for the partition, do not spin
                    control.report([], urgent=True)
                    control.wait_reply(HEARTBEAT_S)
                self._take_control_reply(control, epoch, assembler, fetcher)
                ready = assembler.next_ready()
                if ready is None and self._batches_yielded and not window_checked:
                    window_checked = True  # once per wait, before granting more: was credit the limit?
                    if fetcher.credit_limited():
                        self.credit.starved()
                # Credit for what the loop will take next; also the keepalive that tells workers
                # this rank is alive while it works through a deep queue.
                fetcher.top_up(assembler.ready_count)
                if ready is None:
                    starved = not fetcher.holding()
                    arrivals = fetcher.poll(int(HEARTBEAT_S * 1000))
                    # The training loop is waiting on us: the stall the autoscaler minimizes.
                    # Waiting for the first batch of an iteration is kept apart: the time to
                    # produce one split, which no number of workers shortens.
                    if self._batches_yielded:
                        waited = time.monotonic() - now
                        self.stats.wait_s += waited
                        self.stats.starved_s += waited if starved else 0.0
                        batch_wait += waited
                    else:
                        self.stats.epoch_start_s += time.monotonic() - now
                elif assembler.ready_count < QUEUED_ENOUGH:
                    arrivals = fetcher.poll(0)
                else:  # batches queued here already: receive on a later batch
                    arrivals = []
                for split_id, piece, batch in arrivals:
                    if assembler.wants(split_id, piece):
                        if run.splits[split_id][3]:
                            batch = batch.as_padding()
                        assembler.add(split_id, piece, batch)
                        last_progress = time.monotonic()
                if ready is not None:
                    assembler.consume(ready)
                    control.report(assembler.take_acks())
                    self._batches_yielded += 1
                    self.stats.batches += 1
                    self.stats.wait_buckets[bisect.bisect_left(WAIT_BUCKETS_S, batch_wait)] += 1
                    batch_wait = 0.0
                    window_checked = False
                    self.stats.rows += len(ready.batch)
                    last_progress = time.monotonic()
                    yield ready.batch.pin_memory() if self.pin_memory else ready.batch
                elif time.monotonic() - last_progress > self.timeout:
                    master = (f"master unreachable for {control.unreachable_s:.0f} s"
                              if control.unreachable_s > 2 * HEARTBEAT_S + 2.0 else f"master status: {self._status_summary()}")
                    raise TimeoutError(
                        f"rank {self.rank} epoch {epoch}: no batch for {self.timeout:g} s "
                        f"({assembler.received_rows} of {assembler.expected_rows} rows received); {master}")
            # The epoch's last acks go synchronously, before the master is told it is over.
            leftover, control = control.close(), None
            self._apply_membership(epoch, assembler, fetcher, self._heartbeat(epoch, leftover + assembler.take_acks()))
            self._call("finish_epoch", client_id=self.client_id, epoch=epoch)
        finally:
            if control is not None:
                control.close()
            self._current = None
            self._batches_yielded = 0
            fetcher.close()

    def _heartbeat(self, epoch: int, acks: list) -> dict:
        """A synchronous heartbeat from the training thread (epoch start and end)."""
        try:
            return self._call("client_heartbeat", client_id=self.client_id, epoch=epoch, acks=acks,
                              stats=self.stats.to_wire(0))
        except RemoteError as e:
            if e.code != "unknown_client":
                raise
            return self._rejoin(epoch, acks)

    def _rejoin(self, epoch: int, acks: list) -> dict:
        # The master restarted without a journal: rejoin and tell it what this rank has
        # consumed, which is all it needs to continue the epoch exactly where it was.
        log.warning("master forgot this client (restart?); rejoining epoch %d", epoch)
        self._job = None
        self._hello()
        consumed = self._current.assembler.consumed_state() if self._current is not None else {}
        self._call("start_epoch", client_id=self.client_id, epoch=epoch, consumed=_acks_of(consumed),
                   done=self._current.done if self._current is not None else [])
        return self._call("client_heartbeat", client_id=self.client_id, epoch=epoch, acks=acks)

    def _take_control_reply(self, control: ControlChannel, epoch: int, assembler: EpochAssembler,
                            fetcher: WorkerFetcher) -> None:
        try:
            reply = control.take_reply()
        except RemoteError as e:
            if e.code != "unknown_client":
                raise
            reply = self._rejoin(epoch, [])
        if reply is not None:
            self._apply_membership(epoch, assembler, fetcher, reply, control)

    def _apply_membership(self, epoch: int, assembler: EpochAssembler, fetcher: WorkerFetcher, reply: dict,
                          control: Optional[ControlChannel] = None) -> None:
        master = reply.get("master")
        if master is not None and self._master_seen not in (None, master):
            # Another master process (a restart on its journal): consumption is not
            # journaled, so it hears everything this rank has consumed again.
            log.info("master restarted; reporting what rank %d consumed in epoch %d", self.rank, epoch)
            everything = _acks_of(assembler.consumed_state())
            if control is not None:
                control.report(everything, urgent=True)
            else:
                reply = self._call("client_heartbeat", client_id=self.client_id, epoch=epoch, acks=everything)
        self._master_seen = master
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
        """What the training loop has consumed: small plain data, keyed by rank.

        ``{"rank_<r>": position}``: under ``torch.distributed.checkpoint`` every rank's
        part has its own key, so all of them are kept; ``torch.save`` per rank works too,
        and so does ``torch.load(..., weights_only=True)``. Batches prefetched but not yet
        yielded are not in it: after ``load_state_dict`` they are delivered again.
        """
        return {f"rank_{self.rank}": self._position()}

    def _position(self) -> dict:
        job = self._hello()
        if self._current is not None and not self._current.assembler.exhausted:
            run = self._current
            consumed = []
            for sid, (pieces, tail_rows) in sorted(run.assembler.consumed_state().items()):
                rows, base, row_lo, padding = run.splits[sid]
                consumed.append([sid, pieces, tail_rows, base, row_lo,
                                 min(rows, pieces * self.batch_size + tail_rows), int(padding)])
            epoch, done, yielded = run.epoch, run.done, self._batches_yielded
        elif self._pending is not None and self._pending["epoch"] == self._next_epoch:
            return dict(self._pending["state"], rank=self.rank, world_size=self.world_size)
        else:
            epoch, done, consumed, yielded = self._next_epoch, [], [], 0
        return {"version": resume.STATE_VERSION, "fingerprint": job["fingerprint"], "plan": job["plan"], "rank": self.rank,
                "world_size": self.world_size, "epoch": epoch, "done": done, "consumed": consumed,
                "batches_yielded": yielded}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next ``iter()`` resumes its epoch where it stopped.

        ``state`` holds this rank's part (``state_dict()`` of the same rank, same world
        size), or the parts of every rank of a job with another world size (elastic
        resume, e.g. from ``read_rank_states``): the rows they had not consumed are then
        spread over this job's ranks, each delivered once.
        """
        parts = resume.rank_parts(state)
        job = self._hello()
        for part in parts.values():
            resume.check_part(part, job["fingerprint"])
            self._check_plan(job, part["plan"])
        old_world = resume.common(parts, "world_size")
        epoch = resume.common(parts, "epoch")
        if old_world == self.world_size and self.rank in parts:
            mine = parts[self.rank]
            consumed = {int(c[0]): (int(c[1]), int(c[2])) for c in mine["consumed"]}
            self._pending = {"epoch": epoch, "done": mine["done"], "consumed": consumed, "state": mine}
        elif sorted(parts) == list(range(old_world)):
            done = resume.merged_done(parts)
            position = {"version": resume.STATE_VERSION, "fingerprint": job["fingerprint"], "plan": job["plan"],
                        "epoch": epoch, "done": done, "consumed": [], "batches_yielded": 0}
            self._pending = {"epoch": epoch, "done": done, "consumed": {}, "state": position}
        else:
            raise ValueError(f"state_dict holds ranks {sorted(parts)} of a {old_world}-rank job: rank {self.rank} of "
                             f"{self.world_size} needs its own part (same world size) or all {old_world} parts")
        self._next_epoch = epoch

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
