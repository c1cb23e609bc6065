"""The epoch boundary: how long the trainer waits for each epoch's first batch, with and
without next-epoch prefetch, on the same table in the same run.

The trainer consumes at a fixed rate that the workers can sustain, so mid-epoch it never
waits; what is left is the boundary. Run: ``.venv/bin/python -m benchmarks.epochs``.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from remoteloader import RemoteDataLoader
from remoteloader.tools.datagen import generate_table


def run(table: Path, epochs: int, step_s: float, extra: list[str]) -> list[float]:
    master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                               "--allow-table", str(table), "--workers", "2", *extra], stdout=subprocess.PIPE, text=True)
    addr = master.stdout.readline().rsplit(" ", 1)[1].strip()
    spec = {"table": {"path": str(table)},
            "features": {"label": "label", "dense": ["float_0", "float_1"],
                         "sparse": [{"name": f"s{i}", "column": f"idlist_{i}",
                                     "transforms": [{"op": "sigrid_hash", "salt": i, "max_value": 100000}]}
                                    for i in range(4)]},
            "batch_size": 256, "split_rows": 4096, "shuffle": True}
    waits = []
    try:
        with RemoteDataLoader(spec, master=addr, timeout=120) as loader:
            for _ in range(epochs):
                start = time.perf_counter()
                for i, _batch in enumerate(loader):
                    if i == 0:
                        waits.append(time.perf_counter() - start)
                    time.sleep(step_s)  # the training step
    finally:
        master.terminate()
        master.wait(30)
    return waits[1:]  # epoch 0 includes the workers' start-up; boundaries are what is compared


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=40_000)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--step", type=float, default=0.01, help="seconds per training step")
    args = p.parse_args()
    table = Path(tempfile.mkdtemp(prefix="rl-epochs-")) / "t"
    generate_table(str(table), rows=args.rows, partitions=2, dense=4, sparse=4, format="orc", seed=2,
                   stripe_size=256 << 10, progress=False)
    without = run(table, args.epochs, args.step, ["--no-prefetch"])
    with_ = run(table, args.epochs, args.step, [])
    print(f"{args.rows:,} rows, batch 256, 4096-row splits, 2 workers, {args.step * 1000:.0f} ms steps; "
          f"wait for the first batch of epochs 1..{args.epochs - 1}")
    print("| next-epoch prefetch | median wait (ms) | max wait (ms) |")
    print("|---|---:|---:|")
    for name, waits in (("off", without), ("on", with_)):
        print(f"| {name} | {statistics.median(waits) * 1000:.1f} | {max(waits) * 1000:.1f} |")
    print(f"| ratio off / on (median) | {statistics.median(without) / statistics.median(with_):.1f}x | |")


if __name__ == "__main__":
    main()
