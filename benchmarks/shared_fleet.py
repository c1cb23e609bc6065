"""One shared fleet against separate fleets, and the fair share between jobs (issue 39).

Side by side in one run, on one table:

* **shared vs separate**: two concurrent jobs whose specs share 80% of their features (8 of
  10), each read flat out by one trainer, on one master (no ``--spec``) with 2 workers,
  against the same two jobs on two masters of 1 worker each (the same total size). Reported:
  each job's rows/s, and the workers' CPU seconds per row (both jobs' rows), shared / separate.
* **weights 3:1 when starved**: two jobs of ``share.weight`` 3 and 1, read flat out on one
  master with 1 worker (both starved), and each job's share of the rows consumed while both run.

Run: ``.venv/bin/python -m benchmarks.shared_fleet``.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import psutil

from remoteloader import RemoteDataLoader
from remoteloader.tools.datagen import generate_table

FEATURES = 10
SHARED = 8  # features both jobs read: 80%


def spec(table: Path, features: list[int], **extra) -> dict:
    """A job reading sparse features ``features`` (hashed: work for the workers)."""
    return {"table": {"path": str(table)},
            "features": {"label": "label", "dense": ["float_0"],
                         "sparse": [{"name": f"s{i}", "column": f"idlist_{i}",
                                     "transforms": [{"op": "sigrid_hash", "salt": i, "max_value": 100000}]}
                                    for i in features],
                         "passthrough": ["row_id"]},
            "batch_size": 512, "split_rows": 4096, **extra}


class Master:
    def __init__(self, table: Path, workers: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                                      "--allow-table", str(table), "--workers", str(workers)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.addr = self.proc.stdout.readline().rsplit(" ", 1)[1].strip()
        self.workers = workers

    def worker_cpu_s(self) -> float:
        """CPU seconds (user + system) of its launched workers (and their fork server) so far."""
        total = 0.0
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def wait_for_workers(self) -> None:
        while len(psutil.Process(self.proc.pid).children(recursive=True)) < self.workers + 1:
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Reader(threading.Thread):
    """One trainer reading ``epochs`` epochs flat out; the time and rows of each batch of the last."""

    def __init__(self, addr: str, spec: dict, epochs: int = 1) -> None:
        super().__init__(daemon=True)
        self.addr, self.spec, self.epochs = addr, spec, epochs
        self.times: list[float] = []
        self.rows: list[int] = []
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            with RemoteDataLoader(self.spec, master=self.addr, timeout=180) as loader:
                for epoch in range(self.epochs):
                    loader.set_epoch(epoch)
                    self.times, self.rows = [], []
                    for batch in loader:
                        self.times.append(time.perf_counter())
                        self.rows.append(len(batch.labels))
        except BaseException as e:  # reported by the main thread
            self.error = e

    def rate(self) -> float:
        return sum(self.rows) / (self.times[-1] - self.times[0])

    def rows_until(self, t: float) -> int:
        return sum(r for at, r in zip(self.times, self.rows) if at <= t)


def read_all(readers: list[Reader]) -> None:
    for r in readers:
        r.start()
    for r in readers:
        r.join()
        if r.error is not None:
            raise r.error


def shared_vs_separate(table: Path, specs: list[dict], epochs: int) -> dict:
    out = {}
    for layout in ("shared", "separate"):
        masters = [Master(table, 2)] if layout == "shared" else [Master(table, 1), Master(table, 1)]
        try:
            for m in masters:
                m.wait_for_workers()
            before = sum(m.worker_cpu_s() for m in masters)
            readers = [Reader(masters[i % len(masters)].addr, s, epochs) for i, s in enumerate(specs)]
            read_all(readers)
            cpu = sum(m.worker_cpu_s() for m in masters) - before
            rows = sum(sum(r.rows) for r in readers)
            out[layout] = {"rates": [r.rate() for r in readers], "cpu_per_row_us": cpu / rows * 1e6}
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3, help="shared and separate alternate; medians are reported")
    p.add_argument("--epochs", type=int, default=1, help="epochs each trainer reads; the last one is timed")
    args = p.parse_args()
    table = Path(tempfile.mkdtemp(prefix="rl-fleet-")) / "t"
    generate_table(str(table), rows=args.rows, partitions=2, dense=2, sparse=FEATURES + 2, format="orc", seed=3,
                   stripe_size=256 << 10, progress=False)
    a = list(range(FEATURES))
    b = list(range(SHARED)) + [FEATURES, FEATURES + 1]  # 8 of 10 features shared
    rounds = [shared_vs_separate(table, [spec(table, a), spec(table, b)], args.epochs) for _ in range(args.rounds)]
    side = {layout: {"rates": [statistics.median(r[layout]["rates"][j] for r in rounds) for j in range(2)],
                     "cpu_per_row_us": statistics.median(r[layout]["cpu_per_row_us"] for r in rounds)}
            for layout in ("shared", "separate")}
    print(f"{args.rows:,} rows, two jobs sharing {SHARED} of {FEATURES} sparse features, one trainer each, flat out; "
          f"medians of {args.rounds} rounds, epoch {args.epochs - 1} timed")
    print("| fleet | job A rows/s | job B rows/s | worker CPU µs/row |")
    print("|---|---:|---:|---:|")
    for layout, r in side.items():
        print(f"| {layout} ({'1 master, 2 workers' if layout == 'shared' else '2 masters, 1 worker each'}) | "
              f"{r['rates'][0]:,.0f} | {r['rates'][1]:,.0f} | {r['cpu_per_row_us']:.1f} |")
    s, d = side["shared"], side["separate"]
    print(f"| shared / separate | {s['rates'][0] / d['rates'][0]:.2f}x | {s['rates'][1] / d['rates'][1]:.2f}x | "
          f"{s['cpu_per_row_us'] / d['cpu_per_row_us']:.2f}x |")
    for i, r in enumerate(rounds):
        print(f"round {i}: shared / separate rows/s " + ", ".join(
            f"{r['shared']['rates'][j] / r['separate']['rates'][j]:.2f}x" for j in range(2)) +
              f"; CPU/row {r['shared']['cpu_per_row_us'] / r['separate']['cpu_per_row_us']:.2f}x")
    heavy, light = weighted(table, spec(table, a, share={"weight": 3}), spec(table, a, seed=1))
    print(f"\nweights 3:1 on 1 worker, both starved: rows while both read {heavy:,} : {light:,} = "
          f"{heavy / max(light, 1):.2f} : 1 (share of the heavy job {heavy / max(heavy + light, 1):.1%}, target 75%)")


if __name__ == "__main__":
    main()
