"""One shared fleet against separate fleets, and the fair share between jobs (issue 39).

Side by side in one run, on one table:

* **shared vs separate**: two concurrent jobs whose specs share 80% of their features (8 of
  10), each read flat out by one trainer, on one master (no ``--spec``) with 2 workers,
  against the same two jobs on two masters of 1 worker each (the same total size). Reported:
  each job's rows/s, and the workers' CPU seconds per row (both jobs' rows), shared / separate.
  The specs share about 80% of each job's ids too (job B's own features are chosen of a size
  like job A's own; ``--spare 2 --private last`` is the earlier workload, where B's own two
  held more ids than its eight shared ones). The
  workers share work (issue 39 item 4: a block computed for one job is taken by the other's
  split of the same base split); ``--unshared`` adds the shared fleet without it. CPU per
  row is sampled while both trainers read their timed epoch, per thread (``/proc``): the
  pusher, ZeroMQ's I/O threads, the producer and the rest, so that what each job's serving
  costs shows beside what sharing saves (a thread that ended is not counted: workers' threads
  live as long as the worker).
* **weights 3:1 when starved**: two jobs of ``share.weight`` 3 and 1, read flat out on one
  master with 1 worker (both starved), and each job's share of the rows consumed while both run.
* **priority**: a high-priority trainer that wants part of the fleet (``--step-ms`` per
  batch), alone and beside a low-priority job read flat out: the high job's stall both
  times, and the low job's rows/s meanwhile (it must progress).

Run: ``.venv/bin/python -m benchmarks.shared_fleet`` (its table and processes live in a scratch
directory removed at the end, ``auth_cost.run_directory``).
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import psutil
import pyarrow.compute as pc
from pyarrow import orc

from benchmarks.auth_cost import run_directory
from remoteloader import RemoteDataLoader
from remoteloader.tools.datagen import generate_table
from remoteloader.worker.__main__ import ENV_SHARED_BLOCK_BYTES

FEATURES = 10
SHARED = 8  # features both jobs read: 80%
SPARE = 4  # more columns, for job B's own two


def spec(table: Path, features: list[int], **extra) -> dict:
    """A job reading sparse features ``features`` (hashed: work for the workers)."""
    return {"table": {"path": str(table)},
            "features": {"label": "label", "dense": ["float_0"],
                         "sparse": [{"name": f"s{i}", "column": f"idlist_{i}",
                                     "transforms": [{"op": "sigrid_hash", "salt": i, "max_value": 100000}]}
                                    for i in features],
                         "passthrough": ["row_id"]},
            "batch_size": 512, "split_rows": 4096, **extra}


# A worker's threads: the pusher is its main thread (it owns the data socket: pack, arena
# copy, send, the poll loop), ZeroMQ's I/O threads name themselves, the rest are the producer
# (read, transform, cut, the split RPCs), heartbeats and a cache writer.
THREADS = ("pusher", "zmq", "producer+")


def thread_kind(pid: int, tid: int) -> str:
    """Which of ``THREADS`` thread ``tid`` of worker ``pid`` is."""
    if tid == pid:
        return "pusher"
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return "zmq" if f.read().startswith("ZMQbg") else "producer+"
    except OSError:
        return "producer+"


class Master:
    def __init__(self, table: Path, workers: int, shared_block_bytes: Optional[int] = None) -> None:
        """``shared_block_bytes``: its workers' memo of blocks shared between jobs (None: their default)."""
        env = dict(os.environ)
        if shared_block_bytes is not None:
            env[ENV_SHARED_BLOCK_BYTES] = str(shared_block_bytes)
        self.proc = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                                      "--allow-table", str(table), "--workers", str(workers)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.addr = self.proc.stdout.readline().rsplit(" ", 1)[1].strip()
        self.workers = workers

    def worker_cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) of its launched workers (and their fork server) so far,
        by thread (``THREADS``)."""
        total = dict.fromkeys(THREADS, 0.0)
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                for t in p.threads():
                    total[thread_kind(p.pid, t.id)] += t.user_time + t.system_time
            except psutil.NoSuchProcess:
                pass
        return total

    def status(self) -> dict:
        return json.loads(subprocess.run([sys.executable, "-m", "remoteloader.tools.cli", "status", "--master",
                                          self.addr, "--json"], capture_output=True, text=True, check=True).stdout)

    def wait_for_workers(self) -> None:
        while len(psutil.Process(self.proc.pid).children(recursive=True)) < self.workers + 1:
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Reader(threading.Thread):
    """One trainer reading ``epochs`` epochs flat out, or (``step_s``) taking that long per
    batch: the time and rows of each batch of the last, and the time it waited for batches
    in it after the first (its stall). ``stop`` ends it early."""

    def __init__(self, addr: str, spec: dict, epochs: int = 1, step_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.addr, self.spec, self.epochs, self.step_s = addr, spec, epochs, step_s
        self.times: list[float] = []
        self.rows: list[int] = []
        self.every: list[tuple[float, int]] = []  # (time, rows) of every batch of every epoch
        self.wait_s = 0.0
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            with RemoteDataLoader(self.spec, master=self.addr, timeout=180) as loader:
                for epoch in range(self.epochs):
                    loader.set_epoch(epoch)
                    self.times, self.rows, self.wait_s = [], [], 0.0
                    mark = time.perf_counter()
                    for batch in loader:
                        now = time.perf_counter()
                        if self.times:
                            self.wait_s += now - mark
                        self.times.append(now)
                        self.rows.append(len(batch.labels))
                        self.every.append((now, len(batch.labels)))
                        if self.stop.is_set():
                            return
                        if self.step_s:
                            time.sleep(self.step_s)
                        mark = time.perf_counter()
        except BaseException as e:  # reported by the main thread
            self.error = e

    def rate(self) -> float:
        return sum(self.rows) / (self.times[-1] - self.times[0])

    def stall(self) -> float:
        return self.wait_s / (self.times[-1] - self.times[0])

    def rows_until(self, t: float) -> int:
        return sum(r for at, r in zip(self.times, self.rows) if at <= t)


class CpuSampler(threading.Thread):
    """A master's workers' CPU seconds by thread, sampled every ``interval`` s while the readers read."""

    def __init__(self, master: Master, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.master, self.interval = master, interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.perf_counter(), self.master.worker_cpu_s()))
            self.done.wait(self.interval)

    def at(self, t: float) -> dict[str, float]:
        """CPU seconds by thread at time ``t``, interpolated between the samples around it."""
        times = [s[0] for s in self.samples]
        i = min(max(bisect.bisect_left(times, t), 1), len(times) - 1)
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        share = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return {k: c0[k] + (c1[k] - c0[k]) * share for k in THREADS}


def read_all(readers: list[Reader]) -> None:
    for r in readers:
        r.start()
    for r in readers:
        r.join()
        if r.error is not None:
            raise r.error


LAYOUTS = {"shared": "1 master, 2 workers", "separate": "2 masters, 1 worker each",
           "unshared": "1 master, 2 workers, no shared work"}


def shared_vs_separate(table: Path, specs: list[dict], epochs: int, layouts: tuple[str, ...]) -> dict:
    out = {}
    for layout in layouts:
        if layout == "separate":
            masters = [Master(table, 1), Master(table, 1)]
        else:
            masters = [Master(table, 2, shared_block_bytes=0 if layout == "unshared" else None)]
        try:
            for m in masters:
                m.wait_for_workers()
            samplers = [CpuSampler(m) for m in masters]
            for sampler in samplers:
                sampler.start()
            readers = [Reader(masters[i % len(masters)].addr, s, epochs) for i, s in enumerate(specs)]
            try:
                read_all(readers)
            finally:
                for sampler in samplers:
                    sampler.done.set()
                    sampler.join()
            # CPU per row over the timed epochs, not the pipelines' compiling at the first split:
            # a fleet's workers' CPU over the rows of its jobs while they all read their timed
            # epoch (the shared fleet: while both do, not one job finishing alone).
            cpu, rows = dict.fromkeys(THREADS, 0.0), 0.0
            for i, sampler in enumerate(samplers):
                own = readers[i::len(samplers)]
                start, end = max(r.times[0] for r in own), min(r.times[-1] for r in own)
                if end <= start:
                    raise RuntimeError(f"{layout}: the jobs' timed epochs did not overlap; use more --rows")
                rows += sum(r.rows_until(end) - r.rows_until(start) for r in own)
                at_end, at_start = sampler.at(end), sampler.at(start)
                for k in THREADS:
                    cpu[k] += at_end[k] - at_start[k]
            out[layout] = {"rates": [r.rate() for r in readers], "cpu_per_row_us": sum(cpu.values()) / rows * 1e6,
                           "threads_us": {k: cpu[k] / rows * 1e6 for k in THREADS}}
            if layout == "shared":
                out["shared_work"] = masters[0].status()["shared_work"]
        finally:
            for m in masters:
                m.stop()
    return out


def weighted(table: Path, heavy: dict, light: dict) -> tuple[int, int]:
    """Rows each job consumed while both ran, on one starved worker."""
    master = Master(table, 1)
    try:
        master.wait_for_workers()
        readers = [Reader(master.addr, heavy), Reader(master.addr, light)]
        read_all(readers)
        both = min(r.times[-1] for r in readers)  # until the first one finished
        start = max(r.times[0] for r in readers)  # from when both read
        return tuple(r.rows_until(both) - r.rows_until(start) for r in readers)
    finally:
        master.stop()


def priority(table: Path, high: dict, low: dict, step_s: float) -> dict:
    """A high-priority trainer taking ``step_s`` per batch (wanting part of the fleet) on one
    master with 2 workers, alone and then beside a low-priority job read flat out: its stall
    (the share of its timed epoch spent waiting for batches) both times, and the low job's
    rows/s meanwhile."""
    out = {}
    for beside in (False, True):
        master = Master(table, 2)
        try:
            master.wait_for_workers()
            paced = Reader(master.addr, high, epochs=2, step_s=step_s)
            readers = [paced] + ([Reader(master.addr, low, epochs=1000)] if beside else [])
            for r in readers:
                r.start()
            paced.join()
            for r in readers[1:]:
                r.stop.set()
                r.join()
            for r in readers:
                if r.error is not None:
                    raise r.error
            out["with_low" if beside else "alone"] = paced.stall()
            out["high_rows_s" if beside else "high_rows_s_alone"] = paced.rate()
            if beside:
                flat = readers[1]
                start, end = paced.times[0], paced.times[-1]
                out["low_rows_s"] = sum(n for at, n in flat.every if start < at <= end) / (end - start)
        finally:
            master.stop()
    return out


def ids_per_row(table: Path, columns: int) -> list[float]:
    """Mean ids per row of ``idlist_0 .. idlist_{columns - 1}``: what a feature costs to read and hash."""
    files = sorted(table.rglob("*.orc"))
    lengths = [0.0] * columns
    rows = 0
    for f in files:
        t = orc.ORCFile(str(f)).read(columns=[f"idlist_{i}" for i in range(columns)])
        rows += t.num_rows
        for i in range(columns):
            lengths[i] += pc.sum(pc.list_value_length(t.column(i))).as_py() or 0
    return [n / rows for n in lengths]


def choose_features(sizes: list[float], private: str) -> tuple[list[int], list[int]]:
    """Job A reads the first ``FEATURES`` columns; job B the first ``SHARED`` of them and two
    of the spare ones: with ``matched``, the two closest in ids per row to A's own two, so
    that the jobs share 80% of their work as well as of their features; with ``last``, the
    last two, whatever their size."""
    a = list(range(FEATURES))
    spare = list(range(FEATURES, len(sizes)))
    if private == "last":
        return a, list(range(SHARED)) + spare[-2:]
    own = []
    for i in a[SHARED:]:
        best = min((j for j in spare if j not in own), key=lambda j: abs(sizes[j] - sizes[i]))
        own.append(best)
    return a, list(range(SHARED)) + own


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3, help="shared and separate alternate; medians are reported")
    p.add_argument("--epochs", type=int, default=2,
                   help="epochs each trainer reads; the last one is timed (the first compiles the pipelines)")
    p.add_argument("--private", choices=("matched", "last"), default="matched",
                   help="job B's two features of its own: of a size like job A's own two, or the last two columns "
                        "(with --spare 2: the workload of the runs before shared work, whose two held 3x the ids)")
    p.add_argument("--spare", type=int, default=SPARE, help="sparse columns beyond job A's, for job B's own two")
    p.add_argument("--step-ms", type=float, default=15.0,
                   help="the high-priority trainer's time per batch in the priority measurement")
    p.add_argument("--unshared", action="store_true",
                   help="also run the shared fleet without shared work (workers' --shared-block-bytes 0)")
    args = p.parse_args()
    with run_directory("rl-fleet-") as tmp:
        run(args, tmp / "t")


def run(args: argparse.Namespace, table: Path) -> None:
    generate_table(str(table), rows=args.rows, partitions=2, dense=2, sparse=FEATURES + args.spare, format="orc",
                   seed=3, stripe_size=256 << 10, progress=False)
    sizes = ids_per_row(table, FEATURES + args.spare)
    a, b = choose_features(sizes, args.private)
    shared_ids = sum(sizes[i] for i in range(SHARED))
    print(f"job A reads idlist {a}, job B {b}; ids per row shared {shared_ids:.1f}, A's own "
          f"{sum(sizes[i] for i in a[SHARED:]):.1f}, B's own {sum(sizes[i] for i in b[SHARED:]):.1f} "
          f"(B's work shared: {shared_ids / sum(sizes[i] for i in b):.0%}, "
          f"A's: {shared_ids / sum(sizes[i] for i in a):.0%})")
    layouts = ("shared", "separate") + (("unshared",) if args.unshared else ())
    rounds = [shared_vs_separate(table, [spec(table, a), spec(table, b)], args.epochs, layouts)
              for _ in range(args.rounds)]
    side = {layout: {"rates": [statistics.median(r[layout]["rates"][j] for r in rounds) for j in range(2)],
                     "cpu_per_row_us": statistics.median(r[layout]["cpu_per_row_us"] for r in rounds),
                     "threads_us": {k: statistics.median(r[layout]["threads_us"][k] for r in rounds) for k in THREADS}}
            for layout in layouts}
    print(f"{args.rows:,} rows, two jobs sharing {SHARED} of {FEATURES} sparse features, one trainer each, flat out; "
          f"medians of {args.rounds} rounds, epoch {args.epochs - 1} timed")
    print("| fleet | job A rows/s | job B rows/s | worker CPU µs/row |")
    print("|---|---:|---:|---:|")
    for layout, r in side.items():
        print(f"| {layout} ({LAYOUTS[layout]}) | {r['rates'][0]:,.0f} | {r['rates'][1]:,.0f} | "
              f"{r['cpu_per_row_us']:.1f} |")
    print("worker CPU µs/row by thread (medians): " + "; ".join(
        f"{layout} " + ", ".join(f"{k} {r['threads_us'][k]:.2f}" for k in THREADS) for layout, r in side.items()))
    d = side["separate"]
    for layout in ("shared", "unshared")[:len(layouts) - 1]:
        s = side[layout]
        print(f"| {layout} / separate | {s['rates'][0] / d['rates'][0]:.2f}x | {s['rates'][1] / d['rates'][1]:.2f}x | "
              f"{s['cpu_per_row_us'] / d['cpu_per_row_us']:.2f}x |")
    for i, r in enumerate(rounds):
        w = r["shared_work"]
        print(f"round {i}: shared / separate rows/s " + ", ".join(
            f"{r['shared']['rates'][j] / r['separate']['rates'][j]:.2f}x" for j in range(2)) +
              f"; CPU/row {r['shared']['cpu_per_row_us'] / r['separate']['cpu_per_row_us']:.2f}x; "
              f"shared blocks {w.get('hits', 0):,.0f} ({w.get('hit_bytes', 0) / 2**20:,.0f} MiB), kept "
              f"{w.get('puts', 0):,.0f}, expired {w.get('expired', 0):,.0f}; splits deferred {w['deferred']}, "
              f"waits {w['waited']}")
    heavy, light = weighted(table, spec(table, a, share={"weight": 3}), spec(table, a, seed=1))
    high, low = spec(table, a, share={"priority": "high"}), spec(table, b, seed=1, share={"priority": "low"})
    stalls = [priority(table, high, low, args.step_ms / 1000) for _ in range(args.rounds)]
    print(f"\npriority: a high-priority trainer taking {args.step_ms:g} ms per batch of 512 on 1 master with 2 "
          f"workers, alone and beside a low-priority job read flat out (its epoch 1 timed; {args.rounds} rounds)")
    print("| round | high's stall alone | high's stall beside low | high rows/s alone, beside | low rows/s meanwhile |")
    print("|---|---:|---:|---:|---:|")
    for i, r in enumerate(stalls):
        print(f"| {i} | {r['alone']:.1%} | {r['with_low']:.1%} | {r['high_rows_s_alone']:,.0f}, "
              f"{r['high_rows_s']:,.0f} | {r['low_rows_s']:,.0f} |")
    print(f"\nweights 3:1 on 1 worker, both starved: rows while both read {heavy:,} : {light:,} = "
          f"{heavy / max(light, 1):.2f} : 1 (share of the heavy job {heavy / max(heavy + light, 1):.1%}, target 75%)")


if __name__ == "__main__":
    main()
