"""What CURVE (authenticated, encrypted sockets) costs: the same job with and without keys,
runs interleaved in one process so that the machine's noise hits both alike.

Run: ``.venv/bin/python -m benchmarks.auth_cost``.
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
from remoteloader.protocol import auth
from remoteloader.tools.datagen import generate_table


def rows_per_second(table: Path, keys: str | None, epochs: int) -> tuple[float, int]:
    extra = ["--auth", keys] if keys else []
    master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                               "--allow-table", str(table), "--workers", "2", *extra], stdout=subprocess.PIPE, text=True)
    addr = master.stdout.readline().rsplit(" ", 1)[1].strip()
    spec = {"table": {"path": str(table)},
            "features": {"label": "label", "dense": [f"float_{i}" for i in range(4)],
                         "sparse": [{"name": f"s{i}", "column": f"idlist_{i}"} for i in range(4)]},
            "batch_size": 1024, "split_rows": 16384}
    try:
        with RemoteDataLoader(spec, master=addr, auth=keys, timeout=120) as loader:
            sum(len(b) for b in loader)  # warm-up: workers start and compile
            start, rows, nbytes = time.perf_counter(), 0, 0
            for _ in range(epochs):
                for b in loader:
                    rows += len(b)
                    nbytes += b.dense_features.nbytes + b.sparse_features.values().nbytes
            return rows / (time.perf_counter() - start), nbytes
    finally:
        master.terminate()
        master.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rl-auth-"))
    generate_table(str(tmp / "t"), rows=args.rows, partitions=2, dense=4, sparse=4, format="orc", seed=4,
                   progress=False)
    keys = str(auth.keygen(tmp / "keys"))
    plain, curve, nbytes = [], [], 0
    for _ in range(args.rounds):
        r, nbytes = rows_per_second(tmp / "t", None, args.epochs)
        plain.append(r)
        curve.append(rows_per_second(tmp / "t", keys, args.epochs)[0])
    a, b = statistics.median(plain), statistics.median(curve)
    mb = nbytes / args.epochs / args.rows * 1e6 / 2**20
    print(f"{args.rows:,} rows x {args.epochs} epochs, batch 1024, 4 dense + 4 sparse, 2 workers; "
          f"median of {args.rounds} interleaved rounds (~{mb:.0f} MiB of tensors per million rows)")
    print("| sockets | rows/s | ratio |")
    print("|---|---:|---:|")
    print(f"| plain (loopback) | {a:,.0f} | 1.00 |")
    print(f"| CURVE (--auth) | {b:,.0f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
