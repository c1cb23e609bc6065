"""What authenticated, encrypted data costs: the same job on plain sockets, with keys
(protocol 10: CURVE control, sealed AES-GCM data frames) and with keys and CURVE data
sockets (protocol 9's way, ``$REMOTELOADER_BENCH_DATA_CURVE=1``); runs interleaved in one
process so that the machine's noise hits them alike.

Run: ``.venv/bin/python -m benchmarks.auth_cost``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from remoteloader import RemoteDataLoader
from remoteloader.protocol import auth, seal
from remoteloader.tools.datagen import generate_table


def rows_per_second(table: Path, keys: str | None, epochs: int, curve_data: bool = False,
                    workers: int = 2) -> tuple[float, int]:
    extra = ["--auth", keys] if keys else []
    env = dict(os.environ)
    env.pop(seal.ENV_DATA_CURVE, None)
    if curve_data:  # workers and this process's loader alike
        env[seal.ENV_DATA_CURVE] = os.environ[seal.ENV_DATA_CURVE] = "1"
    else:
        os.environ.pop(seal.ENV_DATA_CURVE, None)
    master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                               "--allow-table", str(table), "--workers", str(workers), *extra],
                              stdout=subprocess.PIPE, text=True, env=env)
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
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rl-auth-"))
    generate_table(str(tmp / "t"), rows=args.rows, partitions=2, dense=4, sparse=4, format="orc", seed=4,
                   progress=False)
    keys = str(auth.keygen(tmp / "keys"))
    plain, sealed, curve, nbytes = [], [], [], 0
    for _ in range(args.rounds):
        r, nbytes = rows_per_second(tmp / "t", None, args.epochs, workers=args.workers)
        plain.append(r)
        sealed.append(rows_per_second(tmp / "t", keys, args.epochs, workers=args.workers)[0])
        curve.append(rows_per_second(tmp / "t", keys, args.epochs, curve_data=True, workers=args.workers)[0])
    a, b, c = statistics.median(plain), statistics.median(sealed), statistics.median(curve)
    mb = nbytes / args.epochs / args.rows * 1e6 / 2**20
    print(f"{args.rows:,} rows x {args.epochs} epochs, batch 1024, 4 dense + 4 sparse, {args.workers} workers; "
          f"median of {args.rounds} interleaved rounds (~{mb:.0f} MiB of tensors per million rows); "
          f"sealing cipher {seal.default_cipher()}")
    print("| data sockets | rows/s | ratio |")
    print("|---|---:|---:|")
    print(f"| plain TCP (loopback, no keys) | {a:,.0f} | 1.00 |")
    print(f"| sealed frames (--auth, protocol 10) | {b:,.0f} | {b / a:.2f} |")
    print(f"| CURVE (--auth, protocol 9's data sockets) | {c:,.0f} | {c / a:.2f} |")


if __name__ == "__main__":
    main()
