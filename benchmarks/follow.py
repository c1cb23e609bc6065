"""What following a growing table costs (issue 40 item 1), side by side in one run.

1. **Rows/s, following vs a fixed table of the same size.** Two tables hold the same files
   (hard links of ``benchmarks.order.make_table``'s partitions): ``fixed`` has them all; the
   following table starts with the first half, the rest waiting under a ``_staged`` directory
   (listings skip ``_`` names), and lands them (one ``rename`` each, as a writer commits a
   partition) after the job's first batch. The fixed job reads one epoch; the following job
   (``table.follow: {every: 0.5s, until: <last partition>}``) reads its windows until the
   stream ends: window 0 (the first half), window 1 (what landed), then an empty window.
   Both read every row once; each is timed from its first ``iter()`` to its last batch, one
   trainer rank consuming flat out, real processes on 127.0.0.1 (a fresh ``remoteloader-master
   --workers 0`` and ``--workers`` standalone workers per job, as ``benchmarks/order.py``).
   Rounds alternate which job runs first; the ratio is the median of the rounds' ratios.
   Target: following / fixed >= 0.95.
2. **The master's CPU for re-listing a table of 10,000 files**: the follower's re-listing
   (``master/follow.py``: one recursive listing, a ``stat`` of every file listed before to
   check its identity, footers of new files only), timed on its own thread (``thread_time``)
   as the master runs it, with nothing new and with one new partition of 100 files; and the
   first listing (bind: every footer and schema) for scale. The files are hard links of one
   small Parquet file, so the listing, not the writing, is what is measured.

Run: ``.venv/bin/python -m benchmarks.follow [--quick]`` (defaults: 2M rows, 3 rounds, 2
workers: about 4 minutes on 2 cores; ``--quick``: 400k rows, 1 round, 2,000 files).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.auth_cost import job_spec, run_directory
from benchmarks.order import cluster, make_table
from remoteloader import RemoteDataLoader
from remoteloader.core.binding import bind
from remoteloader.core.sampling import plan_job_splits
from remoteloader.master.follow import Follower
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


def timed_fixed(table: Path, workers: int) -> tuple[int, float]:
    with cluster(table, workers) as (addr, _):
        with RemoteDataLoader(job_spec(table), master=addr, timeout=120) as loader:
            assert loader.sparse_keys  # hello: the master binds before the clock starts, as for the other job
            start, rows = time.perf_counter(), 0
            for b in loader:
                rows += len(b)
            return rows, time.perf_counter() - start


def timed_follow(table: Path, later: list[str], workers: int) -> tuple[int, float, int, float]:
    """(rows, seconds, windows with rows, the seconds between the last batch of window 0 and
    the first of window 1) of a following job over ``table``, landing ``later`` after its
    first batch."""
    spec = job_spec(table)
    spec["table"]["follow"] = {"every": 0.5, "until": later[-1]}
    with cluster(table, workers) as (addr, _):
        with RemoteDataLoader(spec, master=addr, timeout=120) as loader:
            assert loader.sparse_keys
            start, rows, windows, times = time.perf_counter(), 0, 0, []
            while True:
                n = 0
                times.append([])
                for b in loader:
                    if rows == 0:
                        for name in later:
                            os.rename(table / "_staged" / name, table / name)
                    rows, n = rows + len(b), n + 1
                    times[-1].append(time.perf_counter())
                if n == 0:
                    seconds = time.perf_counter() - start
                    break
                windows += 1
    return rows, seconds, windows, times[1][0] - times[0][-1] if windows >= 2 else float("nan")


def unstage(table: Path, later: list[str]) -> None:
    """Back to the start: the landed partitions staged again."""
    for name in later:
        if (table / name).exists():
            os.rename(table / name, table / "_staged" / name)


def throughput(root: Path, rows: int, rounds: int, workers: int) -> list[float]:
    fixed = make_table(root, rows, copies=4, stripe_rows=STRIPE_ROWS)
    table, later = follow_table(fixed, root)
    ratios = []
    for r in range(rounds):
        order = ("fixed", "follow") if r % 2 == 0 else ("follow", "fixed")
        got = {}
        for which in order:
            if which == "fixed":
                got[which] = timed_fixed(fixed, workers)
            else:
                unstage(table, later)
                n, seconds, windows, gap = timed_follow(table, later, workers)
                assert windows == 2, f"the following job read {windows} windows, not 2: landing came too late"
                got[which] = (n, seconds)
        assert got["fixed"][0] == got["follow"][0] == rows, got
        rate = {k: n / s for k, (n, s) in got.items()}
        batch_s = got["fixed"][1] / (rows / 1024)  # a batch's share of the fixed job's time
        ratios.append(rate["follow"] / rate["fixed"])
        print(f"round {r + 1}: fixed {rate['fixed']:,.0f} rows/s, following {rate['follow']:,.0f} rows/s "
              f"(2 windows; between them {gap * 1e3:.0f} ms, {gap / batch_s:.1f} batches of the fixed job's time): ratio {ratios[-1]:.3f}", flush=True)
    return ratios


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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="400k rows, 1 round, 2,000 files: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rounds, args.files = 400_000, 1, 2_000
    with run_directory("rl-follow-") as root:
        ratios = throughput(root, args.rows, args.rounds, args.workers)
        cost = relisting(root, args.files)
    median = statistics.median(ratios)
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
