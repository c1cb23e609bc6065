"""Autoscaling benchmark: the autoscaler vs a fixed oracle count vs a CPU-80% (Kubernetes HPA) policy.

Per scenario and policy: time until trainers stop stalling, avoidable stall after the
worker count settles, worker-seconds (starting + running + draining) and decisions.
Goal: no stall after convergence, worker-seconds within 15% of the oracle, better
than the CPU policy on time and worker-seconds.

Run: ``.venv/bin/python -m benchmarks.autoscale --sim [--scenario NAME] [--duration S]``,
or ``--real [--duration S]`` for real master and worker processes on this machine
(one scenario: I/O-bound workers, a trainer at a fixed rate; about 3 x S seconds).
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

from remoteloader.master.autoscale import (AutoscaleConfig, AutoscalePolicy, CpuTargetConfig, CpuTargetPolicy,
                                           OraclePolicy, Policy)
from benchmarks.simulator import Scenario, SimResult, oracle_workers, simulate

W = 10_000.0   # mean rows/s of one worker in every scenario

# Demands are chosen off whole worker counts so rounding does not flatter anyone.
SCENARIOS: list[Scenario] = [
    Scenario("steady", ((0, 36.6 * W),)),
    Scenario("step-up", ((0, 14.6 * W), (1200, 40.3 * W))),
    Scenario("step-down", ((0, 40.3 * W), (1200, 14.6 * W))),
    Scenario("io-bound", ((0, 24.4 * W),), cpu_busy=0.3),            # saturated at 30% CPU
    Scenario("large-500", ((0, 517.5 * W),), clients=64, tick_s=2.0),
    Scenario("large-1000", ((0, 984.3 * W),), clients=128, tick_s=2.0),
    # Bottlenecks past the workers: stall is unavoidable, the question is how many workers are wasted.
    Scenario("storage-bound", ((0, 40.0 * W),), storage_cap=16.4 * W),
    Scenario("trainer-bound", ((0, 40.0 * W),), client_cap=22.4 * W),
]


def policies(sc: Scenario, oracle: int) -> dict[str, Callable[[], Policy]]:
    """Same bounds for everyone; only the oracle knows the answer."""
    return {
        "autoscale": lambda: AutoscalePolicy(AutoscaleConfig(max_workers=sc.max_workers)),
        "oracle": lambda: OraclePolicy(oracle),
        "cpu-80%": lambda: CpuTargetPolicy(CpuTargetConfig(max_workers=sc.max_workers)),
    }


def stall_free_oracle(sc: Scenario) -> int:
    """Smallest fixed count that does not stall: from the capacity sum upwards, checked by simulation
    (the count whose capacity barely covers the mean demand still stalls on demand jitter)."""
    n = oracle_workers(sc)
    for _ in range(10):
        r = simulate(replace(sc, initial_workers=n), OraclePolicy(n), "oracle")
        if r.stall_after <= 1e-4:
            return n
        n += 1
    return n


@dataclass
class Row:
    scenario: str
    policy: str
    oracle: int
    time_to_stall_free: Optional[float]
    stall_after: float
    worker_seconds: float
    decisions: int
    direction_changes: int
    final_workers: int
    wall_s: float

    @classmethod
    def of(cls, r: SimResult, oracle: int, wall: float) -> "Row":
        return cls(r.scenario, r.policy, oracle, r.time_to_stall_free, r.stall_after, r.worker_seconds,
                   r.decisions, r.direction_changes, r.final_workers, wall)


def run_sim(scenarios: list[Scenario]) -> list[Row]:
    rows = []
    for sc in scenarios:
        oracle = stall_free_oracle(sc)
        for name, make in policies(sc, oracle).items():
            start = time.perf_counter()
            r = simulate(sc, make(), name)
            rows.append(Row.of(r, oracle, time.perf_counter() - start))
    return rows


REAL_BATCH_DELAY_S = 0.1  # injected per-batch cost: ~640 rows/s per worker at batch 64, CPU mostly idle
REAL_STEP_S = 0.04        # the trainer's step: 25 batches/s = 1600 rows/s, so 3 workers are needed
REAL_ORACLE = 3


def run_real(duration_s: float) -> list[Row]:
    """The same comparison with real master and worker processes on this machine.

    Workers are slowed by an injected per-batch cost that does not use CPU (like I/O
    waits), and the trainer consumes at a fixed rate; the fixed pool of 3 is the oracle.
    """
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from remoteloader import RemoteDataLoader
    from remoteloader.tools.datagen import generate_table

    table = Path(tempfile.mkdtemp(prefix="rl-autoscale-")) / "t"
    # Big enough that an epoch outlasts the run (epoch boundaries are their own stall),
    # with small splits (~1 s of one worker's output) so new workers get work at once.
    generate_table(str(table), rows=300_000, partitions=2, dense=4, sparse=4, format="orc", seed=1,
                   stripe_size=64 << 10, progress=False)
    spec = {"table": {"path": str(table)}, "features": {"label": "label", "dense": ["float_0"],
            "sparse": [{"name": "s0", "column": "idlist_0"}]}, "batch_size": 64, "split_rows": 640}
    worker_args = f"--inject-batch-delay {REAL_BATCH_DELAY_S} --buffer-batches 8"
    runs = {"autoscale": ["--autoscale", "--min-workers", "1", "--max-workers", "6"],
            "oracle": ["--workers", str(REAL_ORACLE)],
            "cpu-80%": ["--autoscale", "--autoscale-policy", "cpu", "--min-workers", "1", "--max-workers", "6"]}
    rows = []
    for name, flags in runs.items():
        master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                                   "--allow-table", str(table), "--worker-args", worker_args, *flags], stdout=subprocess.PIPE, text=True)
        addr = master.stdout.readline().rsplit(" ", 1)[1].strip()
        trace: list[tuple[float, int, float]] = []  # (t, active workers, client stall)
        start = last = time.monotonic()
        decisions: list[dict] = []
        try:
            with RemoteDataLoader(spec, master=addr, timeout=120) as loader:
                while time.monotonic() - start < duration_s:
                    for _ in loader:
                        time.sleep(REAL_STEP_S)
                        now = time.monotonic()
                        if now - last >= 1.0:
                            last = now
                            st = json.loads(subprocess.run(
                                [sys.executable, "-m", "remoteloader.cli", "status", "--master", addr, "--json"],
                                capture_output=True, text=True, check=True).stdout)
                            active = sum(1 for w in st["workers"] if not w["draining"])
                            stall = max((c["stall"] for c in st["clients"]), default=0.0)
                            trace.append((now - start, active, stall))
                            decisions = st["autoscaler"]
                        if now - start >= duration_s:
                            break
        finally:
            master.terminate()
            master.wait(30)
        rows.append(_real_row(name, trace, decisions, time.monotonic() - start))
    return rows


def _real_row(name: str, trace: list, decisions: list, wall: float) -> Row:
    """Stall-free from the first moment after which the windowed stall stays below 1%."""
    converged = None
    for i, (t, _, _) in enumerate(trace):
        if all(stall < 0.01 for _, _, stall in trace[i:]):
            converged = t
            break
    after = [stall for t, _, stall in trace if converged is not None and t >= converged]
    worker_s = sum(n for _, n, _ in trace)  # one sample per second
    moves = [d["action"] for d in decisions if d["action"] in ("add", "remove")]
    changes = sum(1 for a, b in zip(moves, moves[1:]) if a != b)
    return Row("real, io-bound", name, REAL_ORACLE, converged,
               sum(after) / len(after) if after else (trace[-1][2] if trace else 1.0),
               worker_s, len(moves), changes, trace[-1][1] if trace else 0, wall)


def _t(x: Optional[float]) -> str:
    return "never" if x is None else f"{x:.0f}"


def report(rows: list[Row]) -> str:
    """Markdown: one line per (scenario, policy), then the goals per scenario."""
    out = ["| scenario | policy | oracle n | time to stall-free (s) | stall after conv. | worker-s | vs oracle "
           "| decisions | dir. changes | final n | sim wall (s) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r.scenario, r.policy): r for r in rows}
    for r in rows:
        base = by.get((r.scenario, "oracle"))
        rel = f"{r.worker_seconds / base.worker_seconds - 1:+.1%}" if base else ""
        out.append(f"| {r.scenario} | {r.policy} | {r.oracle} | {_t(r.time_to_stall_free)} | {r.stall_after:.2%} "
                   f"| {r.worker_seconds:,.0f} | {rel} | {r.decisions} | {r.direction_changes} "
                   f"| {r.final_workers} | {r.wall_s:.1f} |")
    out += ["", "| scenario | no stall after conv. | worker-s <= 1.15x oracle | faster than CPU-80% "
            "| fewer worker-s than CPU-80% |", "|---|---|---|---|---|"]
    for sc in dict.fromkeys(r.scenario for r in rows):
        a, o, c = by.get((sc, "autoscale")), by.get((sc, "oracle")), by.get((sc, "cpu-80%"))
        if not (a and o and c):
            continue
        inf = math.inf
        ta = inf if a.time_to_stall_free is None else a.time_to_stall_free
        tc = inf if c.time_to_stall_free is None else c.time_to_stall_free
        mark = lambda ok: "yes" if ok else "**no**"  # noqa: E731
        fewer = (mark(a.worker_seconds < c.worker_seconds) if c.time_to_stall_free is not None
                 else f"n/a: CPU-80% never stops the stall ({c.stall_after:.0%}) on {c.final_workers} workers")
        out.append(f"| {sc} | {mark(a.stall_after <= 0.001)} | {mark(a.worker_seconds <= 1.15 * o.worker_seconds)} "
                   f"| {mark(ta < tc) if ta != tc else 'tie'} | {fewer} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sim", action="store_true", help="simulated workers and trainers (default)")
    mode.add_argument("--real", action="store_true", help="real master and worker processes on this machine")
    p.add_argument("--scenario", action="append", help="run only these scenarios (repeatable)")
    p.add_argument("--duration", type=float, help="override simulated seconds per run")
    args = p.parse_args()
    if args.real:
        print(report(run_real(args.duration or 150.0)))
        return
    chosen = [s for s in SCENARIOS if not args.scenario or s.name in args.scenario]
    if args.duration:
        chosen = [replace(s, duration_s=args.duration) for s in chosen]
    print(report(run_sim(chosen)))


if __name__ == "__main__":
    main()
