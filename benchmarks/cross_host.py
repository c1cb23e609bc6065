"""The three transports across a network link (issue 41 part 4): rows/s and the trainer's CPU
per GB with plain TCP, CURVE data sockets and sealed frames, the master, the workers and the
trainer each on a host of its own, side by side in one run, beside the loopback figures of
``benchmarks.trainer_cost``.

The hosts are network namespaces on one bridge (``tests/hostnet.py``): the master on h1, the
workers on h2 (bound to h2's address), the trainer on h3 (all on h1 for ``loopback``), so every batch crosses two veth
links and the bridge, through each namespace's own TCP stack, on this machine's cores (a
real network adds its wire time; this measures what the stacks and the transports cost).
Needs root and ``ip``; it says why not and exits otherwise.

* ``plain TCP``: no keys, master and workers with ``--insecure`` (they bind host addresses);
* ``CURVE data``: ``--auth`` keys and ``$REMOTELOADER_BENCH_DATA_CURVE=1`` (protocol 9's CURVE
  data sockets, a benchmark-only switch: ``protocol/seal.py``'s ``data_curve``);
* ``sealed``: ``--auth`` keys, protocol 10's default (CURVE control, sealed data frames);
* ``loopback``: plain TCP again, but master, workers and trainer all on h1 over its
  ``127.0.0.1``: what crossing the links costs, in the same run.

The job is ``trainer_cost``'s (issue 36's ``client_cpu.dlrm_spec``: 13 dense + 26 sparse, batch
4096, the block cache ``write-all``, master and workers with ``--cache``, one cache directory
for the keyless mode and one for the keyed ones): after the first cluster's first epoch the
workers read every feature from the cache and transform nothing, so the transport is most
of what is left. Each worker count (``--workers 2 4``) runs every mode in interleaved rounds
(the order rotates every round); each run is a fresh master and workers, ``--warm-epochs``,
then ``--epochs`` measured by the trainer itself (``trainer_cost.measure``: rows, the
batches' bytes, wall time, ``getrusage`` of the trainer process, all its threads). Ratios
are the median over rounds of each round's mode / plain TCP at the same worker count.

Every process started here is stopped by pid (``HostNet.close``), also on errors, and the
namespaces are deleted. Run as root: ``.venv/bin/python -m benchmarks.cross_host [--rows
100000] [--epochs 3] [--rounds 2] [--workers 2 4]``.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.client_cpu import dlrm_spec, dlrm_table
from remoteloader.protocol import auth, seal
from remoteloader.protocol.arena import ENV_ARENA
from tests.hostnet import Host, HostNet, netns_unavailable  # the test harness's hosts, reused as is

ROOT = Path(__file__).resolve().parent.parent  # where ``python -m benchmarks.cross_host trainer`` runs
MODES = ("plain TCP", "CURVE data", "sealed", "loopback")
LABELS = {
    "plain TCP": "plain TCP (no keys, --insecure)",
    "CURVE data": "CURVE data sockets (--auth, protocol 9's)",
    "sealed": "sealed AES-GCM frames (--auth, protocol 10)",
    "loopback": "plain TCP on one host's 127.0.0.1 (no keys)",
}


def start_master(host: Host, bind: str, args: list[str], env: dict[str, str],
                 timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """A master on ``host`` bound to ``bind`` (an address of it); its process and address."""
    proc = host.popen([sys.executable, "-m", "remoteloader.master", "--bind", f"tcp://{bind}:0",
                       "--workers", "0", *args], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the master exited with code {proc.returncode} at start")
        if select.select([proc.stdout], [], [], 0.1)[0]:
            line = proc.stdout.readline()
            if "listening on " in line:
                return proc, line.rsplit("listening on ", 1)[1].strip()
    raise TimeoutError(f"the master did not start within {timeout:g} s")


def stop(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM each (its process group), then SIGKILL what is left after ``timeout``;
    workers before their master, whom they tell that they leave."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_mode(net: HostNet, mode: str, workers: int, spec: Path, table: Path, keys: str, caches: dict[str, Path],
             args: argparse.Namespace) -> dict:
    """One fresh cluster of ``mode`` with ``workers`` workers: what its trainer measured."""
    h1, h2, h3 = net.hosts.values()
    if mode == "loopback":
        master_at, workers_at, trainer_host = (h1, "127.0.0.1"), (h1, "127.0.0.1"), h1
    else:
        master_at, workers_at, trainer_host = (h1, h1.addr), (h2, h2.addr), h3
    keyed = mode in ("CURVE data", "sealed")
    env = {k: v for k, v in os.environ.items() if k not in (auth.ENV_AUTH, seal.ENV_DATA_CURVE)}
    env[ENV_ARENA] = "off"  # the socket is what is measured (loopback's workers would use arenas)
    if mode == "CURVE data":
        env[seal.ENV_DATA_CURVE] = "1"  # master, workers and trainer must agree
    security = ["--auth", keys] if keyed else ["--insecure"] if mode == "plain TCP" else []
    cache = [] if args.no_cache else ["--cache", str(caches["keys" if keyed else "plain"])]
    size = [] if args.max_message_bytes is None else ["--max-message-bytes", args.max_message_bytes]
    master, addr = start_master(*master_at, ["--allow-table", str(table), *security, *cache, *size], env)
    procs = [master]
    try:
        host, bind = workers_at
        procs += [host.popen([sys.executable, "-m", "remoteloader.worker", "--master", addr, "--bind-host", bind,
                              *security, *cache], env=env) for _ in range(workers)]
        trainer = trainer_host.run([sys.executable, "-m", "benchmarks.cross_host", "trainer", "--spec", spec,
                                    "--master", addr, *(["--auth", keys] if keyed else []),
                                    "--epochs", str(args.epochs), "--warm-epochs", str(args.warm_epochs)],
                                   env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=900)
        if trainer.returncode != 0:
            raise RuntimeError(f"{mode}, {workers} workers: the trainer exited with {trainer.returncode}")
        return json.loads(trainer.stdout.splitlines()[-1])
    finally:
        stop(procs[1:])
        stop(procs[:1])


def trainer(argv: list[str]) -> None:
    """``python -m benchmarks.cross_host trainer ...``: run inside the trainer's host; prints
    ``trainer_cost.measure``'s figures of this process as one JSON line."""
    from benchmarks.trainer_cost import measure
    from remoteloader import RemoteDataLoader

    p = argparse.ArgumentParser(prog="python -m benchmarks.cross_host trainer")
    p.add_argument("--spec", required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--auth")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--warm-epochs", type=int, required=True)
    a = p.parse_args(argv)
    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    with RemoteDataLoader(a.spec, master=a.master, auth=a.auth, timeout=120) as loader:
        assert (loader._auth is None) == (a.auth is None)
        r = measure(loader, a.epochs, a.warm_epochs)
    print(json.dumps({k: v for k, v in r.items() if k != "threads_s_gb"}), flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--epochs", type=int, default=3, help="measured epochs per cluster (after the warm-up)")
    p.add_argument("--warm-epochs", type=int, default=1, help="epochs per cluster before measuring")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="worker counts, each a set of rounds")
    p.add_argument("--dense", type=int, default=13)
    p.add_argument("--sparse", type=int, default=26)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--no-cache", action="store_true", help="workers transform every epoch (no block cache)")
    p.add_argument("--max-message-bytes", metavar="BYTES", help="the workers' --max-message-bytes")
    return p


def main() -> None:
    if sys.argv[1:2] == ["trainer"]:
        return trainer(sys.argv[2:])
    args = parser().parse_args()
    why = netns_unavailable()
    if why is not None:
        sys.exit(f"benchmarks.cross_host: {why}")
    # SIGTERM (a timeout, a kill by pid) unwinds like Ctrl-C, so HostNet.close stops everything.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="rl-cross-host-"))
    results: dict[int, dict[str, list[dict]]] = {n: {m: [] for m in MODES} for n in args.workers}
    start = time.perf_counter()
    try:
        table = dlrm_table(tmp / "t", args.rows, args.dense, args.sparse)
        spec = tmp / "spec.json"
        spec.write_text(json.dumps(dlrm_spec(table, args.dense, args.sparse, args.batch_size,
                                             epochs=args.epochs + args.warm_epochs, cache=not args.no_cache)))
        keys = str(auth.keygen(tmp / "keys"))
        caches = {"plain": tmp / "cache-plain", "keys": tmp / "cache-keys"}
        with HostNet(3) as net:
            for workers in args.workers:
                for i in range(args.rounds):
                    for mode in MODES[i % len(MODES):] + MODES[:i % len(MODES)]:
                        r = run_mode(net, mode, workers, spec, table, keys, caches, args)
                        if r["rows"] != args.rows * args.epochs:
                            raise AssertionError(f"{mode}: {r['rows']} rows delivered, expected "
                                                 f"{args.rows * args.epochs}")
                        results[workers][mode].append(r)
                        print(f"# {workers} workers, round {i + 1}, {mode:>10}: {r['rows_s']:>9,.0f} rows/s, "
                              f"client {r['cpu']:.2f} CPU s for {r['bytes'] / 1e9:.3f} GB = {r['cpu_s_gb']:.3f} s/GB",
                              file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(args, results, time.perf_counter() - start)


def report(args: argparse.Namespace, results: dict[int, dict[str, list[dict]]], seconds: float) -> None:
    some = next(iter(results.values()))["plain TCP"][0]
    print(f"{args.rows:,} rows x {args.epochs} measured epochs (+{args.warm_epochs} warm-up), batch {args.batch_size}, "
          f"{args.dense} dense + {args.sparse} sparse, block cache {'off' if args.no_cache else 'write-all'}; "
          f"master h1, workers h2, trainer h3 (network namespaces on one bridge, veth links; loopback: all on h1); "
          f"{os.cpu_count()} cores (load {os.getloadavg()[0]:.1f}); {some['bytes'] / 1e9:.3f} GB of tensors per run; "
          f"{args.rounds} interleaved rounds ({seconds:.0f} s); sealing cipher {seal.default_cipher()}")
    print("medians over rounds; ratios are the median of each round's mode / plain TCP with as many workers; "
          "client CPU = the trainer process (user + sys, all threads)")
    print()
    print("| transport | workers | rows/s | ratio | GB/s | client CPU s/GB | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for workers, by_mode in results.items():
        base = by_mode["plain TCP"]
        for mode in MODES:
            rs = by_mode[mode]
            rows_ratio = statistics.median(r["rows_s"] / b["rows_s"] for r, b in zip(rs, base))
            cpu_ratio = statistics.median(r["cpu_s_gb"] / b["cpu_s_gb"] for r, b in zip(rs, base))
            print(f"| {LABELS[mode]} | {workers} | {statistics.median(r['rows_s'] for r in rs):,.0f} | "
                  f"{rows_ratio:.2f} | {statistics.median(r['gb_s'] for r in rs):.2f} | "
                  f"{statistics.median(r['cpu_s_gb'] for r in rs):.3f} | {cpu_ratio:.2f} |")


if __name__ == "__main__":
    main()
