"""Worker start to first batch, with a cold and a warm kernel cache.

A master with the loader benchmark's spec (clamp on dense, firstx + sigrid_hash on
sparse) and no workers; a client says hello and waits. Then one ``remoteloader-worker``
starts, and the time from its launch to the client's first batch is taken: first with
an empty kernel cache (``NUMBA_CACHE_DIR`` a fresh directory: every kernel compiles),
then ``--rounds`` times with that cache filled (a worker the autoscaler adds on a
machine that has run one before).

Run: ``.venv/bin/python -m benchmarks.worker_start [--rounds 3]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.loader import bench_spec
from remoteloader import RemoteDataLoader
from remoteloader.tools.datagen import generate_table

os.environ.setdefault("REMOTELOADER_QUIET", "1")


def first_batch_s(spec_path: Path, cache: Path) -> float:
    master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                               "--spec", str(spec_path)], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        addr = master.stdout.readline().rsplit(" ", 1)[1].strip()
        with RemoteDataLoader(spec_path, master=addr, timeout=120) as loader:
            len(loader)  # the job exists: only the worker is missing
            it = iter(loader)
            start = time.perf_counter()
            worker = subprocess.Popen([sys.executable, "-m", "remoteloader.worker", "--master", addr],
                                      env=dict(os.environ, NUMBA_CACHE_DIR=str(cache)), stderr=subprocess.DEVNULL)
            next(it)
            return time.perf_counter() - start
    finally:
        for proc in (worker, master):  # a worker would drain for its reader, gone by now
            if proc is not None:
                proc.kill()
                proc.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rl-start-"))
    generate_table(str(tmp / "t"), rows=20_000, partitions=2, dense=13, sparse=26, format="orc", seed=2,
                   progress=False)
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(bench_spec(str(tmp / "t"), 13, 26, 1024)))
    cache = tmp / "numba-cache"
    cold = first_batch_s(spec_path, cache)
    warm = [first_batch_s(spec_path, cache) for _ in range(args.rounds)]
    print("worker launch -> client's first batch (13 dense clamp, 26 sparse firstx + sigrid_hash, batch 1024)\n")
    print(f"{'kernel cache':<14} {'seconds':>8}")
    print(f"{'cold':<14} {cold:>8.2f}")
    print(f"{'warm (median)':<14} {statistics.median(warm):>8.2f}   rounds: {', '.join(f'{w:.2f}' for w in warm)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
