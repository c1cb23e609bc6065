"""What authenticated, encrypted data costs: the same job on plain sockets, with keys
(protocol 10: CURVE control, sealed AES-GCM data frames) and with keys and CURVE data
sockets (protocol 9's way, ``$REMOTELOADER_BENCH_DATA_CURVE=1``); runs interleaved in one
process so that the machine's noise hits them alike.

Run: ``.venv/bin/python -m benchmarks.auth_cost``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import psutil

from remoteloader import RemoteDataLoader
from remoteloader.core.procs import stop as stop_process
from remoteloader.protocol import auth, seal
from remoteloader.tools.datagen import generate_table


def job_spec(table: Path) -> dict:
    """The job every transport benchmark runs: 4 dense + 4 sparse, batch 1024."""
    return {"table": {"path": str(table)},
            "features": {"label": "label", "dense": [f"float_{i}" for i in range(4)],
                         "sparse": [{"name": f"s{i}", "column": f"idlist_{i}"} for i in range(4)]},
            "batch_size": 1024, "split_rows": 16384}


def reap(pids: list[int], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, each of ``pids`` still alive (by pid)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout)


def descendants() -> list[int]:
    return [c.pid for c in psutil.Process().children(recursive=True)]


@contextlib.contextmanager
def run_directory(prefix: str) -> Iterator[Path]:
    """A scratch directory for one benchmark run. On the way out, also on errors, every
    process the run started is stopped by pid and the directory removed; after a run that
    succeeded, a process still left is an error."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    finally:
        reap(descendants())
        shutil.rmtree(tmp, ignore_errors=True)
    left = descendants()
    assert not left, f"processes left running: {left}"


@contextlib.contextmanager
def curve_data_env(on: bool) -> Iterator[None]:
    """``$REMOTELOADER_BENCH_DATA_CURVE`` for the master, its workers and this process's loader."""
    before = os.environ.pop(seal.ENV_DATA_CURVE, None)
    if on:
        os.environ[seal.ENV_DATA_CURVE] = "1"
    try:
        yield
    finally:
        os.environ.pop(seal.ENV_DATA_CURVE, None)
        if before is not None:
            os.environ[seal.ENV_DATA_CURVE] = before


@contextlib.contextmanager
def tcp_master(table: Path, keys: Optional[str], workers: int, timeout: float = 60.0,
               args: Sequence[str] = (), bind: str = "tcp://127.0.0.1:0") -> Iterator[str]:
    """A master with ``workers`` local workers on loopback TCP (or at ``bind``, e.g. an
    ``ipc://`` path in a private directory); its address. ``args``: more master options
    (``--cache DIR``...). On exit the master and every process under it are stopped, by pid."""
    extra = [*(["--auth", keys] if keys else []), *args]
    master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", bind,
                               "--allow-table", str(table), "--workers", str(workers), "--die-with-parent", *extra],
                              stdout=subprocess.PIPE, text=True)
    under: list[int] = []
    try:
        deadline, addr = time.monotonic() + timeout, None
        while addr is None:
            if master.poll() is not None:
                raise RuntimeError(f"the master exited with code {master.returncode} at start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the master did not start within {timeout:g} s")
            if select.select([master.stdout], [], [], 0.1)[0]:
                line = master.stdout.readline()
                if "listening on " in line:
                    addr = line.rsplit("listening on ", 1)[1].strip()
        master.stdout.close()
        yield addr
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            under = [c.pid for c in psutil.Process(master.pid).children(recursive=True)]
        stop_process(master, timeout=10)
        reap(under)


def rows_per_second(table: Path, keys: str | None, epochs: int, curve_data: bool = False,
                    workers: int = 2) -> tuple[float, int]:
    with curve_data_env(curve_data), tcp_master(table, keys, workers) as addr:
        with RemoteDataLoader(job_spec(table), master=addr, auth=keys, timeout=120) as loader:
            sum(len(b) for b in loader)  # warm-up: workers start and compile
            start, rows, nbytes = time.perf_counter(), 0, 0
            for _ in range(epochs):
                for b in loader:
                    rows += len(b)
                    nbytes += b.dense_features.nbytes + b.sparse_features.values().nbytes
            return rows / (time.perf_counter() - start), nbytes


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
