"""RemoteDataLoader against the machine's own limit: the decode + transform floor.

The floor is the work a worker must do, and nothing else: the same split processor
(read the projected columns, transform, cut into pieces) in one process per core, each
taking its share of the epoch's splits, no transport, no assembly, no training loop.
Against it, in the same run and alternating rounds: ``RemoteDataLoader`` (embedded,
``--workers`` workers) and torch ``DataLoader`` over ``LocalDataset`` with as many
worker processes. Reported: rows/s of each (median of the rounds), remoteloader as a
fraction of the floor, and remoteloader over torch.

Run: ``.venv/bin/python -m benchmarks.floor [--rows 960000 --dense 10 --sparse 6 --batch-size 1024]``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.loader import bench_spec, consume
from remoteloader import LocalDataset, RemoteDataLoader
from remoteloader.tools.datagen import generate_table


def _floor_share(spec: dict, shard: int, shards: int, ready: "mp.synchronize.Barrier", out: "mp.Queue") -> None:
    """One process of the floor: bind, compile, wait for the others, then process its splits."""
    from remoteloader.core.binding import bind
    from remoteloader.core.plan import make_task, plan_epoch
    from remoteloader.core.processor import SplitProcessor
    from remoteloader.core.sampling import plan_job_splits
    from remoteloader.spec import load_spec

    loaded = load_spec(spec)
    bound = bind(loaded)
    base = plan_job_splits(bound)
    files = list(bound.files or [])
    plan = plan_epoch(base, 0, loaded.seed, loaded.shuffle, 1, loaded.batch_size)[shard::shards]
    processor = SplitProcessor(bound)
    processor.warm_up()
    ready.wait()
    start, rows = time.perf_counter(), 0
    for split in plan:
        for piece in processor.pieces(make_task(files, base[split.base], split, 0)):
            rows += piece.rows
    out.put((rows, start, time.perf_counter()))


def floor_rate(spec: dict, processes: int, table_rows: int) -> float:
    """Rows/s of ``processes`` processes running the split processor over the whole epoch."""
    ctx = mp.get_context("spawn")
    ready, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_floor_share, args=(spec, i, processes, ready, out)) for i in range(processes)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    rows = sum(r for r, _, _ in results)
    assert rows == table_rows, f"the floor processed {rows} rows, not the table's {table_rows}"
    return rows / (max(end for _, _, end in results) - min(start for _, start, _ in results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=960_000, help="4x the issue's 240k: an epoch long enough to time")
    p.add_argument("--dense", type=int, default=10)
    p.add_argument("--sparse", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2, help="remoteloader workers, DataLoader workers, floor processes")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    table = Path(tempfile.mkdtemp(prefix="rl-floor-")) / "t"
    generate_table(str(table), rows=args.rows, partitions=4, dense=args.dense, sparse=args.sparse, format="orc",
                   seed=1, stripe_size=8 << 20, progress=False)
    spec = bench_spec(str(table), args.dense, args.sparse, args.batch_size)
    rates: dict[str, list[float]] = {"floor": [], "remote": [], "torch": []}
    for r in range(args.rounds):
        rates["floor"].append(floor_rate(spec, args.workers, args.rows))
        # A fresh loader each round, timed from its first batch: its workers get no head start
        # from idle time between rounds (they would prefetch the next epoch in it).
        with RemoteDataLoader(spec, num_workers=args.workers) as loader:
            rows, secs = consume(loader)
        rates["remote"].append(rows / secs)
        dl = torch.utils.data.DataLoader(LocalDataset(spec), batch_size=None, num_workers=args.workers)
        rows, secs = consume(dl)
        rates["torch"].append(rows / secs)
        print(f"round {r}: " + "   ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\n{args.rows:,} rows, {args.dense} dense + {args.sparse} sparse (clamp, firstx + sigrid_hash), ORC, "
          f"batch {args.batch_size}, {args.workers} workers / processes, {os.cpu_count()} cores; "
          f"median of {args.rounds} rounds\n")
    print(f"{'pipeline':<46} {'rows/s':>10}")
    print(f"{'decode + transform floor (no transport)':<46} {med['floor']:>10,.0f}")
    print(f"{'RemoteDataLoader (embedded)':<46} {med['remote']:>10,.0f}")
    print(f"{'torch DataLoader(LocalDataset)':<46} {med['torch']:>10,.0f}")
    print(f"\nremoteloader / floor {med['remote'] / med['floor']:.0%}   "
          f"remoteloader / torch {med['remote'] / med['torch']:.2f}x")


if __name__ == "__main__":
    main()
