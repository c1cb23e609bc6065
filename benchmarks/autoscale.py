"""Autoscaling benchmark: the autoscaler vs a fixed oracle count vs a CPU-80% (Kubernetes HPA) policy.

Per scenario and policy: time until trainers stop stalling, avoidable stall after the
worker count settles, worker-seconds (starting + running + draining) and decisions.
Goal: no stall after convergence, worker-seconds within 15% of the oracle, better
than the CPU policy on time and worker-seconds.

Run: ``.venv/bin/python -m benchmarks.autoscale --sim [--scenario NAME] [--duration S] [--exact-ticks]``,
or ``--real [--scenario io-bound|slow-down|trainers-leave] [--policy NAME]`` for real master
and worker processes on this machine. Real scenarios: ``io-bound`` (I/O-bound workers, a
trainer at a fixed rate; about 3 x ``--duration`` seconds), ``slow-down`` (a trainer flat
out for ``--flat-s``, then 128 rows/s for ``--slow-s``: does the fleet go back to 1 worker,
and how fast; about 3 x (flat + slow) seconds) and ``trainers-leave`` (a trainer flat out
for ``--flat-s``, then it closes its loader and the master runs on for ``--away-s`` with no
trainer: back to ``--min-workers`` 1, and when; autoscale only, flat + away seconds).
"""
from __future__ import annotations

import argparse
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from remoteloader.master.autoscale import (AutoscaleConfig, AutoscalePolicy, CpuTargetConfig, CpuTargetPolicy,
                                           OraclePolicy, Policy)
from benchmarks.simulator import Scenario, SimResult, jobs_demand, oracle_workers, simulate

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

# Issue 25, as the real benchmark's slow-down runs it: workers of ~640 rows/s (64-row batches,
# 0.1 s each), one trainer flat out (10 workers' worth, so 1 -> 3 = max_workers while it
# starves) for 90 s, then 128 rows/s for five minutes: 1 worker does it, 80% idle.
SLOW_WORKER = 640.0
SLOWDOWN = Scenario("slow-down", ((0, 10 * SLOW_WORKER), (90, 128.0)), duration_s=390, worker_rate=SLOW_WORKER,
                    batch_rows=64, buffer_batches=8, window_batches=16, clients=1, startup_s=3.0, max_workers=3)
SCENARIOS.append(SLOWDOWN)
# Issue 38: the same trainer and workers, grown to 3 = max_workers while it starves, then it
# exits at 90 s and no trainer connects for five minutes: back to min_workers (1) or not.
TRAINERS_LEAVE = replace(SLOWDOWN, name="trainers-leave", demand=((0, 10 * SLOW_WORKER),), away=(90.0, math.inf))
SCENARIOS.append(TRAINERS_LEAVE)
# Issue 39: one shared fleet for a sweep (the whole hour), an ablation (10 to 40 min) and an
# evaluation (20 to 30 min): the autoscaler follows the sum of their demands, up and down.
SCENARIOS.append(Scenario("three-jobs", jobs_demand([(0, 3600, 14.6 * W), (600, 2400, 12.2 * W),
                                                     (1200, 1800, 9.3 * W)]), clients=12))


def policies(sc: Scenario, oracle: int) -> dict[str, Callable[[], Policy]]:
    """Same bounds for everyone; only the oracle knows the answer."""
    return {
        "autoscale": lambda: AutoscalePolicy(AutoscaleConfig(max_workers=sc.max_workers)),
        "oracle": lambda: OraclePolicy(oracle),
        "cpu-80%": lambda: CpuTargetPolicy(CpuTargetConfig(max_workers=sc.max_workers)),
    }


def _drop_at(sc: Scenario) -> Optional[float]:
    """When the scenario's demand last drops: a lower last demand, or all trainers leaving."""
    if sc.away is not None:
        return sc.away[0]
    if len(sc.demand) < 2 or sc.demand[-1][1] >= sc.demand[-2][1]:
        return None
    return sc.demand[-1][0]


def scale_down_s(sc: Scenario, r: SimResult) -> Optional[float]:
    """Seconds from the last demand drop (or the trainers leaving) to the last removal after
    it (None: no drop in the scenario, or nothing removed after it)."""
    drop = _drop_at(sc)
    if drop is None:
        return None
    removals = [d.time for d in r.actions if d.action == "remove" and d.time >= drop]
    return removals[-1] - drop if removals else None


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
    down_s: Optional[float] = None      # from the last demand drop to the last removal after it
    drop: bool = False                  # the scenario ends with a demand drop

    @classmethod
    def of(cls, sc: Scenario, r: SimResult, oracle: int, wall: float) -> "Row":
        drop = _drop_at(sc) is not None
        return cls(r.scenario, r.policy, oracle, r.time_to_stall_free, r.stall_after, r.worker_seconds,
                   r.decisions, r.direction_changes, r.final_workers, wall, scale_down_s(sc, r), drop)


def run_sim(scenarios: list[Scenario]) -> list[Row]:
    rows = []
    for sc in scenarios:
        oracle = stall_free_oracle(sc)
        for name, make in policies(sc, oracle).items():
            start = time.perf_counter()
            r = simulate(sc, make(), name)
            rows.append(Row.of(sc, r, oracle, time.perf_counter() - start))
    return rows


REAL_BATCH_DELAY_S = 0.1  # injected per-batch cost: ~640 rows/s per worker at batch 64, CPU mostly idle
REAL_STEP_S = 0.04        # the trainer's step: 25 batches/s = 1600 rows/s, so 3 workers are needed
REAL_ORACLE = 3
REAL_SLOW_STEP_S = 0.5    # slow-down: 64 rows per 0.5 s = 128 rows/s, a fifth of one worker
REAL_WORKER_ARGS = f"--inject-batch-delay {REAL_BATCH_DELAY_S} --buffer-batches 8"


class _StatusPoller(threading.Thread):
    """The master's status about once a second, over an RPC client of its own (no process per
    poll, which would take a core on a small machine). ``samples``: per poll the time since
    ``t0``, workers taking splits (``active``) and draining, the client's stall and starved
    share, and per active worker its busy share, buffered batches and rows/s."""

    def __init__(self, addr: str, t0: float, period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.addr, self.t0, self.period_s = addr, t0, period_s
        self.samples: list[dict] = []
        self.decisions: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        import zmq

        from remoteloader.protocol.messages import Status
        from remoteloader.protocol.rpc import MasterUnavailable, RemoteError, RpcClient

        rpc = RpcClient(zmq.Context.instance(), self.addr, 5.0)
        try:
            while not self.done.wait(self.period_s):
                try:
                    st = rpc.call(Status()).status
                except (MasterUnavailable, RemoteError):
                    continue
                workers = [w for w in st["workers"] if not w.get("draining")]
                clients = st["clients"]
                self.samples.append({
                    "t": time.monotonic() - self.t0, "active": len(workers),
                    "draining": sum(1 for w in st["workers"] if w.get("draining")),
                    "stall": max((c.get("stall", 0.0) for c in clients), default=0.0),
                    "starved": max((c.get("starved", 0.0) for c in clients), default=0.0),
                    "busy": [w.get("busy", math.nan) for w in workers],
                    "buffered": [w.get("buffered", 0) for w in workers],
                    "rows_per_s": [w.get("rows_per_s", 0.0) for w in workers]})
                self.decisions = st.get("autoscaler") or self.decisions
        finally:
            rpc.close()


def _real_table(rows: int):
    import tempfile
    from pathlib import Path

    from remoteloader.tools.datagen import generate_table

    table = Path(tempfile.mkdtemp(prefix="rl-autoscale-")) / "t"
    # Big enough that an epoch outlasts the run (epoch boundaries are their own stall),
    # with small splits (~1 s of one worker's output) so new workers get work at once.
    generate_table(str(table), rows=rows, partitions=2, dense=4, sparse=4, format="orc", seed=1,
                   stripe_size=64 << 10, progress=False)
    spec = {"table": {"path": str(table)}, "features": {"label": "label", "dense": ["float_0"],
            "sparse": [{"name": "s0", "column": "idlist_0"}]}, "batch_size": 64, "split_rows": 640}
    return table, spec


def _run_master(table, spec: dict, flags: list[str], seconds: float,
                step_s: Callable[[float], float], linger_s: float = 0.0) -> tuple[_StatusPoller, float]:
    """One master with ``flags`` and one trainer for ``seconds``, sleeping ``step_s(t)`` after
    each batch (0: flat out), then the master alone for ``linger_s`` (the trainer closed its
    loader); the master's status polled all along."""
    import subprocess
    import sys

    from remoteloader import RemoteDataLoader

    master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                               "--allow-table", str(table), "--worker-args", REAL_WORKER_ARGS, *flags],
                              stdout=subprocess.PIPE, text=True)
    start = time.monotonic()
    poller: Optional[_StatusPoller] = None
    try:
        addr = master.stdout.readline().rsplit(" ", 1)[1].strip()
        poller = _StatusPoller(addr, start)
        poller.start()
        with RemoteDataLoader(spec, master=addr, timeout=120) as loader:
            while time.monotonic() - start < seconds:
                for _ in loader:
                    now = time.monotonic() - start
                    if now >= seconds:
                        break
                    pause = step_s(now)
                    if pause > 0:
                        time.sleep(pause)
        time.sleep(linger_s)
    finally:
        if poller is not None:
            poller.done.set()
            poller.join(10)
        master.terminate()
        master.wait(30)
    return poller, time.monotonic() - start


def run_real(duration_s: float, only: Optional[list[str]] = None) -> list[Row]:
    """The io-bound comparison with real master and worker processes on this machine.

    Workers are slowed by an injected per-batch cost that does not use CPU (like I/O
    waits), and the trainer consumes at a fixed rate; the fixed pool of 3 is the oracle.
    """
    table, spec = _real_table(300_000)
    runs = {"autoscale": ["--autoscale", "--min-workers", "1", "--max-workers", "6"],
            "oracle": ["--workers", str(REAL_ORACLE)],
            "cpu-80%": ["--autoscale", "--autoscale-policy", "cpu", "--min-workers", "1", "--max-workers", "6"]}
    rows = []
    for name, flags in runs.items():
        if only and name not in only:
            continue
        poller, wall = _run_master(table, spec, flags, duration_s, lambda t: REAL_STEP_S)
        trace = [(s["t"], s["active"], s["stall"]) for s in poller.samples]
        rows.append(_real_row(name, trace, poller.decisions, wall))
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


@dataclass
class SlowRow:
    """One policy in the real slow-down: a trainer flat out for ``flat_s``, then 128 rows/s."""
    policy: str
    workers_flat: Optional[int]        # workers taking splits at the end of the flat-out phase
    stall_flat: float                  # mean trainer stall while flat out (unavoidable beyond 3 workers)
    stall_slow: float                  # mean stall in the slow phase (from 10 s in: the rate window lags)
    starved_slow: float                # ... of it with no batch held at any worker
    worker_s: float                    # active + draining workers, integrated over the run
    down_s: Optional[float]            # from the slow-down until 1 worker takes splits for good
    decisions: int                     # add/remove actions
    busy_slow: float                   # mean busy share of the active workers in the slow phase
    buffered_slow: float               # mean batches buffered per active worker in the slow phase
    reasons: list[str]                 # the autoscaler's add/remove reasons (for the record)


def run_real_slowdown(flat_s: float, slow_s: float, only: Optional[list[str]] = None) -> list[SlowRow]:
    """Issue 25 on real processes: master ``--autoscale --min-workers 1 --max-workers 3
    --launcher local``; one trainer flat out (far above 3 workers of ~640 rows/s) for
    ``flat_s``, then sleeping 0.5 s per 64-row batch (128 rows/s) for ``slow_s``. Against a
    fixed pool of 3 (what the flat-out phase needs) and the CPU-80% rule with the same bounds;
    the per-phase oracle (3, then 1) is computed, not run."""
    # Flat out: at most 3 x 640 rows/s; slow: 128 rows/s. An epoch must outlast the run.
    table, spec = _real_table(max(300_000, int(1.5 * (3 * SLOW_WORKER * flat_s + 128 * slow_s))))
    bounds = ["--min-workers", "1", "--max-workers", "3", "--launcher", "local"]
    runs = {"autoscale": ["--autoscale", *bounds],
            "fixed 3": ["--workers", "3"],
            "cpu-80%": ["--autoscale", "--autoscale-policy", "cpu", *bounds]}
    rows = []
    for name, flags in runs.items():
        if only and name not in only:
            continue
        poller, _ = _run_master(table, spec, flags, flat_s + slow_s,
                                lambda t: 0.0 if t < flat_s else REAL_SLOW_STEP_S)
        rows.append(_slow_row(name, poller.samples, poller.decisions, flat_s, poller.t0))
    return rows


def _slow_row(name: str, samples: list[dict], decisions: list[dict], flat_s: float, t0: float) -> SlowRow:
    """``t0``: the run's start on this machine's monotonic clock, which the master's decision
    times also read (same machine), so they print as seconds into the run."""
    flat = [s for s in samples if s["t"] < flat_s]
    slow = [s for s in samples if s["t"] >= flat_s + 10]
    times = [s["t"] for s in samples]
    dts = np.diff([0.0, *times]) if times else np.empty(0)
    worker_s = float(sum(dt * (s["active"] + s["draining"]) for dt, s in zip(dts, samples)))
    down = None
    after = [s for s in samples if s["t"] >= flat_s]
    for i, s in enumerate(after):
        if all(x["active"] == 1 for x in after[i:]):
            down = s["t"] - flat_s
            break

    def mean(xs: list[float]) -> float:
        xs = [x for x in xs if not math.isnan(x)]
        return float(np.mean(xs)) if xs else math.nan

    moves = [d for d in decisions if d.get("action") in ("add", "remove")]
    return SlowRow(name, flat[-1]["active"] if flat else None, mean([s["stall"] for s in flat]),
                   mean([s["stall"] for s in slow]), mean([s["starved"] for s in slow]), worker_s, down,
                   len(moves), mean([b for s in slow for b in s["busy"]]),
                   mean([b for s in slow for b in s["buffered"]]),
                   [f"t={d.get('time', math.nan) - t0:.0f} s {d['action']} -> {d.get('workers')}: {d.get('reason', '')}"
                    for d in moves])


def report_slowdown(rows: list[SlowRow], flat_s: float, slow_s: float) -> str:
    """Markdown: one line per policy, plus the per-phase oracle (3 while flat out, then 1)."""
    oracle_ws = 3 * flat_s + 1 * slow_s
    out = [f"Real slow-down: trainer flat out for {flat_s:.0f} s, then 128 rows/s for {slow_s:.0f} s; "
           f"per-phase oracle (3, then 1; computed): {oracle_ws:,.0f} worker-s.", "",
           "| policy | n at end of flat | stall flat | stall slow | starved slow | worker-s | vs per-phase oracle "
           "| down to 1 after (s) | decisions | slow: busy | slow: buffered/worker |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r.policy} | {r.workers_flat} | {r.stall_flat:.1%} | {r.stall_slow:.2%} | {r.starved_slow:.2%} "
                   f"| {r.worker_s:,.0f} | {r.worker_s / oracle_ws - 1:+.1%} | {_t(r.down_s)} | {r.decisions} "
                   f"| {r.busy_slow:.0%} | {r.buffered_slow:.1f} |")
    for r in rows:
        if r.reasons:
            out += ["", f"{r.policy}:"] + [f"* {x}" for x in r.reasons]
    return "\n".join(out)


def run_real_leave(flat_s: float, away_s: float) -> str:
    """Issue 38 on real processes: master ``--autoscale --min-workers 1 --max-workers 3
    --launcher local``, one trainer flat out for ``flat_s`` (1 -> 3 while it starves), then it
    closes its loader and the master runs on alone for ``away_s``. Markdown: workers when it
    left, seconds until 1 worker took splits for good, worker-seconds while no trainer was
    connected (against 1 worker), the workers' rows/s in status 2 s and 12 s after it left
    (the rate window is 10 s), and the autoscaler's decisions after it left."""
    table, spec = _real_table(max(300_000, int(1.5 * 3 * SLOW_WORKER * flat_s)))
    flags = ["--autoscale", "--min-workers", "1", "--max-workers", "3", "--launcher", "local"]
    poller, _ = _run_master(table, spec, flags, flat_s, lambda t: 0.0, linger_s=away_s)
    samples = poller.samples
    left = [s for s in samples if s["t"] >= flat_s]
    before = [s for s in samples if s["t"] < flat_s]
    down = next((s["t"] - flat_s for i, s in enumerate(left) if all(x["active"] == 1 for x in left[i:])), None)
    times = [s["t"] for s in left]
    dts = np.diff([flat_s, *times]) if times else np.empty(0)
    worker_s = float(sum(dt * (s["active"] + s["draining"]) for dt, s in zip(dts, left)))
    def shown(at: float) -> str:
        rates = next((s["rows_per_s"] for s in left if s["t"] >= flat_s + at), [])
        return ", ".join(f"{r:,.0f}" for r in rates)

    after = [d for d in poller.decisions if d.get("time", 0.0) - poller.t0 >= flat_s]
    out = [f"Real trainers-leave: trainer flat out for {flat_s:.0f} s, then no trainer for {away_s:.0f} s "
           "(master --autoscale --min-workers 1 --max-workers 3).", "",
           "| workers when it left | back to 1 after (s) | worker-s with no trainer | vs 1 worker "
           "| workers' rows/s 2 s after | 12 s after |", "|---:|---:|---:|---:|---|---|",
           f"| {before[-1]['active'] if before else '?'} | {_t(down)} | {worker_s:,.0f} "
           f"| {worker_s / max(away_s, 1e-9):.2f}x | {shown(2)} | {shown(12)} |", ""]
    out += [f"* t={d.get('time', math.nan) - poller.t0 - flat_s:+.0f} s after it left: {d['action']} "
            f"-> {d.get('workers')}: {d.get('reason', '')}" for d in after]
    return "\n".join(out)


def _t(x: Optional[float]) -> str:
    return "never" if x is None else f"{x:.0f}"


def report(rows: list[Row]) -> str:
    """Markdown: one line per (scenario, policy), then the goals per scenario."""
    out = ["| scenario | policy | oracle n | time to stall-free (s) | stall after conv. | worker-s | vs oracle "
           "| decisions | dir. changes | final n | last removal after the drop (s) | sim wall (s) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r.scenario, r.policy): r for r in rows}
    for r in rows:
        base = by.get((r.scenario, "oracle"))
        rel = f"{r.worker_seconds / base.worker_seconds - 1:+.1%}" if base else ""
        down = ("none" if r.down_s is None else f"{r.down_s:.0f}") if r.drop else ""
        out.append(f"| {r.scenario} | {r.policy} | {r.oracle} | {_t(r.time_to_stall_free)} | {r.stall_after:.2%} "
                   f"| {r.worker_seconds:,.0f} | {rel} | {r.decisions} | {r.direction_changes} "
                   f"| {r.final_workers} | {down} | {r.wall_s:.1f} |")
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
    p.add_argument("--scenario", action="append",
                   help="run only these scenarios (repeatable); real ones: io-bound, slow-down")
    p.add_argument("--duration", type=float, help="override simulated seconds per run (--real io-bound: seconds)")
    p.add_argument("--exact-ticks", action="store_true",
                   help="simulated control ticks exactly 1 s apart (default: as the live master, a little late "
                        "and jittered)")
    p.add_argument("--policy", action="append", help="--real: run only these policies (repeatable)")
    p.add_argument("--flat-s", type=float, default=90.0, help="--real slow-down: seconds the trainer runs flat out")
    p.add_argument("--slow-s", type=float, default=240.0, help="--real slow-down: seconds at 128 rows/s after that")
    p.add_argument("--away-s", type=float, default=60.0,
                   help="--real trainers-leave: seconds the master runs on after the trainer left")
    args = p.parse_args()
    if args.real:
        names = args.scenario or ["io-bound", "slow-down"]
        if "io-bound" in names:
            print(report(run_real(args.duration or 150.0, args.policy)), flush=True)
        if "slow-down" in names:
            print(report_slowdown(run_real_slowdown(args.flat_s, args.slow_s, args.policy), args.flat_s,
                                  args.slow_s), flush=True)
        if "trainers-leave" in names:
            print(run_real_leave(args.flat_s, args.away_s), flush=True)
        return
    chosen = [s for s in SCENARIOS if not args.scenario or s.name in args.scenario]
    if args.duration:
        chosen = [replace(s, duration_s=args.duration) for s in chosen]
    if args.exact_ticks:
        chosen = [s.exact() for s in chosen]
    print(report(run_sim(chosen)))


if __name__ == "__main__":
    main()
