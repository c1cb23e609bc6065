"""Pinned staging: each received batch copied once, off the training thread, into reused pinned slabs.

With ``pin_memory=True`` (and an accelerator) or ``device="cuda"``, the loader's epoch runs
through a ``Stager``:

* **Who owns what.** The training thread keeps everything it owned before: the epoch's
  stream, fetcher and assembler, hence what counts as consumed (a checkpoint holds exactly
  the batches handed to the training loop, as without staging). As pieces arrive it wraps
  each in a ``StagedBatch`` and puts a job on the stager's queue; when the stream yields a
  batch, ``Stager.take`` hands its pinned (or device) copy over. The staging thread
  (``remoteloader-pin``, one per epoch iterator) owns the copies: it takes jobs in order,
  leases a slab, copies the batch's tensors into it, and, with ``device=``, issues the
  host-to-device copy on its own CUDA stream. A job's result is written by the staging
  thread only, before its ``done`` event is set, and read by the training thread only after
  it. The ``SlabPool`` (one per loader, slabs reused across epochs) is the one piece of
  shared state, behind its own lock: the staging thread leases, and whichever thread drops a
  slab's last tensor returns it.
* **Release rule: tensor lifetime.** The tensors of a staged batch are views of one
  ``torch.frombuffer`` tensor over a lease (a numpy view of the slab); the lease object lives
  exactly as long as any tensor whose storage is that buffer (any view, slice or ``.numpy()``
  of it), and a ``weakref.finalize`` on it returns the slab when the last one dies. So a slab
  is never reused while a view of it is alive, whatever the training loop keeps, and needs
  no call from it. Before a returned slab is written again, device copies that may still
  read it are waited for, on the staging thread: for ``device=`` batches (whose pinned copy
  is never handed out) the copy's own event; for pinned batches handed to the training loop,
  which may have issued ``.to(device, non_blocking=True)`` on any stream, one
  ``torch.cuda.synchronize`` of the loader's device covering every slab returned before it.
* **Bound.** The pool holds at most ``max_bytes`` of slabs (``pin_bytes``, by default the
  loader's ``prefetch_bytes``), in power-of-two size classes (what torch's pinned allocator
  rounds to anyway), each reused for batches of its class. When a job needs a slab and none
  is free, free slabs of other classes are dropped to make room; if the slabs are all in
  use, the staging thread waits (backpressure) and never allocates past the bound. A batch
  larger than the bound fails with an error naming ``pin_bytes``. Jobs are staged in the
  order the training loop takes batches, so the batch the loop waits for is always the
  oldest job: it waits only for slabs the training loop itself still holds, and it says so
  (a log line every 10 s, then ``TimeoutError`` after the loader's ``timeout``).
* **Failures and stop.** A job that fails (say, pinned memory exhausted) re-raises in the
  training thread when that batch is taken; a failure of the thread itself at the next
  take. ``close()`` (at the epoch's end, a replaced or closed iterator, ``loader.close()``)
  stops the thread and joins it.

Only whole pieces are staged as they arrive; a piece that will be merged with others into a
batch (a split's short tail, or the first piece after a resumed position) is staged once
merged (``Batch._derived``), so each tensor handed out was copied once by the staging thread
and none on the training thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np
import torch

from .batch import Batch, KeyedJaggedTensor

log = logging.getLogger(__name__)
ALIGN = 64  # every tensor of a slab starts at a multiple of this (any dtype's alignment, a cache line)
MIN_SLAB = 64 << 10  # the smallest size class
DEVICE_AHEAD = 2  # with device=: batches copied to the device before the training loop asks for them
WAIT_POLL_S = 0.1  # how often a waiting thread looks at stop flags and the other thread's health
WAIT_LOG_S = 10.0
JOIN_S = 30.0  # close() waits this long for a staging thread busy in one copy or device sync


def alloc_pinned(nbytes: int) -> torch.Tensor:
    """The pinning primitive: ``nbytes`` of page-locked host memory (tests replace it)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def size_class(nbytes: int) -> int:
    return max(MIN_SLAB, 1 << max(0, nbytes - 1).bit_length())


def resolve_device(device: Union[str, torch.device, None]) -> Optional[torch.device]:
    """``RemoteDataLoader(device=...)``: ``None`` for no device copy (None or a CPU device)."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"device={device!r} is not a torch device ({e})") from None
    if resolved.type == "cpu":
        return None
    if resolved.type != "cuda":
        raise ValueError(f"device={device!r}: only 'cuda' devices (or 'cpu', no copy) are supported")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available (torch.cuda.is_available() is False): "
                         "pass device=None or device='cpu'")
    return resolved


class StagingClosed(RuntimeError):
    """The stager or its pool was closed while a job waited."""


# -- the pool ---------------------------------------------------------------------------------------
class Slab:
    __slots__ = ("base", "size", "fence", "external", "device_index", "released_seq", "__weakref__")

    def __init__(self, base: torch.Tensor) -> None:
        self.base, self.size = base, int(base.numel())
        self.fence: Any = None  # a CUDA event: the device copy that read this slab
        self.external = False  # handed to the training loop: any stream may have read it
        self.device_index: Optional[int] = None
        self.released_seq = 0


@dataclass
class PoolStats:
    allocated: int = 0  # slabs allocated (calls of the pinning primitive)
    allocated_bytes: int = 0
    reused: int = 0  # leases served by a returned slab
    evicted: int = 0  # free slabs dropped to make room for another size class
    waits: int = 0  # leases that had to wait for a slab to come back
    peak_bytes: int = 0  # the most the pool ever held
    device_syncs: int = 0  # fences of slabs returned by the training loop (one device sync each)


class SlabPool:
    """Pinned slabs, at most ``max_bytes`` of them, reused by size class (see the module docstring)."""

    def __init__(self, max_bytes: int, alloc: Optional[Callable[[int], torch.Tensor]] = None) -> None:
        if max_bytes < MIN_SLAB:
            raise ValueError(f"pin_bytes={max_bytes} is below the smallest slab ({MIN_SLAB} bytes)")
        self.max_bytes = int(max_bytes)
        self._alloc = alloc  # None: the module's alloc_pinned at the time of the call
        self._cv = threading.Condition(threading.RLock())  # RLock: a finalizer may run inside a locked region
        self._free: dict[int, list[Slab]] = {}
        self.held_bytes = 0  # free + leased (+ being allocated)
        self.leased: dict[int, Slab] = {}  # id(slab) -> slab, while tensors view it
        self.waiting = False  # the staging thread waits for a slab to come back
        self._release_seq = 0  # slabs returned so far
        self._synced_seq = 0  # every slab returned up to here is fenced by a device sync
        self._closed = False
        self.stats = PoolStats()

    # staging thread
    def lease(self, nbytes: int, stopped: Callable[[], bool]) -> tuple[Slab, np.ndarray]:
        """A slab of ``nbytes`` or more, as a numpy view whose lifetime is the lease: the slab
        comes back when that view and every tensor made from it are gone."""
        size = size_class(nbytes)
        if size > self.max_bytes:
            raise ValueError(f"a batch of {nbytes} bytes does not fit in the pinned pool (pin_bytes={self.max_bytes}, "
                             f"slab of {size} bytes): raise pin_bytes")
        evicted: list[Slab] = []
        slab: Optional[Slab] = None
        with self._cv:
            while True:
                if self._closed or stopped():
                    raise StagingClosed("the pinned pool was closed")
                free = self._free.get(size)
                if free:
                    slab = free.pop()
                    self.stats.reused += 1
                    break
                while self.held_bytes + size > self.max_bytes and self._free:
                    other = max(self._free)  # the largest free class first: fewest slabs dropped
                    evicted.append(self._free[other].pop())
                    if not self._free[other]:
                        del self._free[other]
                    self.held_bytes -= other
                    self.stats.evicted += 1
                if self.held_bytes + size <= self.max_bytes:
                    self.held_bytes += size  # reserved; allocated below, outside the lock
                    self.stats.peak_bytes = max(self.stats.peak_bytes, self.held_bytes)
                    break
                if not self.waiting:
                    self.waiting = True
                    self.stats.waits += 1
                self._cv.wait(WAIT_POLL_S)
            self.waiting = False
        for old in evicted:
            self._fence(old)  # a device copy may still read it: torch's allocator may hand it out next
        del evicted
        if slab is None:
            try:
                base = (self._alloc or alloc_pinned)(size)
            except BaseException:
                with self._cv:
                    self.held_bytes -= size
                    self._cv.notify_all()
                raise
            if base.dtype != torch.uint8 or base.numel() < size or base.device.type != "cpu":
                raise TypeError(f"the pinning primitive returned {base.dtype} x {base.numel()} on {base.device}, "
                                f"not {size} CPU bytes")
            slab = Slab(base)
            self.stats.allocated += 1
            self.stats.allocated_bytes += size
        else:
            self._fence(slab)
        view = slab.base[:size].numpy()
        finalizer = weakref.finalize(view, self._release, slab)
        finalizer.atexit = False
        with self._cv:
            self.leased[id(slab)] = slab
        return slab, view

    def _fence(self, slab: Slab) -> None:
        """Wait (staging thread) until no device copy still reads ``slab``."""
        if slab.fence is not None:
            slab.fence.synchronize()
            slab.fence = None
        if slab.external:
            with self._cv:
                needed, seq = slab.released_seq > self._synced_seq, self._release_seq
            if needed and _device_ready():
                _synchronize(slab.device_index)
                self.stats.device_syncs += 1
                with self._cv:
                    self._synced_seq = max(self._synced_seq, seq)
            slab.external = False

    # any thread: the last tensor viewing a lease died
    def _release(self, slab: Slab) -> None:
        with self._cv:
            self.leased.pop(id(slab), None)
            self._release_seq += 1
            slab.released_seq = self._release_seq
            if self._closed:
                self.held_bytes -= slab.size
            else:
                self._free.setdefault(slab.size, []).append(slab)
            self._cv.notify_all()

    # any thread
    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies in a slab of this pool that is leased now (for a
        0-element tensor: whether it views one)."""
        if tensor.device.type != "cpu":
            return False
        # From the storage, not ``tensor.data_ptr()``: that is 0 for a 0-element tensor (a
        # batch whose rows have no sparse ids has empty values), which would read as not in
        # a slab although the tensor views one (and keeps its lease alive) like the others.
        lo = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
        hi = lo + tensor.numel() * tensor.element_size()
        with self._cv:
            slabs = list(self.leased.values())
        return any(s.base.data_ptr() <= lo and hi <= s.base.data_ptr() + s.size for s in slabs)

    def describe(self) -> str:
        with self._cv:
            return (f"{len(self.leased)} slabs in use, {self.held_bytes} of pin_bytes={self.max_bytes} held"
                    f"{', waiting for one to come back' if self.waiting else ''}")

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def close(self) -> None:
        """Drop the free slabs; slabs in use are dropped when their tensors die."""
        with self._cv:
            self._closed = True
            freed = [s for slabs in self._free.values() for s in slabs]
            self._free.clear()
            self.held_bytes -= sum(s.size for s in freed)
            self._cv.notify_all()
        for slab in freed:
            self._fence(slab)


def _device_ready() -> bool:
    return torch.cuda.is_initialized()


def _synchronize(index: Optional[int]) -> None:
    torch.cuda.synchronize(index)


# -- jobs -------------------------------------------------------------------------------------------
class _Ticket:
    """One batch's job. ``source`` is set by the training thread before the job is queued;
    ``result``/``event``/``error`` are written by the staging thread before ``done`` is set."""

    __slots__ = ("source", "result", "event", "error", "done", "slot", "__weakref__")

    def __init__(self, source: Batch) -> None:
        self.source: Optional[Batch] = source
        self.result: Optional[Batch] = None
        self.event: Any = None  # with device=: the copy stream's event
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self.slot: Optional[list] = None  # with device=: [held], one of DEVICE_AHEAD device slots


class StagedBatch(Batch):
    """A received batch (its own, unpinned tensors) whose copy the staging thread makes;
    ``Stager.take`` returns that copy. Batches cut from its rows are staged too."""

    _stager: "Stager"
    _ticket: Optional[_Ticket]
    _padded: bool

    def _plain(self) -> Batch:
        return Batch(self.dense_features, self.sparse_features, self.labels, self.passthrough, self.weights,
                     self.padding)

    def as_padding(self) -> "Batch":
        if self._padded:
            return self  # staged with its padding already
        return self._stager.wrap(self._plain().as_padding(), stage=self._ticket is not None, padded=True)

    def _derived(self, batch: Batch) -> Batch:
        return self._stager.wrap(batch, stage=True) if not self._stager.closed else batch


@dataclass
class StagingStats:
    staged: int = 0  # batches copied into slabs
    skipped: int = 0  # jobs whose batch was dropped before its turn (duplicates)
    copied_tensors: int = 0
    copied_bytes: int = 0
    device_copies: int = 0
    taken: int = 0  # batches handed to the training loop
    waited: int = 0  # takes that found their copy not ready yet
    wait_s: float = 0.0  # the training thread's time waiting for copies
    failures: list = field(default_factory=list)


class Stager:
    """The staging thread of one epoch iterator (see the module docstring)."""

    def __init__(self, pool: SlabPool, device: Optional[torch.device] = None, timeout: float = 300.0,
                 stats: Optional[StagingStats] = None) -> None:
        self.pool, self.device, self.timeout = pool, device, timeout
        # The training thread's device, read here (on it): the staging thread binds to it, so
        # its pinned allocations and syncs use that device's context, never device 0's.
        if device is not None:
            self._device_index: Optional[int] = device.index if device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", self._device_index)
        else:
            self._device_index = torch.cuda.current_device() if _device_ready() else None
        self._jobs: "queue.SimpleQueue[Optional[weakref.ref]]" = queue.SimpleQueue()
        self._slots = threading.Condition()
        self._ahead = 0  # device batches copied and not yet taken (or dropped)
        self._failure: Optional[BaseException] = None
        self._closed = False
        self.last_copy_event: Any = None
        self.stats = stats if stats is not None else StagingStats()  # the loader's: summed over epochs
        self._thread = threading.Thread(target=self._run, name="remoteloader-pin", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- training thread -----------------------------------------------------------------------
    def wrap(self, batch: Batch, stage: bool = True, padded: bool = False) -> StagedBatch:
        """``batch`` as a ``StagedBatch``; ``stage``: queue its copy now (else when it is taken)."""
        out = StagedBatch(batch.dense_features, batch.sparse_features, batch.labels, batch.passthrough,
                          batch.weights, batch.padding)
        out._stager, out._padded = self, padded
        out._ticket = self._submit(batch) if stage else None
        return out

    def _submit(self, batch: Batch) -> _Ticket:
        if isinstance(batch, StagedBatch):
            batch = batch._plain()
        ticket = _Ticket(batch)
        # A weak reference: a batch dropped before its turn (a duplicate piece) is not copied.
        self._jobs.put(weakref.ref(ticket))
        return ticket

    def take(self, batch: Batch) -> Batch:
        """The staged copy of ``batch`` (a ``StagedBatch`` of this stager; anything else is
        staged now), waiting for the staging thread if it is not done yet."""
        if self._closed:
            raise StagingClosed("this epoch's pinned staging is closed")
        ticket = batch._ticket if isinstance(batch, StagedBatch) and batch._stager is self else None
        if ticket is None:
            ticket = self._submit(batch)
        else:
            batch._ticket = None  # taken once: taking it again copies again
        if not ticket.done.is_set():
            self._wait(ticket)
        if ticket.error is not None:
            err = ticket.error
            ticket.error = None
            self._free_slot(ticket.slot)
            if isinstance(err, StagingClosed):
                raise StagingClosed(str(err))
            raise RuntimeError(f"remoteloader: staging a batch into pinned memory failed: {err!r}") from err
        result, ticket.result = ticket.result, None
        if self.device is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ticket.event)  # the copy is done before the training loop's kernels read it
            result.record_stream(stream)  # and its memory is not reused before they are done
            self._free_slot(ticket.slot)
        self.stats.taken += 1
        return result

    def _wait(self, ticket: _Ticket) -> None:
        start = last_log = time.monotonic()
        self.stats.waited += 1
        try:
            while not ticket.done.wait(WAIT_POLL_S):
                if self._failure is not None:
                    raise RuntimeError(f"remoteloader: the pinned-staging thread failed: {self._failure!r}") \
                        from self._failure
                if not self._thread.is_alive():
                    raise RuntimeError("remoteloader: the pinned-staging thread stopped")
                now = time.monotonic()
                if now - start > self.timeout:
                    raise TimeoutError(f"no pinned copy of the next batch for {self.timeout:.0f} s: "
                                       f"{self.pool.describe()} (slabs come back when no tensor of a batch "
                                       "is referenced: keep fewer batches, or raise pin_bytes)")
                if now - last_log >= WAIT_LOG_S:
                    last_log = now
                    log.warning("waiting %.0f s for the pinned copy of the next batch: %s", now - start,
                                self.pool.describe())
        finally:
            self.stats.wait_s += time.monotonic() - start

    def close(self) -> None:
        """Stop the staging thread and join it; jobs not started are dropped."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self.pool.wake()
        with self._slots:
            self._slots.notify_all()
        self._thread.join(JOIN_S)
        if self._thread.is_alive():
            log.warning("the pinned-staging thread did not stop within %.0f s (a device copy or sync?)", JOIN_S)

    # -- staging thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            stream = None
            if self._device_index is not None:
                torch.cuda.set_device(self._device_index)
            if self.device is not None:
                stream = torch.cuda.Stream(self.device)
            while not self._closed:
                ref = self._jobs.get()
                if ref is None or self._closed:
                    break
                ticket = ref()
                if ticket is None:
                    self.stats.skipped += 1
                    continue
                try:
                    self._stage(ticket, stream)
                except StagingClosed as e:
                    ticket.error = e
                    break
                except Exception as e:  # the job's own failure: raised where the batch is taken
                    ticket.error = e
                    self.stats.failures.append(repr(e))
                finally:
                    ticket.source = None
                    ticket.done.set()
                    del ticket
        except BaseException as e:
            self._failure = e
            log.exception("the pinned-staging thread failed")

    def _stage(self, ticket: _Ticket, stream: Any) -> None:
        pinned, slab = self._pin(ticket.source)
        if stream is None:
            slab.external = True  # the training loop gets it: any stream may read it
            ticket.result = pinned
            return
        ticket.slot = slot = self._take_slot()
        weakref.finalize(ticket, self._free_slot, slot).atexit = False  # a batch dropped untaken frees it too
        with torch.cuda.stream(stream):
            ticket.result = pinned.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        slab.fence = event  # set before the pinned copy dies below: its slab is reused only after the copy
        ticket.event = self.last_copy_event = event
        self.stats.device_copies += 1

    def _pin(self, source: Batch) -> tuple[Batch, Slab]:
        tensors = _tensors_of(source)
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        slab, view = self.pool.lease(total, lambda: self._closed)
        slab.device_index = self._device_index
        lease = torch.frombuffer(view, dtype=torch.uint8)  # its storage keeps `view` (the lease) alive
        out = []
        for t, off in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            dst = lease[off:off + nbytes].view(t.dtype).view(t.shape)
            _copy(dst, t)
            out.append(dst)
        self.stats.staged += 1
        self.stats.copied_tensors += len(tensors)
        self.stats.copied_bytes += total
        return _batch_of(source, out), slab

    def _take_slot(self) -> list:
        with self._slots:
            while self._ahead >= DEVICE_AHEAD:
                if self._closed:
                    raise StagingClosed("closed")
                self._slots.wait(WAIT_POLL_S)
            self._ahead += 1
        return [True]

    def _free_slot(self, slot: Optional[list]) -> None:
        if slot is not None and slot[0]:
            slot[0] = False
            with self._slots:
                self._ahead -= 1
                self._slots.notify_all()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One copy on this thread only (numpy's, which releases the GIL); torch's ``copy_``
    would start an intra-op thread team of its own beside the training thread's."""
    try:
        np.copyto(dst.numpy(), src.numpy(), casting="no")
    except (TypeError, RuntimeError):  # a dtype numpy lacks
        dst.copy_(src)


def _tensors_of(batch: Batch) -> list[torch.Tensor]:
    kjt = batch.sparse_features
    out = [batch.dense_features, batch.labels, kjt._values, kjt._lengths]
    if kjt._weights is not None:
        out.append(kjt._weights)
    out.extend(batch.passthrough.values())
    out.extend(t for t in (batch.weights, batch.padding) if t is not None)
    return out


def _batch_of(source: Batch, tensors: list[torch.Tensor]) -> Batch:
    """``source``'s structure over ``tensors`` (``_tensors_of``'s order)."""
    it = iter(tensors)
    dense, labels, values, lengths = next(it), next(it), next(it), next(it)
    kjt = source.sparse_features
    weights = next(it) if kjt._weights is not None else None
    sparse = KeyedJaggedTensor(kjt._keys, values, lengths, weights, kjt._stride, kjt._scored)
    passthrough = {k: next(it) for k in source.passthrough}
    row_weights = next(it) if source.weights is not None else None
    padding = next(it) if source.padding is not None else None
    return Batch(dense, sparse, labels, passthrough, row_weights, padding)


# -- the loader's side --------------------------------------------------------------------------------
class StagingFetcher:
    """The epoch stream's fetcher, with every piece it receives wrapped in a ``StagedBatch``
    (and queued for its copy when it will be handed out whole). Everything else is the
    fetcher's own."""

    def __init__(self, fetcher: Any, stager: Stager, run: Any, batch_size: int) -> None:
        object.__setattr__(self, "_fetcher", fetcher)
        object.__setattr__(self, "_stager", stager)
        object.__setattr__(self, "_run", run)
        object.__setattr__(self, "_batch_size", batch_size)

    def poll(self, timeout_ms: int) -> list:
        run, stager = self._run, self._stager
        cursors, out = run.assembler.cursors, []
        for split_id, piece, batch in self._fetcher.poll(timeout_ms):
            padded = bool(run.splits.get(split_id, (0, 0, 0, False))[3])
            if padded:
                batch = batch.as_padding()  # staged with its padding (the stream marks it again: a no-op)
            c = cursors.get(split_id)
            # A piece is handed out as it is when whole and not the first after a resumed
            # position (whose used rows are skipped); otherwise it is merged, and staged merged.
            whole = len(batch) == self._batch_size and not (
                c is not None and piece == c.consumed_pieces and c.consumed_rows_in_piece)
            out.append((split_id, piece, stager.wrap(batch, stage=whole, padded=padded)))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fetcher, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fetcher, name, value)


def staged_batches(stream: Any, run: Any, pool: SlabPool, device: Optional[torch.device], batch_size: int,
                   timeout: float, stats: Optional[StagingStats] = None) -> Iterator[Batch]:
    """``stream.batches()`` (an ``EpochStream``), each batch handed out as its staged copy.
    The staging thread lives exactly as long as this generator."""
    stager = Stager(pool, device, timeout, stats)
    try:
        stream.fetcher = StagingFetcher(stream.fetcher, stager, run, batch_size)
        batches = stream.batches()
        try:
            for batch in batches:
                yield stager.take(batch)
        finally:
            batches.close()
    finally:
        stager.close()
