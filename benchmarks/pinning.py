"""Pinned staging vs pinning on the training thread (issue 26 part 3), side by side in one run.

What the training thread spends per batch to get a pinned batch:

* ``training-thread pin``: today's path, ``Batch.pin_memory()`` on the batch the stream
  yields (one allocation and one copy per tensor, on the training thread);
* ``training-thread copy``: the floor of any pinning on the training thread: the same
  copies into buffers allocated once (as if the allocator cached every block);
* ``staging thread``: ``staging.Stager``: each batch is queued for its copy as it arrives
  (``--ahead`` batches before the loop takes it, as the assembler's queue holds them) and
  the loop takes the copy; its time is the queueing plus any wait for the copy.

Between batches the loop "trains" for ``--step-ms`` without holding the GIL (a GPU-bound
step: the thread waits on the device), which is when the staging thread copies. Rounds
alternate the two paths; the ratio is staging over training-thread pinning (lower is better).

Without CUDA, pinning is mocked: the pinning primitive returns ordinary CPU memory and
``Tensor.pin_memory`` is a ``clone``: this measures the allocation and copy path only, not
page-locking (cudaHostAlloc) nor transfers; the output says so. Run:
``.venv/bin/python -m benchmarks.pinning [--batch-size 4096] [--batches 200] [--step-ms 5]``.
"""
from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import time

import numpy as np
import torch

from remoteloader.client import staging
from remoteloader.client.batch import Batch, batch_tensors


def received_batches(n: int, rows: int, dense: int, sparse: int, ids: int, seed: int = 0) -> list[Batch]:
    """Batches shaped like received ones: tensors viewing numpy arrays (frames)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths = rng.integers(0, 2 * ids + 1, size=sparse * rows, dtype=np.int32)
        arrays = {
            "dense": rng.random((rows, dense), dtype=np.float32),
            "labels": rng.random(rows, dtype=np.float32),
            "sparse.lengths": lengths,
            "sparse.values": rng.integers(0, 1 << 40, size=int(lengths.sum()), dtype=np.int64),
        }
        out.append(Batch.from_numpy(arrays, [f"s{i}" for i in range(sparse)]))
    return out


def mock_pinning() -> None:
    """Pinning without an accelerator, as ``tests/test_pinning.py`` fakes it, for a whole
    ``RemoteDataLoader(pin_memory=True)``: the staging thread's pinned slabs are ordinary CPU
    memory (``staging.alloc_pinned`` replaced) and the loader is told an accelerator is there
    (``torch.cuda.is_available`` patched). What it measures is the staging copy and its thread,
    not page-locking (cudaHostAlloc) nor transfers. Call only where CUDA is absent."""
    staging.alloc_pinned = lambda n: torch.empty(n, dtype=torch.uint8)  # type: ignore[assignment]
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]


def nbytes(b: Batch) -> int:
    return sum(t.numel() * t.element_size() for t in batch_tensors(b))


def run_baseline(sources: list[Batch], batches: int, step_s: float) -> float:
    spent = 0.0
    for i in range(batches):
        start = time.perf_counter()
        pinned = sources[i % len(sources)].pin_memory()
        spent += time.perf_counter() - start
        time.sleep(step_s)
        del pinned
    return spent / batches


def run_copy_floor(sources: list[Batch], batches: int, step_s: float) -> float:
    buffers = [[torch.empty_like(t) for t in batch_tensors(b)] for b in sources]
    spent = 0.0
    for i in range(batches):
        start = time.perf_counter()
        for dst, src in zip(buffers[i % len(sources)], batch_tensors(sources[i % len(sources)])):
            dst.copy_(src)
        spent += time.perf_counter() - start
        time.sleep(step_s)
    return spent / batches


class _Whole:
    """A batch as the assembler hands one to the stager: one received piece, all of it."""

    def __init__(self, batch: Batch) -> None:
        self.pieces, self.ticket = [(batch, 0, len(batch))], None


def run_staging(sources: list[Batch], batches: int, step_s: float, ahead: int, pool: staging.SlabPool,
                stats: staging.StagingStats) -> float:
    stager = staging.Stager(pool, stats=stats)
    try:
        queued = collections.deque(stager.submit(_Whole(sources[i % len(sources)])) for i in range(ahead))
        spent = 0.0
        for i in range(batches):
            start = time.perf_counter()
            pinned = stager.take(queued.popleft())
            queued.append(stager.submit(_Whole(sources[(i + ahead) % len(sources)])))  # the next piece arrives
            spent += time.perf_counter() - start
            time.sleep(step_s)
            del pinned
        return spent / batches
    finally:
        stager.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--dense", type=int, default=13)
    p.add_argument("--sparse", type=int, default=26)
    p.add_argument("--ids", type=int, default=20, help="mean ids per row and sparse feature")
    p.add_argument("--batches", type=int, default=200, help="batches per round and path")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=5.0, help="the training step between batches (GIL released)")
    p.add_argument("--ahead", type=int, default=4, help="batches received before the loop takes them")
    p.add_argument("--pin-bytes", type=int, default=256 << 20)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if not cuda:
        staging.alloc_pinned = lambda n: torch.empty(n, dtype=torch.uint8)  # type: ignore[assignment]
        torch.Tensor.pin_memory = lambda self, *a, **k: self.clone()  # type: ignore[assignment]
    sources = received_batches(8, args.batch_size, args.dense, args.sparse, args.ids)
    size = statistics.mean(nbytes(b) for b in sources)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (load {os.getloadavg()[0]:.1f}), "
          f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads), "
          f"{'CUDA: real pinned memory' if cuda else 'no CUDA: MOCKED pinning (plain CPU allocations and copies)'}")
    if not cuda:
        print("# measures the allocation + copy path on the training thread only: no page-locking, no transfer")
    print(f"# batch {args.batch_size} rows, {args.dense} dense, {args.sparse} sparse x ~{args.ids} ids: "
          f"{size / 2**20:.1f} MiB; step {args.step_ms} ms; {args.ahead} batches ahead; "
          f"{args.batches} batches x {args.rounds} rounds per path")

    pool = staging.SlabPool(args.pin_bytes)
    stats = staging.StagingStats()
    base, floor, staged = [], [], []
    run_baseline(sources, 5, 0.0)  # warm every path once
    run_copy_floor(sources, 5, 0.0)
    run_staging(sources, 5, 0.0, args.ahead, pool, staging.StagingStats())
    for _ in range(args.rounds):
        base.append(run_baseline(sources, args.batches, args.step_ms / 1e3))
        floor.append(run_copy_floor(sources, args.batches, args.step_ms / 1e3))
        staged.append(run_staging(sources, args.batches, args.step_ms / 1e3, args.ahead, pool, stats))
    b, f, s = statistics.median(base), statistics.median(floor), statistics.median(staged)
    print(f"{'path':<22}{'training-thread ms/batch':>26}{'min':>9}{'max':>9}")
    for name, runs in (("training-thread pin", base), ("training-thread copy", floor), ("staging thread", staged)):
        print(f"{name:<22}{statistics.median(runs) * 1e3:>26.3f}{min(runs) * 1e3:>9.3f}{max(runs) * 1e3:>9.3f}")
    print(f"ratio staging / training-thread pin: {s / b:.3f}; staging / training-thread copy: {s / f:.3f}")
    copies = stats.copied_tensors / max(1, stats.staged)
    print(f"staging: {stats.staged} batches, {copies:.1f} tensor copies each (one per tensor), "
          f"{stats.waited} takes waited ({stats.wait_s * 1e3 / max(1, stats.taken):.3f} ms/batch), "
          f"{pool.stats.allocated} slabs allocated, {pool.stats.reused} reuses, "
          f"{pool.stats.waits} waits for a slab, peak {pool.stats.peak_bytes / 2**20:.0f} MiB of {args.pin_bytes / 2**20:.0f}")
    pool.close()


if __name__ == "__main__":
    main()
