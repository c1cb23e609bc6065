"""The trainer host's cost (issue 26 part 4): CPU seconds the training process spends per GB
of batches delivered (receiving, opening sealed frames or CURVE, assembling batches, and with
``--pin`` the staging copy), and its rows/s, for four transports of the same job, side by side
in interleaved rounds of one run (the order rotates every round) so that the machine's noise
hits them alike. Read the ratios, not the absolute numbers:

* ``plain TCP``: a master with 2 workers on ``tcp://127.0.0.1``, no keys;
* ``ipc``: the embedded default ``RemoteDataLoader(spec, num_workers=2)``: Unix sockets, no keys;
* ``CURVE data``: ``--auth`` keys and ``$REMOTELOADER_BENCH_DATA_CURVE=1`` (protocol 9's CURVE
  data sockets, as ``auth_cost``);
* ``sealed``: ``--auth`` keys, protocol 10's default (CURVE control, AES-GCM sealed data frames).

The client is this process: ``resource.getrusage(RUSAGE_SELF)`` (user + system, every thread:
the training loop, ZeroMQ's I/O thread, the assembler, the staging thread) over the measured
epochs, after one warm-up epoch per cluster (workers start and compile) as ``auth_cost`` and
``ipc_cost`` measure. The master and workers are child processes and are not counted. Bytes
delivered are the batches' tensors (dense, labels, sparse values and lengths, weights), summed
exactly per batch (``benchmarks.pinning.nbytes``). Ratios are the median over rounds of each
round's mode / plain TCP. ``auth_cost.rows_per_second`` and ``ipc_cost.embedded_rows_per_second``
hold their loop inside the cluster's lifetime with no CPU reading, so the clusters are started
here the same way (same table, spec and worker count) around one shared measuring loop.

Without CUDA, ``--pin`` is mocked as in ``benchmarks.pinning``: the staging thread copies into
ordinary CPU slabs (the copy and its thread, no page-locking); the output says so.

Every process started here (masters and their workers) is stopped by pid, also on errors.
Run: ``.venv/bin/python -m benchmarks.trainer_cost [--rows 200000] [--epochs 5] [--rounds 5] [--pin]``
(the defaults: about 80 s on 2 cores; each measured window is ~1 s, long enough for the
CPU readings to mean something).
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.auth_cost import curve_data_env, descendants, job_spec, reap, tcp_master
from benchmarks.pinning import nbytes
from remoteloader import RemoteDataLoader
from remoteloader.client import staging
from remoteloader.protocol import auth, seal
from remoteloader.tools.datagen import generate_table

MODES = ("plain TCP", "ipc", "CURVE data", "sealed")
LABELS = {
    "plain TCP": "plain TCP (127.0.0.1, no keys)",
    "ipc": "ipc (embedded default, no keys)",
    "CURVE data": "CURVE data sockets (--auth, protocol 9's)",
    "sealed": "sealed AES-GCM frames (--auth, protocol 10)",
}


def measure(loader: RemoteDataLoader, epochs: int) -> dict:
    """One warm-up epoch, then ``epochs`` measured: rows, bytes, wall and this process's CPU."""
    sum(len(b) for b in loader)  # warm-up: workers start and compile
    rows = nbytes_total = 0
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(epochs):
        for b in loader:
            rows += len(b)
            nbytes_total += nbytes(b)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"rows": rows, "bytes": nbytes_total, "wall": wall, "cpu": cpu,
            "rows_s": rows / wall, "cpu_s_gb": cpu / (nbytes_total / 1e9), "cores": cpu / wall}


def run_mode(mode: str, table: Path, keys: str, epochs: int, workers: int, pin: bool) -> dict:
    spec = job_spec(table)
    opts = {"timeout": 120, "pin_memory": pin}
    if mode == "ipc":
        with RemoteDataLoader(spec, num_workers=workers, **opts) as loader:
            assert loader.master.startswith("ipc://") and loader._auth is None, loader.master
            return measure(loader, epochs)
    key_dir = None if mode == "plain TCP" else keys
    with curve_data_env(mode == "CURVE data"), tcp_master(table, key_dir, workers) as addr:
        with RemoteDataLoader(spec, master=addr, auth=key_dir, **opts) as loader:
            assert (loader._auth is None) == (key_dir is None)
            return measure(loader, epochs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--epochs", type=int, default=5, help="measured epochs per cluster (after one warm-up)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pin", action="store_true", help="pin_memory=True (mocked without CUDA)")
    args = p.parse_args()
    os.environ.pop(auth.ENV_AUTH, None)
    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    # SIGTERM (a timeout, a kill by pid) unwinds like Ctrl-C, so the finally blocks stop the children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cuda = torch.cuda.is_available()
    if args.pin and not cuda:  # as benchmarks.pinning: the staging copy into CPU slabs, no page-locking
        staging.alloc_pinned = lambda n: torch.empty(n, dtype=torch.uint8)  # type: ignore[assignment]
        RemoteDataLoader._can_pin = staticmethod(lambda: True)  # type: ignore[method-assign]
    tmp = Path(tempfile.mkdtemp(prefix="rl-trainer-"))
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    start = time.perf_counter()
    try:
        generate_table(str(tmp / "t"), rows=args.rows, partitions=2, dense=4, sparse=4, format="orc", seed=4,
                       progress=False)
        keys = str(auth.keygen(tmp / "keys"))
        for i in range(args.rounds):
            order = MODES[i % len(MODES):] + MODES[:i % len(MODES)]
            for mode in order:
                r = run_mode(mode, tmp / "t", keys, args.epochs, args.workers, args.pin)
                if r["rows"] != args.rows * args.epochs:
                    raise AssertionError(f"{mode}: {r['rows']} rows delivered, expected {args.rows * args.epochs}")
                results[mode].append(r)
                print(f"# round {i + 1} {mode:>10}: {r['rows_s']:>9,.0f} rows/s, client {r['cpu']:.2f} CPU s "
                      f"({r['cores']:.2f} cores) for {r['bytes'] / 1e9:.3f} GB = {r['cpu_s_gb']:.2f} s/GB",
                      file=sys.stderr, flush=True)
    finally:
        reap(descendants())
        shutil.rmtree(tmp, ignore_errors=True)
    left = descendants()
    assert not left, f"processes left running: {left}"

    base = results["plain TCP"]
    gb = base[0]["bytes"] / 1e9
    pin = "off" if not args.pin else ("real pinned memory (CUDA)" if cuda else
                                      "MOCKED (no CUDA: staging copy into plain CPU slabs)")
    print(f"{args.rows:,} rows x {args.epochs} measured epochs (+1 warm-up), batch 1024, 4 dense + 4 sparse, "
          f"{args.workers} workers, {os.cpu_count()} cores; {gb:.3f} GB of tensors delivered per run; "
          f"{args.rounds} interleaved rounds ({time.perf_counter() - start:.0f} s); sealing cipher "
          f"{seal.default_cipher()}; pinning {pin}")
    print("medians over rounds; ratios are the median of each round's mode / plain TCP; client CPU = "
          "this process (user + sys, all threads)")
    print()
    print("| transport | rows/s | ratio | client CPU s/GB | ratio | client cores |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in MODES:
        rs = results[mode]
        rows_ratio = statistics.median(r["rows_s"] / b["rows_s"] for r, b in zip(rs, base))
        cpu_ratio = statistics.median(r["cpu_s_gb"] / b["cpu_s_gb"] for r, b in zip(rs, base))
        print(f"| {LABELS[mode]} | {statistics.median(r['rows_s'] for r in rs):,.0f} | {rows_ratio:.2f} | "
              f"{statistics.median(r['cpu_s_gb'] for r in rs):.2f} | {cpu_ratio:.2f} | "
              f"{statistics.median(r['cores'] for r in rs):.2f} |")


if __name__ == "__main__":
    main()
