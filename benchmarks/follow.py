"""What following a growing table costs (issue 40 item 1), side by side in one run.

1. **Rows/s, following vs a fixed table of the same size.** Two tables hold the same files
   (hard links of ``benchmarks.order.make_table``'s partitions): ``fixed`` has them all; the
   following table starts with the first half, the rest waiting under a ``_staged`` directory
   (listings skip ``_`` names), and lands them (one ``rename`` each, as a writer commits a
   partition) after the job's first batch. The fixed job reads one epoch; the following job
   (``table.follow: {every: 0.5s, until: <last partition>}``) reads its windows until the
   stream ends: window 0 (the first half), window 1 (what landed), then an empty window.
   Both read every row once; each is timed from its first ``iter()`` to its last batch (the
   end of its stream), one trainer rank consuming flat out, real processes on 127.0.0.1 (a
   fresh ``remoteloader-master --workers 0`` and ``--workers`` standalone workers per job, as
   ``benchmarks/order.py``). The clock starts once the master has bound the job and the
   workers have registered (a worker process starts in 4-9 s on a loaded 2-core host: inside
   the clock that draw swamped the comparison); the trainer's merges of pieces load no numba
   (``jagged.concat_rows`` is numpy only), so no job pays a compile. Rounds go in ABBA order
   (fixed first, following first, following first, fixed first, ...); the ratio is the median
   of the rounds' ratios. Target: following / fixed >= 0.95. Beside it, per job, the median
   phase timeline (to the first batch, each window's batches and rate, between the windows,
   the last batch to the stream's end), the workers' CPU per row, the master's CPU and the
   trainer's waits for data (``waiting`` answers): structural costs read there, noise in the
   rates.
2. **The master's CPU for re-listing a table of 10,000 files**: the follower's re-listing
   (``master/follow.py``: one recursive listing, a ``stat`` of every file listed before to
   check its identity, footers of new files only), timed on its own thread (``thread_time``)
   as the master runs it, with nothing new and with one new partition of 100 files; and the
   first listing (bind: every footer and schema) for scale. The files are hard links of one
   small Parquet file, so the listing, not the writing, is what is measured.

Run: ``.venv/bin/python -m benchmarks.follow [--quick]`` (defaults: 2M rows, 4 rounds, 2
workers: about 4 minutes on 2 cores; ``--quick``: 400k rows, 1 round, 2,000 files).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil
import zmq

from benchmarks.auth_cost import job_spec, run_directory
from benchmarks.order import cluster, make_table
from remoteloader import RemoteDataLoader
from remoteloader.client.session import DataWait
from remoteloader.core.binding import bind
from remoteloader.core.sampling import plan_job_splits
from remoteloader.master.follow import Follower
from remoteloader.protocol.messages import Status
from remoteloader.protocol.rpc import RpcClient
from remoteloader.spec import DatasetSpec
from tests.follow_tables import land_partition

TARGET = 0.95
STRIPE_ROWS = 16384


def follow_table(fixed: Path, root: Path) -> tuple[Path, list[str]]:
    """The fixed table's files under another root: the first half of its partitions in place,
    the rest staged to land later; the staged partitions' names, in order."""
    table = root / "follow"
    parts = sorted(p.name for p in fixed.iterdir())
    later = parts[len(parts) // 2:]
    for name in parts:
        target = table / ("_staged" if name in later else "") / name
        target.mkdir(parents=True)
        for f in (fixed / name).iterdir():
            os.link(f, target / f.name)
    return table, later


@dataclass
class Timeline:
    """One job as its trainer saw it (``perf_counter`` seconds): its first ``iter()``, each
    window's batch times and rows (a fixed table: one window; a stream: its windows, the
    empty last one included) and when each window's ``StopIteration`` came; the CPU its
    worker processes and its master spent meanwhile, and its waits for data."""

    start: float
    windows: list[tuple[list[float], int]] = field(default_factory=list)
    stops: list[float] = field(default_factory=list)
    worker_cpu_s: float = 0.0
    master_cpu_s: float = 0.0
    data_wait: DataWait = field(default_factory=DataWait)

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.windows)

    @property
    def rate(self) -> float:
        """Rows/s from the first ``iter()`` to the end of the last batch's iteration (the
        benchmark's figure)."""
        return self.rows / (self.stops[-1] - self.start)

    @property
    def read(self) -> list[tuple[list[float], int]]:
        return [(times, n) for times, n in self.windows if times]

    def phases(self) -> dict[str, float]:
        """Seconds of each phase: to the first batch (the epoch's start: plan, first split
        read), each window's batches (first to last), between windows (the last batch of one
        to the first of the next), and the end (the last batch to the stream's end: its
        ``StopIteration``, and a stream's empty window); its rates, workers' CPU per row."""
        read = self.read
        out = {"first_batch_s": read[0][0][0] - self.start, "end_s": self.stops[-1] - read[-1][0][-1],
               "between_s": sum(b[0][0] - a[0][-1] for a, b in zip(read, read[1:])),
               "worker_us_per_row": 1e6 * self.worker_cpu_s / self.rows, "master_cpu_s": self.master_cpu_s,
               "waiting_answers": self.data_wait.answers, "waiting_s": self.data_wait.seconds}
        for i, (times, n) in enumerate(read):
            out[f"window{i}_s"] = times[-1] - times[0]
            out[f"window{i}_rows_s"] = n / (times[-1] - times[0])
        return out


def structural_ratio(fixed: Timeline, follow: Timeline) -> float:
    """The ratio if following cost only what it adds to the timeline (the time between its
    windows and its longer end: another window's start, the empty window) and the rates were
    otherwise equal: a view that the host's noise in the rates does not move."""
    p, q = fixed.phases(), follow.phases()
    seconds = fixed.stops[-1] - fixed.start
    return seconds / (seconds + q["between_s"] + q["end_s"] - p["end_s"])


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds of these processes so far."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def ready_cluster(addr: str, workers: int, timeout: float = 120.0) -> int:
    """Wait until ``workers`` workers have registered (started, and given the job); the
    master's pid. A worker process starts in 4-9 s on this host, a draw per job: inside the
    clock it would swamp what is compared (and the following job binds half the footers, so
    its clock would start earlier into its workers' start)."""
    rpc = RpcClient(zmq.Context.instance(), addr, 10.0)
    try:
        deadline = time.monotonic() + timeout
        while len(rpc.call(Status()).status["workers"]) < workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{workers} workers did not register within {timeout:g} s")
            time.sleep(0.05)
    finally:
        rpc.close()
    (master,) = [p.pid for p in psutil.Process().children() if "remoteloader.master" in p.cmdline()]
    return master


def timed(table: Path, workers: int, later: Optional[list[str]] = None) -> Timeline:
    """One job over ``table`` on its own master and workers: a fixed table's one epoch, or
    (``later``: partitions to land after its first batch) a stream's windows to its end."""
    spec = job_spec(table)
    if later:
        spec["table"]["follow"] = {"every": 0.5, "until": later[-1]}
    with cluster(table, workers) as (addr, procs):
        with RemoteDataLoader(spec, master=addr, timeout=120) as loader:
            assert loader.sparse_keys  # hello: the master binds before the clock starts
            master = ready_cluster(addr, workers)
            pids = [p.pid for p in procs]
            cpu = cpu_seconds(pids), cpu_seconds([master])
            run = Timeline(time.perf_counter())
            while True:
                times, rows = [], 0
                for b in loader:
                    if later and not run.windows and not times:
                        for name in later:
                            os.rename(table / "_staged" / name, table / name)
                    rows += len(b)
                    times.append(time.perf_counter())
                run.stops.append(time.perf_counter())
                run.windows.append((times, rows))
                if not later or not times:
                    break
            run.worker_cpu_s = cpu_seconds(pids) - cpu[0]
            run.master_cpu_s = cpu_seconds([master]) - cpu[1]
            run.data_wait = loader.session.data_wait
    return run


def unstage(table: Path, later: list[str]) -> None:
    """Back to the start: the landed partitions staged again."""
    for name in later:
        if (table / name).exists():
            os.rename(table / name, table / "_staged" / name)


def throughput(root: Path, rows: int, rounds: int, workers: int) -> list[tuple[Timeline, Timeline]]:
    """(fixed, following) of each round, the rounds in ABBA order."""
    fixed = make_table(root, rows, copies=4, stripe_rows=STRIPE_ROWS)
    table, later = follow_table(fixed, root)
    out = []
    for r in range(rounds):
        order = ("fixed", "follow") if r % 4 in (0, 3) else ("follow", "fixed")
        got = {}
        for which in order:
            if which == "fixed":
                got[which] = timed(fixed, workers)
            else:
                unstage(table, later)
                got[which] = timed(table, workers, later)
                windows = len(got[which].read)
                assert windows >= 2, f"the following job read {windows} window(s), not 2: landing came too late"
        assert got["fixed"].rows == got["follow"].rows == rows, got
        fix, fol = got["fixed"], got["follow"]
        p, q = fix.phases(), fol.phases()
        print(f"round {r + 1} ({' then '.join(order)}): fixed {fix.rate:,.0f} rows/s, following "
              f"{fol.rate:,.0f} rows/s: ratio {fol.rate / fix.rate:.3f} | (fixed / following) first batch "
              f"{p['first_batch_s'] * 1e3:.0f} / {q['first_batch_s'] * 1e3:.0f} ms, between windows "
              f"{q['between_s'] * 1e3:.0f} ms ({len(fol.read)} windows), end {p['end_s'] * 1e3:.0f} / "
              f"{q['end_s'] * 1e3:.0f} ms, workers {p['worker_us_per_row']:.2f} / {q['worker_us_per_row']:.2f} "
              f"us/row, waiting answers {q['waiting_answers']}; structural ratio {structural_ratio(fix, fol):.3f}",
              flush=True)
        out.append((fix, fol))
    return out


def phase_table(runs: list[tuple[Timeline, Timeline]]) -> str:
    """Medians over the rounds of each phase, fixed against following."""
    fixed = [f.phases() for f, _ in runs]
    follow = [f.phases() for _, f in runs]

    def med(rows: list[dict], key: str, scale: float = 1.0) -> str:
        values = [r[key] * scale for r in rows if key in r]
        if not values:
            return "-"
        value = statistics.median(values)
        return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"

    lines = ["| phase (median over rounds) | fixed | following |", "|---|---:|---:|"]
    for label, key, scale in [("rows/s, first iter() to the end", None, 1.0),
                              ("to the first batch, ms", "first_batch_s", 1e3),
                              ("window 0 (fixed: the epoch), its batches, s", "window0_s", 1.0),
                              ("window 0 rows/s", "window0_rows_s", 1.0),
                              ("between windows 0 and 1, ms", "between_s", 1e3),
                              ("window 1, its batches, s", "window1_s", 1.0),
                              ("window 1 rows/s", "window1_rows_s", 1.0),
                              ("last batch to the stream's end, ms", "end_s", 1e3),
                              ("workers' CPU per row, us", "worker_us_per_row", 1.0),
                              ("master's CPU, s", "master_cpu_s", 1.0),
                              ("waiting answers (client)", "waiting_answers", 1.0),
                              ("paused for data (client), s", "waiting_s", 1.0)]:
        if key is None:
            lines.append(f"| {label} | {statistics.median(f.rate for f, _ in runs):,.0f} | "
                         f"{statistics.median(f.rate for _, f in runs):,.0f} |")
        else:
            lines.append(f"| {label} | {med(fixed, key, scale)} | {med(follow, key, scale)} |")
    return "\n".join(lines)


def relisting(root: Path, files: int) -> dict[str, float]:
    """CPU and wall seconds of the follower's re-listing of ``files`` files (and of the first listing)."""
    table = root / "many"
    partitions = files // 100
    land_partition(root / "one", "ds=0", 0, 200)
    (source,) = (root / "one" / "ds=0").iterdir()
    for p in range(partitions):
        part = table / f"ds={p:05d}"
        part.mkdir(parents=True)
        for i in range(100):
            os.link(source, part / f"part-{i:05d}.parquet")
    spec = DatasetSpec.from_dict({"table": {"path": str(table), "follow": {"every": 3600}},
                                  "features": {"label": "label", "dense": ["float_0"], "passthrough": ["row_id"]},
                                  "batch_size": 128})
    wall, cpu = time.perf_counter(), time.process_time()
    bound = bind(spec)
    splits = plan_job_splits(bound)
    first = {"first_listing_s": time.perf_counter() - wall, "first_listing_cpu_s": time.process_time() - cpu}
    follower = Follower(bound, bound.files, splits, spec.split_rows)
    try:
        quiet = [follower.relist_once() and follower.stats.last_cpu_s for _ in range(3)]
        quiet_wall = follower.stats.last_s
        new = table / f"ds={partitions:05d}"
        new.mkdir()
        for i in range(100):
            os.link(source, new / f"part-{i:05d}.parquet")
        grown = follower.relist_once()
        assert len(grown.files) == 100 and follower.take()
        return {**first, "relist_cpu_s": statistics.median(quiet), "relist_s": quiet_wall,
                "relist_100_new_cpu_s": follower.stats.last_cpu_s, "relist_100_new_s": follower.stats.last_s}
    finally:
        follower.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="400k rows, 1 round, 2,000 files: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rounds, args.files = 400_000, 1, 2_000
    with run_directory("rl-follow-") as root:
        runs = throughput(root, args.rows, args.rounds, args.workers)
        cost = relisting(root, args.files)
    ratios = [fol.rate / fix.rate for fix, fol in runs]
    median = statistics.median(ratios)
    print("\n" + phase_table(runs))
    print(f"structural ratio (the fixed job's time against it plus what following adds to the timeline), median: "
          f"{statistics.median(structural_ratio(fix, fol) for fix, fol in runs):.3f}")
    print(f"\nfollowing / fixed rows/s: median {median:.3f} over {len(ratios)} rounds "
          f"({', '.join(f'{r:.3f}' for r in ratios)}); target >= {TARGET}: {'met' if median >= TARGET else 'NOT met'}")
    print(f"re-listing {args.files:,} files (master's follower thread): {cost['relist_cpu_s']:.3f} s CPU, "
          f"{cost['relist_s']:.3f} s wall with nothing new; {cost['relist_100_new_cpu_s']:.3f} s CPU, "
          f"{cost['relist_100_new_s']:.3f} s wall with 100 new files; at every: 60s that is "
          f"{cost['relist_cpu_s'] / 60:.2%} of a core")
    print(f"first listing (bind: every footer and schema): {cost['first_listing_cpu_s']:.2f} s CPU, "
          f"{cost['first_listing_s']:.2f} s wall")
    return 0 if median >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
