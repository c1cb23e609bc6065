"""Trainer stall across a master crash: SIGKILL the master mid-epoch, restart it 5 s later.

A real job: a master with a journal, 2 workers, 1 trainer whose step takes ``--step-ms``
(a sleep, as a GPU step releases the CPU). Once the workers' buffers are full, the
master is killed, and restarted on its journal and address ``--down`` seconds later.
Reported: the fraction of the outage (kill → restart) and of the recovery after it
(restart → +``--down`` s) the trainer spent waiting for a batch, the same fraction
with the master up (the 2 s before the kill: the loop's own cost of taking a batch), and
whether the epoch was still exactly once. The same job runs against a baseline commit (a git worktree)
and this tree, one after the other in the same run.

Run: ``.venv/bin/python -m benchmarks.master_restart [--baseline REF]``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def spec_for(table: str, batch_size: int) -> dict:
    return {"table": {"path": table},
            "features": {"label": "label", "dense": [f"float_{i}" for i in range(4)],
                         "sparse": [{"name": f"s{i}", "column": f"idlist_{i}", "transforms": [{"op": "firstx", "x": 20}]}
                                    for i in range(4)],
                         "passthrough": ["row_id"]},
            "batch_size": batch_size, "split_rows": 8192}


def run_job(src: Path, table: str, rows: int, batch_size: int, step_s: float, warmup_s: float, down_s: float,
            buffer: int) -> dict:
    """One trainer against a master and workers from the tree ``src`` (run in a child)."""
    sys.path.insert(0, str(src))
    import numpy as np
    from remoteloader import RemoteDataLoader

    tmp = Path(tempfile.mkdtemp(prefix="rl-restart-"))
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec_for(table, batch_size)))
    env = {**os.environ, "PYTHONPATH": str(src)}
    master_cmd = [sys.executable, "-m", "remoteloader.master", "--spec", str(spec_path), "--journal", str(tmp / "j"),
                  "--heartbeat-timeout", "10"]
    procs: list[subprocess.Popen] = []

    def start_master(bind: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen(master_cmd + ["--bind", bind], stdout=subprocess.PIPE, text=True, env=env, cwd=src)
        procs.append(proc)
        return proc, proc.stdout.readline().rsplit(" ", 1)[1].strip()

    master, addr = start_master("tcp://127.0.0.1:0")
    procs += [subprocess.Popen([sys.executable, "-m", "remoteloader.worker", "--master", addr, "--buffer-batches",
                                str(buffer)], env=env, cwd=src, stderr=subprocess.DEVNULL) for _ in range(2)]
    events: dict[str, float] = {}

    def crash_and_restart() -> None:
        events["kill"] = time.perf_counter()
        master.send_signal(signal.SIGKILL)
        master.wait()
        time.sleep(down_s)
        events["restart"] = time.perf_counter()
        start_master(addr)

    waits: list[tuple[float, float]] = []  # (start, end) of each wait for a batch
    seen = np.zeros(rows, dtype=np.int64)
    try:
        with RemoteDataLoader(spec_path, master=addr, timeout=120) as loader:
            it = iter(loader)
            timer = None
            first = time.perf_counter()
            while True:
                t0 = time.perf_counter()
                batch = next(it, None)
                waits.append((t0, time.perf_counter()))
                if batch is None:
                    break
                np.add.at(seen, batch.passthrough["row_id"].numpy(), 1)
                if timer is None and time.perf_counter() - first > warmup_s:
                    timer = threading.Thread(target=crash_and_restart)
                    timer.start()
                time.sleep(step_s)
            timer.join()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def stalled(lo: float, hi: float) -> float:
        return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in waits) / (hi - lo)

    kill, restart = events["kill"], events["restart"]
    # The same measure with the master up, over the 2 s before the kill (past the start of
    # the epoch): what taking a batch from the loader costs the loop in steady state.
    return {"steady_stall": stalled(kill - 2.0, kill),
            "outage_stall": stalled(kill, restart), "recovery_stall": stalled(restart, restart + down_s),
            "batches_in_outage": sum(1 for a, b in waits if kill <= b < restart),
            "exactly_once": bool((seen == 1).all()), "epoch_s": waits[-1][1] - waits[0][0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=400_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=10.0, help="the trainer's step (a sleep)")
    p.add_argument("--warmup", type=float, default=6.0, help="seconds of training before the kill")
    p.add_argument("--down", type=float, default=5.0, help="seconds between the kill and the restart")
    p.add_argument("--buffer", type=int, default=320, help="--buffer-batches of each worker")
    p.add_argument("--baseline", default="19ba756", help="git ref to compare with (before control threads)")
    p.add_argument("--one", metavar="TREE", help=argparse.SUPPRESS)  # internal: run one job from TREE
    p.add_argument("--table", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_job(Path(args.one), args.table, args.rows, args.batch_size, args.step_ms / 1000,
                                 args.warmup, args.down, args.buffer)))
        return 0

    sys.path.insert(0, str(ROOT))
    from benchmarks.control_plane import baseline_tree
    from remoteloader.tools.datagen import generate_table

    table = Path(tempfile.mkdtemp(prefix="rl-restart-t-")) / "t"
    generate_table(str(table), rows=args.rows, partitions=2, dense=4, sparse=4, format="orc", seed=5, progress=False)
    results = {}
    with baseline_tree(args.baseline) as base:
        for name, tree in ((f"baseline {args.baseline}", base), ("this tree", ROOT)):
            out = subprocess.run([sys.executable, __file__, "--one", str(tree), "--table", str(table),
                                  "--rows", str(args.rows), "--batch-size", str(args.batch_size),
                                  "--step-ms", str(args.step_ms), "--warmup", str(args.warmup),
                                  "--down", str(args.down), "--buffer", str(args.buffer)],
                                 capture_output=True, text=True, check=True)
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    demand = 1000 / args.step_ms * args.batch_size
    print(f"{args.rows} rows, batch {args.batch_size}, trainer step {args.step_ms:g} ms (~{demand:,.0f} rows/s), "
          f"2 workers x {args.buffer} buffered batches; master SIGKILLed after {args.warmup:g} s, "
          f"restarted {args.down:g} s later\n")
    print(f"{'tree':<18} {'stall, master up':>16} {'stall in outage':>15} {'stall after restart':>19} "
          f"{'batches in outage':>17} {'exactly once':>12}")
    for name, r in results.items():
        print(f"{name:<18} {r['steady_stall']:>16.1%} {r['outage_stall']:>15.1%} {r['recovery_stall']:>19.1%} "
              f"{r['batches_in_outage']:>17} {str(r['exactly_once']):>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
