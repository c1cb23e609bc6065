"""The ingest ceiling of one client (issue 36): the byte rate one ``RemoteDataLoader`` reaches
when its workers are as cheap as this cluster makes them, and what each GB costs the client,
with and without ``pin_memory``, beside the memcpy of the same host in the same run.

The cheapest workers: issue 36's job (``client_cpu.dlrm_spec``: 13 dense + 26 sparse, batch
4096) with the spec's block cache ``write-all`` and the master started with ``--cache``, one
cache directory for the whole run. The first cluster's first epoch writes every feature's
blocks; every later epoch of every cluster reads them: its workers open no table file and
transform nothing (a split is a lookup of its blocks, one gather for the epoch's shuffle,
and the cut into pieces). The transport is ipc, what the embedded default starts (a master
on ``ipc://DIR/master`` in a private directory, workers on ipc sockets beside it, no keys;
started here so that it takes ``--max-message-bytes``); its workers offer shared-memory
arenas (``protocol/arena.py``), which the client maps or not (``--arenas``: on, off).

Variants, interleaved in rounds of one run (the order rotates every round): each
``--caps`` value (a worker ``--max-message-bytes``, handed on by the master; ``default``:
none given, the workers' own default) with pinning off and on, arenas on and off. Before
and after the rounds, the socket floor (``socket_floor.py``: the least any socket
transport costs its receiver on this host). Without CUDA, pinning is
mocked as in ``tests/test_pinning.py`` (``pinning.mock_pinning``: the staging thread copies
into plain CPU slabs; no page-locking, no DMA); the output says so.

Per variant: GB/s of batches delivered (the batches' tensors, summed exactly per batch, over
the wall time of the measured epochs), the client's CPU s/GB (this process, all threads,
``client_cpu.ThreadCpu``), per thread, and its minor page faults per GB; and ``1 core GB/s``
= 1 / (client CPU s/GB): the rate one client core would sustain if the workers kept up, the
client's own ceiling. On a 2-core host the workers share the cores with the client, so the
measured GB/s is the cluster's, not the client's ceiling; compare ``1 core GB/s`` with
``memcpy GB/s`` (one core copying a 64 MiB buffer).

Every process started here (masters and their workers) is stopped by pid, also on errors.
Run: ``.venv/bin/python -m benchmarks.ingest [--rows 100000] [--epochs 3] [--rounds 2]
[--caps default 1G]``.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.auth_cost import run_directory, tcp_master
from benchmarks.client_cpu import COLUMNS, SHORT, dlrm_spec, dlrm_table, job_arguments, memcpy_baseline
from benchmarks.pinning import mock_pinning
from benchmarks.socket_floor import receive_cost
from benchmarks.trainer_cost import measure
from remoteloader import RemoteDataLoader
from remoteloader.client import fetch
from remoteloader.protocol.arena import ENV_ARENA
from remoteloader.protocol import auth
from remoteloader.protocol.address import new_ipc_directory


def run_variant(cap: str, pin: bool, arenas: str, table: Path, cache: Path, args: argparse.Namespace) -> dict:
    spec = dlrm_spec(table, args.dense, args.sparse, args.batch_size, epochs=args.epochs + args.warm_epochs)
    master_args = ["--cache", str(cache), *([] if cap == "default" else ["--max-message-bytes", cap])]
    os.environ[ENV_ARENA] = arenas  # the client's choice: the workers offer arenas either way
    fetchers: list = []
    original = fetch.WorkerFetcher.__init__

    def recorded(self, *a, **kw):
        original(self, *a, **kw)
        fetchers.append(self)

    fetch.WorkerFetcher.__init__ = recorded
    try:
        with tcp_master(table, None, args.workers, args=master_args, bind=f"ipc://{new_ipc_directory()}/master") as addr:
            with RemoteDataLoader(spec, master=addr, timeout=120, pin_memory=pin) as loader:
                result = measure(loader, args.epochs, args.warm_epochs)
    finally:
        fetch.WorkerFetcher.__init__ = original
    in_arena = sum(f.arena_messages for f in fetchers)
    result["arena_share"] = in_arena / max(1, in_arena + sum(f.frame_messages for f in fetchers))
    return result


def main() -> None:
    p = job_arguments(__doc__, rounds=2)
    p.add_argument("--caps", nargs="+", default=["default"], metavar="BYTES",
                   help="workers' --max-message-bytes to compare (default: none given)")
    p.add_argument("--pin", choices=("both", "off", "on"), default="both", help="pin_memory variants")
    p.add_argument("--arenas", nargs="+", choices=("on", "off"), default=["on", "off"],
                   help="shared-memory arenas (protocol/arena.py) or frames over the ipc socket")
    args = p.parse_args()
    os.environ.pop(auth.ENV_AUTH, None)
    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the finally blocks stop the children
    cuda = torch.cuda.is_available()
    pins = {"both": (False, True), "off": (False,), "on": (True,)}[args.pin]
    if True in pins and not cuda:
        mock_pinning()
    variants = [(cap, pin, arenas) for cap in args.caps for pin in pins for arenas in args.arenas]
    results: dict[tuple[str, bool, str], list[dict]] = {v: [] for v in variants}
    copies = [memcpy_baseline()]
    floors = {kind: [receive_cost(kind)] for kind in ("unix", "tcp")}
    start = time.perf_counter()
    with run_directory("rl-ingest-") as tmp:
        dlrm_table(tmp / "t", args.rows, args.dense, args.sparse)
        for i in range(args.rounds):
            for cap, pin, arenas in variants[i % len(variants):] + variants[:i % len(variants)]:
                r = run_variant(cap, pin, arenas, tmp / "t", tmp / "cache", args)
                if r["rows"] != args.rows * args.epochs:
                    raise AssertionError(f"{cap}, pin {pin}: {r['rows']} rows, expected {args.rows * args.epochs}")
                results[(cap, pin, arenas)].append(r)
                print(f"# round {i + 1} cap {cap:>7} pin {'on' if pin else 'off':>3} arenas {arenas:>3}: "
                      f"{r['gb_s']:.3f} GB/s ({r['arena_share']:.0%} of messages in arenas), "
                      f"client {r['cpu_s_gb']:.3f} CPU s/GB ({r['cores']:.2f} cores), {r['faults_gb']:,.0f} faults/GB; "
                      + ", ".join(f"{SHORT[g]} {r['threads_s_gb'][g]:.3f}" for g in COLUMNS),
                      file=sys.stderr, flush=True)
    copies.append(memcpy_baseline())
    for kind in floors:
        floors[kind].append(receive_cost(kind))
    copy_s_gb = statistics.median(c["cpu_s_gb"] for c in copies)
    copy_gb_s = statistics.median(c["gb_s"] for c in copies)
    pinning = ("real pinned memory (CUDA)" if cuda else "MOCKED (no CUDA: staging copy into plain CPU slabs)") \
        if True in pins else "off"
    gb = next(iter(results.values()))[0]["bytes"] / 1e9
    print(f"{args.rows:,} rows x {args.epochs} measured epochs (+{args.warm_epochs} warm-up) per cluster, batch "
          f"{args.batch_size}, {args.dense} dense + {args.sparse} sparse, {args.workers} workers reading the block "
          f"cache, ipc; {os.cpu_count()} cores (load {os.getloadavg()[0]:.1f}); {gb:.3f} GB per measured run; "
          f"{args.rounds} interleaved rounds ({time.perf_counter() - start:.0f} s); pinning {pinning}")
    print(f"memcpy of this host, same run: {copy_gb_s:.1f} GB/s on one core = {copy_s_gb:.3f} CPU s/GB "
          "(median of before and after)")
    print("socket floor, same run (benchmarks/socket_floor.py: recv_into one reused buffer, nothing else; median of "
          "before and after): " + ", ".join(
              f"{kind} {statistics.median(f['cpu_s_gb'] for f in fs):.3f} CPU s/GB "
              f"({statistics.median(f['gb_s'] for f in fs):.2f} GB/s)" for kind, fs in floors.items()))
    print("medians over rounds; client CPU = this process, all threads (less the sampler); per thread in CPU s/GB")
    print()
    print("| max message | pin_memory | arenas (messages in them) | GB/s delivered | client CPU s/GB | x memcpy "
          "| 1 core GB/s | / memcpy GB/s | faults/GB | " + " | ".join(SHORT[g] for g in COLUMNS) + " |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(COLUMNS))
    for (cap, pin, arenas), rs in results.items():
        cpu = statistics.median(r["cpu_s_gb"] for r in rs)
        per = " | ".join(f"{statistics.median(r['threads_s_gb'][g] for r in rs):.3f}" for g in COLUMNS)
        share = statistics.median(r["arena_share"] for r in rs)
        print(f"| {cap} | {'on' if pin else 'off'} | {arenas} ({share:.0%}) | "
              f"{statistics.median(r['gb_s'] for r in rs):.3f} | {cpu:.3f} | "
              f"{cpu / copy_s_gb:.1f} | {1 / cpu:.2f} | {1 / cpu / copy_gb_s:.2f} | "
              f"{statistics.median(r['faults_gb'] for r in rs):,.0f} | {per} |")


if __name__ == "__main__":
    main()
