"""The one-host mode (issue 26): the embedded default, Unix sockets in a private directory
without CURVE, against plain loopback TCP and TCP with keys (``auth_cost``'s runs, imported), in
interleaved rounds in one process so that the machine's noise hits all three alike.

Run: ``.venv/bin/python -m benchmarks.ipc_cost``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.auth_cost import job_spec, rows_per_second
from remoteloader import RemoteDataLoader
from remoteloader.protocol import auth
from remoteloader.tools.datagen import generate_table


def embedded_rows_per_second(table: Path, epochs: int) -> float:
    """``RemoteDataLoader(spec)`` with no master: 2 local workers, ipc, no keys; the same spec
    and measurement as ``auth_cost.rows_per_second``."""
    with RemoteDataLoader(job_spec(table), num_workers=2, timeout=120) as loader:
        assert loader.master.startswith("ipc://") and loader._auth is None
        sum(len(b) for b in loader)  # warm-up: workers start and compile
        start, rows = time.perf_counter(), 0
        for _ in range(epochs):
            for b in loader:
                rows += len(b)
        return rows / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    os.environ.pop(auth.ENV_AUTH, None)
    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    tmp = Path(tempfile.mkdtemp(prefix="rl-ipc-"))
    generate_table(str(tmp / "t"), rows=args.rows, partitions=2, dense=4, sparse=4, format="orc", seed=4,
                   progress=False)
    keys = str(auth.keygen(tmp / "keys"))
    plain, ipc, curve = [], [], []  # curve: with keys
    for _ in range(args.rounds):
        plain.append(rows_per_second(tmp / "t", None, args.epochs)[0])
        ipc.append(embedded_rows_per_second(tmp / "t", args.epochs))
        curve.append(rows_per_second(tmp / "t", keys, args.epochs)[0])
    a, b, c = (statistics.median(x) for x in (plain, ipc, curve))
    print(f"{args.rows:,} rows x {args.epochs} epochs, batch 1024, 4 dense + 4 sparse, 2 workers, {os.cpu_count()} "
          f"cores; median of {args.rounds} interleaved rounds")
    print("| sockets | rows/s | ratio |")
    print("|---|---:|---:|")
    print(f"| plain TCP (loopback) | {a:,.0f} | 1.00 |")
    print(f"| ipc, no CURVE (the embedded default) | {b:,.0f} | {b / a:.2f} |")
    print(f"| TCP with keys (--auth: CURVE control, data as the protocol seals it) | {c:,.0f} | {c / a:.2f} |")
    print("per round (plain, ipc, keys):", [f"{x:,.0f}/{y:,.0f}/{z:,.0f}" for x, y, z in zip(plain, ipc, curve)])


if __name__ == "__main__":
    main()
