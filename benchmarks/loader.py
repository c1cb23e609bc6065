"""RemoteDataLoader (embedded, N workers) vs torch DataLoader over LocalDataset (N workers).

Same table, same spec, same run, alternating rounds; prints rows/s of each and the
ratio. Run: ``.venv/bin/python -m benchmarks.loader [--rows 400000] [--workers 2]``.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from remoteloader import LocalDataset, RemoteDataLoader
from remoteloader.tools.datagen import generate_table


def bench_spec(table: str, dense: int, sparse: int, batch_size: int) -> dict:
    return {
        "table": {"path": table},
        "features": {
            "label": "label",
            "dense": [{"name": f"d{i}", "column": f"float_{i}", "transforms": [{"op": "clamp", "min": 0.0, "max": 1e4}]}
                      for i in range(dense)],
            "sparse": [{"name": f"s{i}", "column": f"idlist_{i}",
                        "transforms": [{"op": "firstx", "x": 50}, {"op": "sigrid_hash", "salt": i, "max_value": 1 << 20}]}
                       for i in range(sparse)],
        },
        "batch_size": batch_size,
    }


def consume(batches) -> tuple[int, float]:
    """Rows and seconds, timed from the first batch (start-up is reported apart)."""
    it = iter(batches)
    first = next(it)
    rows, start = len(first), time.perf_counter()
    for b in it:
        rows += len(b)
    return rows - len(first), time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", default="data/bench")
    p.add_argument("--rows", type=int, default=400_000)
    p.add_argument("--dense", type=int, default=13)
    p.add_argument("--sparse", type=int, default=26)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    table = Path(args.data)
    if not table.exists():
        generate_table(str(table), rows=args.rows, partitions=4, dense=args.dense, sparse=args.sparse, format="orc",
                       seed=1, stripe_size=8 << 20)
    spec = bench_spec(str(table.resolve()), args.dense, args.sparse, args.batch_size)

    local_rates, remote_rates = [], []
    t0 = time.perf_counter()
    loader = RemoteDataLoader(spec, num_workers=args.workers)
    len(loader)
    startup = time.perf_counter() - t0
    try:
        for r in range(args.rounds):
            dl = torch.utils.data.DataLoader(LocalDataset(spec), batch_size=None, num_workers=args.workers,
                                             persistent_workers=False)
            rows, secs = consume(dl)
            local_rates.append(rows / secs)
            rows, secs = consume(loader)
            remote_rates.append(rows / secs)
            print(f"round {r}: local {local_rates[-1]:,.0f} rows/s   remote {remote_rates[-1]:,.0f} rows/s")
    finally:
        loader.close()
    local, remote = statistics.median(local_rates), statistics.median(remote_rates)
    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"table: {args.rows:,} rows, {args.dense} dense + {args.sparse} sparse, ORC; batch {args.batch_size}; "
          f"{args.workers} workers; embedded start-up {startup:.1f} s")
    print("| loader | rows/s (median of %d) |" % args.rounds)
    print("|---|---|")
    print(f"| torch DataLoader(LocalDataset, num_workers={args.workers}) | {local:,.0f} |")
    print(f"| RemoteDataLoader (embedded, {args.workers} workers) | {remote:,.0f} |")
    print(f"| ratio remote / local | {remote / local:.2f}x |")


if __name__ == "__main__":
    main()
