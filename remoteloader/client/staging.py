"""Pinned staging: a node after the assembler that builds each batch once, off the training
thread, straight into a reused pinned slab (and, with ``device=``, copies it to the device).

With ``pin_memory=True`` (and an accelerator) or ``device="cuda"``, the loader's epoch runs
through ``StagedBatches``:

* **Order.** The assembler calls ``Stager.submit`` with each batch as it joins its queue
  (``EpochAssembler.on_ready``), so jobs are queued in the order the training loop takes
  batches, and ``Stager.take`` hands out the oldest job's result. The batch the loop waits for
  is therefore always the oldest job, never one queued behind batches taken later (with
  ``device=`` those could hold every device slot, ``DEVICE_AHEAD``, while the batch the loop
  waits for needs one: the hang of issue 36).
* **One copy.** A job is the rows of received pieces that make a batch
  (``assembly.Ready.pieces``): one piece whole, or the rows of several merged. The staging
  thread sizes the batch, leases a slab, and ``batch.concat_rows`` writes the rows straight
  into it: each byte is copied once between the socket's buffer and the batch the model
  gets, on the staging thread (the training thread copies nothing), also for merged batches.
* **Who owns what.** The training thread owns the epoch's stream, fetcher and assembler,
  hence what counts as consumed (a checkpoint holds exactly the batches handed to the
  training loop, as without staging). The staging thread (``remoteloader-pin``, one per
  epoch iterator) owns the copies: a job's result is written by the staging thread only,
  before its ``done`` event is set, and read by the training thread only after it. The
  ``SlabPool`` (one per loader, slabs reused across epochs) is the one piece of shared
  state, behind its own lock: the staging thread leases, and whichever thread drops a
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
  larger than the bound fails with an error naming ``pin_bytes``. The batch the loop waits
  for waits only for slabs the training loop itself still holds, and it says so (a log line
  every 10 s, then ``TimeoutError`` after the loader's ``timeout``).
* **Device.** ``device_copier`` (``CudaCopy``; tests replace it) issues the host-to-device
  copy on a side stream of its own and hands the result to the training thread's current
  stream (``wait_event``, ``record_stream``).
* **Failures and stop.** A job that fails (say, pinned memory exhausted) re-raises in the
  training thread when that batch is taken; a failure of the thread itself at the next
  take. ``close()`` (at the epoch's end, a replaced or closed iterator, ``loader.close()``)
  stops the thread and joins it.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from .batch import Batch, concat_rows
from .node import Node

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
                    if not free:  # no empty class is left behind: eviction below takes from non-empty ones
                        del self._free[size]
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


# -- the device ------------------------------------------------------------------------------------
class CudaCopy:
    """The device side of staging: host-to-device copies on a side stream of ``device``
    (issued by the staging thread), handed over to the training thread's current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any = None

    def open(self) -> None:
        """On the staging thread, before its first copy."""
        torch.cuda.set_device(self.device)
        self.stream = torch.cuda.Stream(self.device)

    def start(self, pinned: Batch) -> tuple[Batch, Any]:
        """The device copy of ``pinned``, issued, and the event that marks it done."""
        with torch.cuda.stream(self.stream):
            out = pinned.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def hand_over(self, batch: Batch, event: Any) -> None:
        """On the training thread: its kernels read ``batch`` only after the copy, and its
        memory is not reused before they are done."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        batch.record_stream(stream)


device_copier: Callable[[torch.device], Any] = CudaCopy  # the device primitive (tests replace it)


# -- jobs -------------------------------------------------------------------------------------------
class Ticket:
    """One batch's job. ``pieces`` (the rows it is made of) is set by the training thread
    before the job is queued; ``result``/``event``/``error`` are written by the staging
    thread before ``done`` is set."""

    __slots__ = ("pieces", "result", "event", "error", "done", "slot", "__weakref__")

    def __init__(self, pieces: list[tuple[Batch, int, int]]) -> None:
        self.pieces: Optional[list] = pieces
        self.result: Optional[Batch] = None
        self.event: Any = None  # with device=: the copy's event
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self.slot: Optional[list] = None  # with device=: [held], one of DEVICE_AHEAD device slots


@dataclass
class StagingStats:
    staged: int = 0  # batches built into slabs
    merged: int = 0  # of which made of rows of several pieces (built there, never on the training thread)
    skipped: int = 0  # jobs whose batch was dropped before its turn (an abandoned epoch)
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
        self.pool, self.timeout = pool, timeout
        self._copier: Any = None
        # The training thread's device, read here (on it): the staging thread binds to it, so
        # its pinned allocations and syncs use that device's context, never device 0's.
        if device is not None:
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._device_index: Optional[int] = index
            self._copier = device_copier(torch.device(device.type, index))
        else:
            self._device_index = torch.cuda.current_device() if _device_ready() else None
        self._jobs: "queue.SimpleQueue[Optional[weakref.ref]]" = queue.SimpleQueue()
        self._slots = threading.Condition()
        self._ahead = 0  # device batches copied and not yet taken (or dropped)
        self._failure: Optional[BaseException] = None
        self._closed = False
        self.stats = stats if stats is not None else StagingStats()  # the loader's: summed over epochs
        self._thread = threading.Thread(target=self._run, name="remoteloader-pin", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- training thread -----------------------------------------------------------------------
    def submit(self, ready: Any) -> Ticket:
        """Queue the job of ``ready`` (an ``assembly.Ready``, or anything with ``pieces``);
        jobs run in the order they are submitted. ``ready`` holds the ticket: a batch dropped
        before its turn is not built."""
        ticket = Ticket(list(ready.pieces))
        ready.ticket = ticket
        self._jobs.put(weakref.ref(ticket))
        return ticket

    def take(self, ticket: Ticket) -> Batch:
        """The staged batch of ``ticket``, waiting for the staging thread if it is not done yet."""
        if self._closed:
            raise StagingClosed("this epoch's pinned staging is closed")
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
        if result is None:
            raise RuntimeError("remoteloader: this staged batch was already taken")
        if self._copier is not None:
            self._copier.hand_over(result, ticket.event)
            self._free_slot(ticket.slot)
        self.stats.taken += 1
        return result

    def _wait(self, ticket: Ticket) -> None:
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
            if self._copier is not None:
                self._copier.open()
            elif self._device_index is not None:
                torch.cuda.set_device(self._device_index)
            while not self._closed:
                ref = self._jobs.get()
                if ref is None or self._closed:
                    break
                ticket = ref()
                if ticket is None:
                    self.stats.skipped += 1
                    continue
                try:
                    self._stage(ticket)
                except StagingClosed as e:
                    ticket.error = e
                    break
                except Exception as e:  # the job's own failure: raised where the batch is taken
                    ticket.error = e
                    self.stats.failures.append(repr(e))
                finally:
                    ticket.pieces = None
                    ticket.done.set()
                    del ticket
        except BaseException as e:
            self._failure = e
            log.exception("the pinned-staging thread failed")

    def _stage(self, ticket: Ticket) -> None:
        pinned, slab = self._build(ticket.pieces)
        if self._copier is None:
            slab.external = True  # the training loop gets it: any stream may read it
            ticket.result = pinned
            return
        ticket.slot = slot = self._take_slot()
        weakref.finalize(ticket, self._free_slot, slot).atexit = False  # a batch dropped untaken frees it too
        ticket.result, event = self._copier.start(pinned)
        slab.fence = event  # set before the pinned copy dies below: its slab is reused only after the copy
        ticket.event = event
        self.stats.device_copies += 1

    def _build(self, pieces: list) -> tuple[Batch, Slab]:
        """The batch of ``pieces``, written once into a leased slab."""
        leased: list[Slab] = []

        def alloc(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
            offsets, total = [], 0
            for shape, dtype in shapes:
                offsets.append(total)
                total += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
            slab, view = self.pool.lease(total, lambda: self._closed)
            slab.device_index = self._device_index
            leased.append(slab)
            lease = torch.frombuffer(view, dtype=torch.uint8)  # its storage keeps `view` (the lease) alive
            self.stats.copied_tensors += len(shapes)
            self.stats.copied_bytes += total
            return [lease[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                    for off, (shape, dtype) in zip(offsets, shapes)]

        batch = concat_rows(pieces, alloc)
        self.stats.staged += 1
        self.stats.merged += len(pieces) > 1 or pieces[0][1] != 0 or pieces[0][2] != len(pieces[0][0])
        return batch, leased[0]

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


# -- the node ---------------------------------------------------------------------------------------
class StagedBatches(Node[Batch]):
    """The stager node, after the assembler: the batches of ``upstream`` (a node of
    ``assembly.Ready``s with an ``on_ready`` hook: the epoch stream), each handed out staged.
    Every batch is submitted as it joins the assembler's queue, so the staging thread works
    ahead of the training loop in the loop's own order. Its state is its upstream's: a batch
    staged and not taken is not consumed. The staging thread lives from ``reset`` to ``close``."""

    def __init__(self, upstream: Any, pool: SlabPool, device: Optional[torch.device], timeout: float,
                 stats: Optional[StagingStats] = None) -> None:
        self.upstream, self.pool, self.device, self.timeout = upstream, pool, device, timeout
        self.stats = stats if stats is not None else StagingStats()
        self._stager: Optional[Stager] = None

    def reset(self, state: Optional[dict] = None) -> None:
        self._stop()
        self._stager = Stager(self.pool, self.device, self.timeout, self.stats)
        self.upstream.on_ready = self._stager.submit  # before the upstream queues anything
        self.upstream.reset(state)

    def get_state(self) -> dict:
        return self.upstream.get_state()

    def next(self) -> Batch:
        if self._stager is None:
            self.reset()
        ready = self.upstream.next()
        return self._stager.take(ready.ticket if ready.ticket is not None else self._stager.submit(ready))

    def close(self) -> None:
        self._stop()
        self.upstream.close()

    def _stop(self) -> None:
        if self._stager is not None:
            self.upstream.on_ready = None
            self._stager.close()
            self._stager = None
