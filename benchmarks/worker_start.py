"""Worker start to first batch: a cold and a warm kernel cache, by command and forked.

A master with the loader benchmark's spec (clamp on dense, firstx + sigrid_hash on
sparse) and no workers; a client says hello and waits. Then one worker starts, and the
time from its launch to the client's first batch is taken, with the CPU the worker used
until then: first ``remoteloader-worker`` by its command with an empty kernel cache
(``NUMBA_CACHE_DIR`` a fresh directory: every kernel compiles), then ``--rounds`` times
with that cache filled, alternately by command (a worker started by hand or by a Ray
actor) and forked by a warm worker fork server (what the local launcher does for every
worker after its first).

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

import psutil

from benchmarks.loader import bench_spec
from remoteloader import RemoteDataLoader
from remoteloader.master.forkserver import ForkServerHandle
from remoteloader.tools.datagen import generate_table

os.environ.setdefault("REMOTELOADER_QUIET", "1")


def first_batch(spec_path: Path, start_worker) -> tuple[float, float]:
    """Seconds from ``start_worker(addr)`` (which returns the worker's pid) to the client's
    first batch, and the worker's CPU seconds by then."""
    master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                               "--spec", str(spec_path)], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        addr = master.stdout.readline().rsplit(" ", 1)[1].strip()
        with RemoteDataLoader(spec_path, master=addr, timeout=120) as loader:
            len(loader)  # the job exists: only the worker is missing
            it = iter(loader)
            start = time.perf_counter()
            worker = psutil.Process(start_worker(addr))
            next(it)
            seconds = time.perf_counter() - start
            cpu = worker.cpu_times()
            return seconds, cpu.user + cpu.system
    finally:
        if worker is not None:  # it would drain for its reader, gone by now
            worker.kill()
            worker.wait(30)
        master.kill()
        master.wait(30)


def by_command(cache: Path):
    def start(addr: str) -> int:
        return subprocess.Popen([sys.executable, "-m", "remoteloader.worker", "--master", addr],
                                env=dict(os.environ, NUMBA_CACHE_DIR=str(cache)), stderr=subprocess.DEVNULL).pid
    return start


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
    cold = first_batch(spec_path, by_command(cache))
    server = ForkServerHandle(dict(os.environ, NUMBA_CACHE_DIR=str(cache)))
    try:
        server.fork(["--version"])  # waits for the server's warm-up: it is ready before the timing

        def forked(addr: str) -> int:
            return server.fork(["--master", addr])

        rounds = {"command": [], "forked": []}
        for _ in range(args.rounds):  # interleaved: the machine's noise hits both alike
            rounds["command"].append(first_batch(spec_path, by_command(cache)))
            rounds["forked"].append(first_batch(spec_path, forked))
    finally:
        server.stop()
    print("worker launch -> client's first batch (13 dense clamp, 26 sparse firstx + sigrid_hash, batch 1024)\n")
    print(f"{'start':<28} {'seconds':>8} {'worker CPU s':>13}   rounds (seconds)")
    print(f"{'command, cold kernel cache':<28} {cold[0]:>8.2f} {cold[1]:>13.2f}")
    for name, got in rounds.items():
        label = f"{name}, warm cache (median)"
        print(f"{label:<28} {statistics.median(s for s, _ in got):>8.2f} {statistics.median(c for _, c in got):>13.2f}"
              f"   {', '.join(f'{s:.2f}' for s, _ in got)}")
    command, forked_s = (statistics.median(s for s, _ in rounds[k]) for k in ("command", "forked"))
    print(f"\nforked / command: {forked_s / command:.2f}x the time to the first batch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
