"""What the client's ingest costs, per thread, beside the host's memcpy (issue 36): helpers
for ``benchmarks.trainer_cost`` and ``benchmarks.ingest``.

* ``ThreadCpu``: this process's CPU over a window, per thread, from
  ``/proc/self/task/*/stat`` (utime + stime), grouped by thread name: the training thread
  (``MainThread``), libzmq's background threads (``ZMQbg/...``), the staging thread
  (``remoteloader-pin``), the client's control threads, the rest. Python does not name OS
  threads (3.11), so a Python thread's name comes from ``threading.enumerate()`` by its
  ``native_id``; native threads keep their ``comm``. Threads come and go with epochs (one
  staging and one control thread per epoch iterator), so a sampler thread reads every task
  every ``interval`` s, and every Python thread notes its own exact CPU time as it ends
  (``Thread.run`` wrapped while measuring); a thread that ended is counted at that figure.
  What is left (native threads that ended after their last reading, rounding of the
  10 ms ticks) is the ``ended between samples`` row: the process total
  (``getrusage(RUSAGE_SELF)``) less every thread's. The sampler's own CPU is left out of
  the client's.
* ``memcpy_baseline``: the host's one-copy cost in the same run: ``np.copyto`` of a 64 MiB
  buffer into another, already faulted in, repeated: CPU seconds per GB (this thread's
  ``thread_time``) and GB/s. That is the floor any ingest pays once per byte.
* ``batch_nbytes``: what a batch delivers, summed exactly from its public fields.
* ``dlrm_spec`` / ``dlrm_table``: the issue's job: 13 dense (``clamp``) + 26 sparse
  (``firstx 20`` then ``sigrid_hash``) features at batch 4096, on a table from
  ``generate_table(..., stripe_size=16 << 20)``, with the spec's block cache ``write-all``
  so that a master with ``--cache DIR`` has its workers read every feature from the cache
  after the first epoch (they then open no table file and transform nothing: the cheapest
  workers this cluster has).
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from remoteloader.tools.datagen import generate_table

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
SAMPLER = "bench-thread-cpu"
TRAINING = "training thread (MainThread)"
ZMQ = "libzmq threads (ZMQbg/*)"
STAGING = "staging thread (remoteloader-pin)"
CONTROL = "client control threads (remoteloader-control-N)"
ENDED = "ended between samples"


def job_arguments(doc: Optional[str], rounds: int) -> argparse.ArgumentParser:
    """The options of a benchmark of this job: table, epochs, rounds, workers, the spec's shape."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--epochs", type=int, default=3, help="measured epochs per cluster (after the warm-up)")
    p.add_argument("--warm-epochs", type=int, default=1, help="epochs per cluster before measuring")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--dense", type=int, default=13)
    p.add_argument("--sparse", type=int, default=26)
    p.add_argument("--batch-size", type=int, default=4096)
    return p


def dlrm_spec(table: Path, dense: int = 13, sparse: int = 26, batch_size: int = 4096, epochs: int = 3,
              split_rows: int = 32768, cache: bool = True) -> dict:
    """The issue's spec: ``dense`` clamped floats, ``sparse`` id lists (first 20 ids, hashed)."""
    spec = {"table": {"path": str(table)},
            "features": {"label": "label",
                         "dense": [{"name": f"d{i}", "column": f"float_{i}",
                                    "transforms": [{"op": "clamp", "min": -1e6, "max": 1e6}]} for i in range(dense)],
                         "sparse": [{"name": f"s{i}", "column": f"idlist_{i}",
                                     "transforms": [{"op": "firstx", "x": 20},
                                                    {"op": "sigrid_hash", "salt": i, "max_value": 200_000}]}
                                    for i in range(sparse)]},
            "batch_size": batch_size, "split_rows": split_rows}
    if cache:
        spec["cache"] = {"mode": "write-all", "expected_epochs": epochs}
    return spec


def dlrm_table(path: Path, rows: int, dense: int = 13, sparse: int = 26) -> Path:
    generate_table(str(path), rows=rows, partitions=2, dense=dense, sparse=sparse, format="orc", seed=4,
                   stripe_size=16 << 20, progress=False)
    return path


def memcpy_baseline(total_bytes: int = 2 << 30, block: int = 64 << 20, rounds: int = 3) -> dict:
    """One copy of ``total_bytes`` through a ``block``-byte buffer, ``rounds`` times: the median
    CPU seconds per GB and GB/s (of bytes copied, i.e. read once and written once)."""
    src = np.full(block, 7, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # both buffers faulted in: the steady state of a reused buffer
    n = max(1, total_bytes // block)
    cpu, rate = [], []
    for _ in range(rounds):
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(n):
            np.copyto(dst, src)
        c, w = time.thread_time() - c0, time.perf_counter() - w0
        gb = n * block / 1e9
        cpu.append(c / gb)
        rate.append(gb / w)
    return {"cpu_s_gb": statistics.median(cpu), "gb_s": statistics.median(rate)}


def batch_nbytes(b) -> int:
    """The bytes of a batch's tensors (dense, labels, sparse values, lengths and weights,
    passthrough, sampling weights, padding), from its public fields only."""
    kjt = b.sparse_features
    tensors = [b.dense_features, b.labels, kjt.values(), kjt.lengths(), kjt.weights_or_none(),
               *b.passthrough.values(), b.weights, b.padding]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _group(name: str) -> str:
    if name == "MainThread":
        return TRAINING
    if name.startswith("ZMQbg"):
        return ZMQ
    if name == "remoteloader-pin":
        return STAGING
    if name.startswith("remoteloader-control"):
        return CONTROL
    return "other: " + re.sub(r"[-_/]?\d+$", "", name)


def _task_ticks(tid: str) -> Optional[tuple[str, int]]:
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            raw = f.read()
    except OSError:  # it ended
        return None
    comm = raw[raw.index(b"(") + 1:raw.rindex(b")")].decode(errors="replace")
    fields = raw[raw.rindex(b")") + 2:].split()
    return comm, int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)


def _rusage_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


_FINAL: dict[int, tuple[str, float]] = {}  # native id -> (name, its CPU seconds as it ended)


def _record_final_cpu() -> None:
    """Make every Python thread started from now on note its own CPU time as its ``run``
    returns (``time.thread_time``, exact), so a thread that ends between two samples loses
    nothing. Installed once; ``Thread`` subclasses that override ``run`` are not covered
    (the client's threads are plain ``Thread(target=...)``)."""
    if getattr(threading.Thread.run, "_bench_final", False):
        return
    plain_run = threading.Thread.run

    def run(self: threading.Thread) -> None:
        try:
            plain_run(self)
        finally:
            if self.native_id is not None:
                _FINAL[self.native_id] = (self.name, time.thread_time())

    run._bench_final = True  # type: ignore[attr-defined]
    threading.Thread.run = run  # type: ignore[method-assign]


class ThreadCpu:
    """This process's CPU per thread group over a window: ``start()``, ..., ``stop()``."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self._base: dict[str, int] = {}
        self._last: dict[str, tuple[str, int]] = {}
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = 0.0

    def _sample(self) -> None:
        self._names.update({t.native_id: t.name for t in threading.enumerate() if t.native_id is not None})
        for tid in os.listdir("/proc/self/task"):
            got = _task_ticks(tid)
            if got is not None:
                comm, ticks = got
                self._last[tid] = (self._names.get(int(tid), comm), ticks)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> "ThreadCpu":
        _record_final_cpu()
        _FINAL.clear()
        self._sample()
        self._base = {tid: ticks for tid, (_, ticks) in self._last.items()}
        self._t0 = _rusage_s()
        self._thread = threading.Thread(target=self._run, name=SAMPLER, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        """CPU seconds per group over the window, with ``ENDED``, ``SAMPLER`` and ``total``
        (the process's, less the sampler's)."""
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self._sample()
        total = _rusage_s() - self._t0
        groups: dict[str, float] = {}
        spent_by: dict[str, tuple[str, float]] = {
            tid: (name, (ticks - self._base.get(tid, 0)) * TICK_S) for tid, (name, ticks) in self._last.items()}
        for native_id, (name, cpu) in list(_FINAL.items()):  # threads that ended in the window: exact
            tid = str(native_id)
            if not os.path.exists(f"/proc/self/task/{tid}"):
                spent_by[tid] = (name, max(0.0, cpu - self._base.get(tid, 0) * TICK_S))
        for name, spent in spent_by.values():
            key = SAMPLER if name == SAMPLER else _group(name)
            groups[key] = groups.get(key, 0.0) + spent
        groups[ENDED] = max(0.0, total - sum(groups.values()))
        groups["total"] = total - groups.get(SAMPLER, 0.0)
        return groups


OTHER = "other threads"
COLUMNS = (TRAINING, ZMQ, STAGING, CONTROL, OTHER, ENDED)  # what tables print, in this order
SHORT = {TRAINING: "training", ZMQ: "ZMQbg", STAGING: "staging", CONTROL: "control", OTHER: "other",
         ENDED: "ended"}


def collapse(groups: dict[str, float]) -> dict[str, float]:
    """``ThreadCpu.stop()``'s groups as ``COLUMNS`` (every ``other: ...`` summed; no sampler, no total)."""
    out = dict.fromkeys(COLUMNS, 0.0)
    for g, v in groups.items():
        if g in out:
            out[g] += v
        elif g.startswith("other: "):
            out[OTHER] += v
    return out
