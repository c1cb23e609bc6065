"""Small batches flat out: batches/s to one client, and how much of the time it waited.

A trainer that takes batches of ``--batch-size`` (64) as fast as it can from 2
embedded workers on a light spec (4 dense columns as they are, 2 sparse with
``firstx``). Reported per tree: batches/s and rows/s from the first batch of an epoch
to its last, the trainer's stall (time blocked waiting for a batch, over the same
span), the credit window the client ended with, and the autoscaler's view. The
baseline commit (a git worktree: request/reply, 2 requests in flight per worker) and
this tree run one after the other in the same invocation, alternating rounds.

``--autoscale``: instead, this tree only, the same trainer against a master with
``--autoscale`` (1 to 4 local workers) for ``--seconds``: the worker count over time,
the stall once the count settled, and the autoscaler's decisions (what it chose, and
why). Give it ``--rows 2000000``: on the default table an epoch lasts about a second,
and epoch boundaries, not the worker count, dominate.

Run: ``.venv/bin/python -m benchmarks.throughput [--rows 400000 --rounds 3] [--baseline REF]``
or ``... --autoscale --rows 2000000 --seconds 90``.
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

ROOT = Path(__file__).resolve().parent.parent


def light_spec(table: str, batch_size: int) -> dict:
    return {"table": {"path": table},
            "features": {"label": "label", "dense": [f"float_{i}" for i in range(4)],
                         "sparse": [{"name": f"s{i}", "column": f"idlist_{i}", "transforms": [{"op": "firstx", "x": 8}]}
                                    for i in range(2)]},
            "batch_size": batch_size}


def run_one(src: Path, table: str, batch_size: int, epochs: int) -> dict:
    """Epochs flat out from a loader of the tree ``src`` (in a child process)."""
    sys.path.insert(0, str(src))
    from remoteloader import RemoteDataLoader

    rates = []
    with RemoteDataLoader(light_spec(table, batch_size), num_workers=2) as loader:
        for _ in range(epochs):
            it = iter(loader)
            first = next(it)
            wait0, rows, n = loader.stats.wait_s, len(first), 0
            start = time.perf_counter()
            for b in it:
                rows += len(b)
                n += 1
            elapsed = time.perf_counter() - start
            rates.append({"batches_per_s": n / elapsed, "rows_per_s": (rows - len(first)) / elapsed,
                          "stall": (loader.stats.wait_s - wait0) / elapsed})
        window = getattr(getattr(loader, "credit", None), "pieces", None)
    best = max(rates, key=lambda r: r["batches_per_s"])  # later epochs run on a warmed-up window
    return {**best, "window": window}


def autoscale_choice(table: str, batch_size: int, seconds: float) -> dict:
    """The trainer flat out against an autoscaling master: its worker counts and decisions."""
    from remoteloader import RemoteDataLoader

    master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                               "--allow-table", table, "--autoscale", "--min-workers", "1", "--max-workers", "4"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    addr = master.stdout.readline().rsplit(" ", 1)[1].strip()

    def status() -> dict:
        return json.loads(subprocess.run([sys.executable, "-m", "remoteloader.tools.cli", "status", "--master", addr,
                                          "--json"], capture_output=True, text=True, check=True, cwd=ROOT).stdout)

    trace, start = [], time.perf_counter()
    try:
        with RemoteDataLoader(light_spec(table, batch_size), master=addr, timeout=120) as loader:
            wait0, starved0, n, last = loader.stats.wait_s, loader.stats.starved_s, 0, start
            while time.perf_counter() - start < seconds:
                for _ in loader:
                    n += 1
                    if time.perf_counter() - last >= 5:
                        last = time.perf_counter()
                        st = status()
                        trace.append({"t": round(last - start), "workers": len(st["workers"]),
                                      "stall": round(loader.stats.wait_s - wait0, 2),
                                      "starved": round(loader.stats.starved_s - starved0, 2)})
                    if time.perf_counter() - start >= seconds:
                        break
            elapsed = time.perf_counter() - start
            decisions = status()["autoscaler"]
            # The stall once the worker count settled: from the first sample at the final count.
            settled = next((p for i, p in enumerate(trace) if all(q["workers"] == p["workers"] for q in trace[i:])),
                           None)
            settled_stall = None if settled is None else round(
                (loader.stats.wait_s - wait0 - settled["stall"]) / max(1.0, elapsed - settled["t"]), 4)
            return {"batches_per_s": n / elapsed, "stall": (loader.stats.wait_s - wait0) / elapsed,
                    "starved": (loader.stats.starved_s - starved0) / elapsed, "window": loader.credit.pieces,
                    "settled": None if settled is None else {"t": settled["t"], "workers": settled["workers"],
                                                             "stall": settled_stall},
                    "trace": trace,
                    "decisions": [{k: d[k] for k in ("action", "workers", "reason") if k in d} for d in decisions]}
    finally:
        master.terminate()
        master.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=400_000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2, help="epochs per round (the best is kept)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", default="19ba756", help="git ref to compare with (request/reply transport)")
    p.add_argument("--autoscale", action="store_true", help="the autoscaler's choice for this trainer (this tree)")
    p.add_argument("--seconds", type=float, default=60.0, help="with --autoscale: how long the trainer runs")
    p.add_argument("--one", metavar="TREE", help=argparse.SUPPRESS)
    p.add_argument("--table", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(Path(args.one), args.table, args.batch_size, args.epochs)))
        return 0

    sys.path.insert(0, str(ROOT))
    from benchmarks.control_plane import baseline_tree
    from remoteloader.tools.datagen import generate_table

    table = Path(tempfile.mkdtemp(prefix="rl-tp-")) / "t"
    generate_table(str(table), rows=args.rows, partitions=2, dense=4, sparse=2, format="orc", seed=9, progress=False)
    if args.autoscale:
        print(json.dumps(autoscale_choice(str(table), args.batch_size, args.seconds), indent=1))
        return 0
    with baseline_tree(args.baseline) as base:
        trees = {f"baseline {args.baseline}": base, "this tree": ROOT}
        results: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name, tree in trees.items():
                # The embedded master and workers are `python -m remoteloader...`: from the tree's own code.
                out = subprocess.run([sys.executable, __file__, "--one", str(tree), "--table", str(table),
                                      "--batch-size", str(args.batch_size), "--epochs", str(args.epochs)],
                                     capture_output=True, text=True, check=True, cwd=tree,
                                     env={**os.environ, "PYTHONPATH": str(tree), "REMOTELOADER_QUIET": "1"})
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r} {name}: {results[name][-1]}", file=sys.stderr)
    print(f"{args.rows} rows, batch {args.batch_size}, light spec (4 dense, 2 sparse firstx), 2 embedded workers, "
          f"median of {args.rounds} rounds\n")
    print(f"{'tree':<18} {'batches/s':>10} {'rows/s':>10} {'stall':>7} {'window':>7}")
    for name, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("batches_per_s", "rows_per_s", "stall")}
        window = rs[-1]["window"]
        print(f"{name:<18} {med['batches_per_s']:>10,.0f} {med['rows_per_s']:>10,.0f} {med['stall']:>7.1%} "
              f"{'-' if window is None else window:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
