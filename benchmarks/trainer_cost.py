"""The trainer host's cost (issues 26 and 36): CPU seconds the training process spends per GB
of batches delivered (receiving, opening sealed frames or CURVE, assembling batches, and with
``--pin`` the staging copy), per thread, and its rows/s, for four transports of the same job,
side by side in interleaved rounds of one run (the order rotates every round) so that the
machine's noise hits them alike, beside a plain memcpy of the host taken in the same run.
Read the ratios, not the absolute numbers:

* ``plain TCP``: a master with 2 workers on ``tcp://127.0.0.1``, no keys;
* ``ipc``: what the embedded default ``RemoteDataLoader(spec, num_workers=2)`` starts (a master
  on ``ipc://DIR/master`` in a private directory, workers on ipc sockets beside it, no keys),
  started here so that it takes the same master options (``--cache``, ``--max-message-bytes``);
* ``CURVE data``: ``--auth`` keys and ``$REMOTELOADER_BENCH_DATA_CURVE=1`` (protocol 9's CURVE
  data sockets, as ``auth_cost``);
* ``sealed``: ``--auth`` keys, protocol 10's default (CURVE control, AES-GCM sealed data frames).

The job is issue 36's (``client_cpu.dlrm_spec``): 13 dense + 26 sparse features (clamp; firstx
20 then sigrid_hash) at batch 4096, with the spec's block cache ``write-all`` and every master
started with ``--cache`` (one cache directory for the keyless modes, one for the keyed ones,
whose blocks carry an HMAC): after the first cluster's first epoch the workers read every
feature from the cache and transform nothing, so they are as cheap as this cluster makes them
(``--no-cache``: workers transform every epoch). ``--dense 4 --sparse 4 --batch-size 1024
--no-cache`` is close to issue 26's job (``auth_cost.job_spec``, which has no transforms).

The client is this process: ``getrusage(RUSAGE_SELF)`` over the measured epochs, after
``--warm-epochs`` per cluster (workers start, compile, fill the cache), split per thread by
``client_cpu.ThreadCpu`` (training thread, libzmq's I/O threads, the staging thread, the
per-epoch control threads, the rest); minor page faults per GB beside it. The master and
workers are child processes and are not counted. Bytes delivered are the batches' tensors,
summed exactly per batch (``client_cpu.batch_nbytes``). ``memcpy`` is
``client_cpu.memcpy_baseline`` (one copy of a 64 MiB buffer, repeated), taken before the
first and after the last round; ``x memcpy`` is a mode's client CPU per GB over it: how many
copies' worth of CPU the client spends per byte. Ratios are the median over rounds of each
round's mode / plain TCP.

Without CUDA, ``--pin`` is mocked as in ``tests/test_pinning.py`` (``pinning.mock_pinning``):
the staging thread copies into ordinary CPU slabs (the copy and its thread, no page-locking);
the output says so.

Every process started here (masters and their workers) is stopped by pid, also on errors.
Run: ``.venv/bin/python -m benchmarks.trainer_cost [--rows 100000] [--epochs 3] [--rounds 3]
[--pin] [--max-message-bytes 16M]`` (``--max-message-bytes`` is handed to every master, which
hands it to its workers; without it they use their default).
"""
from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from benchmarks.auth_cost import curve_data_env, run_directory, tcp_master
from benchmarks.client_cpu import (COLUMNS, SHORT, ThreadCpu, batch_nbytes, collapse, dlrm_spec, dlrm_table,
                                   job_arguments,
                                   memcpy_baseline)
from benchmarks.pinning import mock_pinning
from remoteloader import RemoteDataLoader
from remoteloader.protocol import auth, seal
from remoteloader.protocol.address import new_ipc_directory
from remoteloader.protocol.arena import ENV_ARENA

MODES = ("plain TCP", "ipc", "arenas", "CURVE data", "sealed")
# Every mode but "arenas" keeps the client on the data socket (REMOTELOADER_ARENA=off): the
# workers are on this host, and would otherwise hand batches over in shared memory.
LABELS = {
    "plain TCP": "plain TCP (127.0.0.1, no keys)",
    "ipc": "ipc socket (no keys)",
    "arenas": "ipc + shared-memory arenas (the embedded default)",
    "CURVE data": "CURVE data sockets (--auth, protocol 9's)",
    "sealed": "sealed AES-GCM frames (--auth, protocol 10)",
}


def measure(loader: RemoteDataLoader, epochs: int, warm_epochs: int = 1) -> dict:
    """``warm_epochs``, then ``epochs`` measured: rows, bytes, wall, this process's CPU per thread
    group and its minor page faults."""
    for _ in range(warm_epochs):
        sum(len(b) for b in loader)  # workers start and compile, the cache fills
    rows = nbytes_total = 0
    threads = ThreadCpu().start()
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    for _ in range(epochs):
        for b in loader:
            rows += len(b)
            nbytes_total += batch_nbytes(b)
    wall = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    groups = threads.stop()
    cpu, gb = groups.pop("total"), nbytes_total / 1e9
    return {"rows": rows, "bytes": nbytes_total, "wall": wall, "cpu": cpu, "rows_s": rows / wall,
            "gb_s": gb / wall, "cpu_s_gb": cpu / gb, "cores": cpu / wall, "faults_gb": faults / gb,
            "threads_s_gb": {k: v / gb for k, v in collapse(groups).items()}}


def run_mode(mode: str, table: Path, keys: str, caches: dict[str, Path], args: argparse.Namespace) -> dict:
    spec = dlrm_spec(table, args.dense, args.sparse, args.batch_size, epochs=args.epochs + args.warm_epochs,
                     cache=not args.no_cache)
    opts = {"timeout": 120, "pin_memory": args.pin}
    key_dir = None if mode in ("plain TCP", "ipc", "arenas") else keys
    os.environ[ENV_ARENA] = "on" if mode == "arenas" else "off"  # read by the loader's fetchers
    master_args = [*([] if args.no_cache else ["--cache", str(caches["keys" if key_dir else "plain"])]),
                   *([] if args.max_message_bytes is None else ["--max-message-bytes", args.max_message_bytes])]
    bind = f"ipc://{new_ipc_directory()}/master" if mode in ("ipc", "arenas") else "tcp://127.0.0.1:0"
    with curve_data_env(mode == "CURVE data"), tcp_master(table, key_dir, args.workers, args=master_args,
                                                          bind=bind) as addr:
        with RemoteDataLoader(spec, master=addr, auth=key_dir, **opts) as loader:
            assert (loader._auth is None) == (key_dir is None)
            return measure(loader, args.epochs, args.warm_epochs)


def parser(doc: Optional[str] = __doc__) -> argparse.ArgumentParser:
    p = job_arguments(doc, rounds=3)
    p.add_argument("--no-cache", action="store_true", help="workers transform every epoch (no block cache)")
    p.add_argument("--max-message-bytes", metavar="BYTES",
                   help="the masters' --max-message-bytes (their workers' largest data message)")
    p.add_argument("--pin", action="store_true", help="pin_memory=True (mocked without CUDA)")
    return p


def main() -> None:
    p = parser()
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = p.parse_args()
    modes = tuple(m for m in MODES if m in args.modes)
    os.environ.pop(auth.ENV_AUTH, None)
    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    # SIGTERM (a timeout, a kill by pid) unwinds like Ctrl-C, so the finally blocks stop the children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cuda = torch.cuda.is_available()
    if args.pin and not cuda:
        mock_pinning()
    results: dict[str, list[dict]] = {m: [] for m in modes}
    copies = [memcpy_baseline()]
    start = time.perf_counter()
    with run_directory("rl-trainer-") as tmp:
        dlrm_table(tmp / "t", args.rows, args.dense, args.sparse)
        keys = str(auth.keygen(tmp / "keys"))
        caches = {"plain": tmp / "cache-plain", "keys": tmp / "cache-keys"}
        for i in range(args.rounds):
            order = modes[i % len(modes):] + modes[:i % len(modes)]
            for mode in order:
                r = run_mode(mode, tmp / "t", keys, caches, args)
                if r["rows"] != args.rows * args.epochs:
                    raise AssertionError(f"{mode}: {r['rows']} rows delivered, expected {args.rows * args.epochs}")
                results[mode].append(r)
                per = ", ".join(f"{SHORT[g]} {r['threads_s_gb'][g]:.3f}" for g in COLUMNS)
                print(f"# round {i + 1} {mode:>10}: {r['rows_s']:>9,.0f} rows/s, client {r['cpu']:.2f} CPU s "
                      f"({r['cores']:.2f} cores) for {r['bytes'] / 1e9:.3f} GB = {r['cpu_s_gb']:.3f} s/GB "
                      f"({per}); {r['faults_gb']:,.0f} faults/GB", file=sys.stderr, flush=True)
    copies.append(memcpy_baseline())
    report(args, modes, results, copies, cuda, time.perf_counter() - start)


def report(args: argparse.Namespace, modes: tuple, results: dict[str, list[dict]], copies: list[dict], cuda: bool,
           seconds: float) -> None:
    base = results[modes[0]]
    gb = base[0]["bytes"] / 1e9
    copy_s_gb = statistics.median(c["cpu_s_gb"] for c in copies)
    copy_gb_s = statistics.median(c["gb_s"] for c in copies)
    pin = "off" if not args.pin else ("real pinned memory (CUDA)" if cuda else
                                      "MOCKED (no CUDA: staging copy into plain CPU slabs)")
    print(f"{args.rows:,} rows x {args.epochs} measured epochs (+{args.warm_epochs} warm-up), batch {args.batch_size}, "
          f"{args.dense} dense + {args.sparse} sparse, {args.workers} workers, block cache "
          f"{'off' if args.no_cache else 'write-all'}, max message {args.max_message_bytes or 'the workers default'}; "
          f"{os.cpu_count()} cores (load {os.getloadavg()[0]:.1f}); {gb:.3f} GB of tensors delivered per run; "
          f"{args.rounds} interleaved rounds ({seconds:.0f} s); sealing cipher {seal.default_cipher()}; pinning {pin}")
    print(f"memcpy of this host, same run: {copy_s_gb:.3f} CPU s/GB ({copy_gb_s:.1f} GB/s on one core), median of "
          f"before and after")
    print(f"medians over rounds; ratios are the median of each round's mode / {modes[0]}; client CPU = this process "
          "(user + sys, all threads, less the benchmark's sampler); per thread in CPU s/GB")
    print()
    groups = COLUMNS
    print("| transport | rows/s | ratio | GB/s | client CPU s/GB | ratio | x memcpy | faults/GB | "
          + " | ".join(SHORT[g] for g in groups) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(groups))
    for mode in modes:
        rs = results[mode]
        rows_ratio = statistics.median(r["rows_s"] / b["rows_s"] for r, b in zip(rs, base))
        cpu_ratio = statistics.median(r["cpu_s_gb"] / b["cpu_s_gb"] for r, b in zip(rs, base))
        cpu = statistics.median(r["cpu_s_gb"] for r in rs)
        per = " | ".join(f"{statistics.median(r['threads_s_gb'].get(g, 0.0) for r in rs):.3f}" for g in groups)
        print(f"| {LABELS[mode]} | {statistics.median(r['rows_s'] for r in rs):,.0f} | {rows_ratio:.2f} | "
              f"{statistics.median(r['gb_s'] for r in rs):.2f} | {cpu:.3f} | {cpu_ratio:.2f} | "
              f"{cpu / copy_s_gb:.1f} | {statistics.median(r['faults_gb'] for r in rs):,.0f} | {per} |")
    print(f"\n(per thread: {', '.join(f'{SHORT[g]} = {g}' for g in COLUMNS)}; ended: CPU of threads that ended "
          f"after their last reading, every {ThreadCpu().interval:g} s)")


if __name__ == "__main__":
    main()
