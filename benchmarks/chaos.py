"""Long chaos run: hundreds of epochs, each SIGKILLing random workers at random moments.

Every epoch must deliver every row exactly once with the right values; the script
stops at the first violation and prints the seed to replay it. Run:
``.venv/bin/python -m benchmarks.chaos --trials 200``.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from remoteloader import RemoteDataLoader
from remoteloader.tools.datagen import generate_table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-kills", type=int, default=3, help="kills per epoch: 1..max")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="rl-chaos-"))
    generate_table(str(tmp / "t"), rows=args.rows, partitions=2, dense=4, sparse=6, format="orc", seed=args.seed,
                   stripe_size=256 << 10, files_per_partition=2, progress=False)
    spec = {"table": {"path": str(tmp / "t")},
            "features": {"label": "label", "dense": ["float_0", "float_1"],
                         "sparse": [{"name": f"s{i}", "column": f"idlist_{i}",
                                     "transforms": [{"op": "firstx", "x": 10},
                                                    {"op": "sigrid_hash", "salt": i, "max_value": 1000}]}
                                    for i in range(6)],
                         "passthrough": ["row_id"]},
            "batch_size": 256, "split_rows": 2000, "shuffle": True}
    master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                               "--allow-table", str(tmp / "t"), "--workers", str(args.workers), "--heartbeat-timeout", "1"],
                              stdout=subprocess.PIPE, text=True)
    addr = master.stdout.readline().rsplit(" ", 1)[1].strip()
    rng = random.Random(args.seed)
    kills = 0
    start = time.perf_counter()
    reference = None
    try:
        with RemoteDataLoader(spec, master=addr, timeout=120) as loader:
            n = len(loader)
            for trial in range(args.trials):
                kill_at = sorted(rng.sample(range(1, n), rng.randint(1, args.max_kills)))
                rows: dict[int, bytes] = {}
                for i, b in enumerate(loader):
                    dense = b.dense_features.numpy()
                    for j, rid in enumerate(b.passthrough["row_id"].tolist()):
                        if rid in rows:
                            print(f"FAIL trial {trial} (seed {args.seed}): row {rid} delivered twice")
                            return 1
                        rows[rid] = dense[j].tobytes()
                    if kill_at and i == kill_at[0]:
                        kill_at.pop(0)
                        # Its local workers: the children of its worker fork server, named rl-worker.
                        victims = [c.pid for c in psutil.Process(master.pid).children(recursive=True)
                                   if c.name() == "rl-worker"]
                        if victims:
                            os.kill(rng.choice(victims), signal.SIGKILL)
                            kills += 1
                if len(rows) != args.rows:
                    print(f"FAIL trial {trial} (seed {args.seed}): {len(rows)} of {args.rows} rows")
                    return 1
                if reference is None:
                    reference = rows
                elif rows != reference:
                    print(f"FAIL trial {trial} (seed {args.seed}): values differ from the first epoch")
                    return 1
                if (trial + 1) % 10 == 0:
                    print(f"{trial + 1} trials, {kills} workers killed, all exactly once "
                          f"({time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        master.terminate()
        master.wait(30)
    print(f"PASS: {args.trials} epochs x {args.rows:,} rows, {kills} SIGKILLs, every row exactly once, "
          f"values identical across epochs ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
