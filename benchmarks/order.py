"""The price of deterministic batch order (issue 28, "Cost"): rows/s of whole epochs for one
trainer rank consuming flat out, with batches in arrival order (no ``order`` key) against
deterministic order (``order: {deterministic: true, cycle: 4}``), (a) with no fault and (b)
with one worker at half speed; side by side in one run, interleaved (every round runs the
four cases, the order of the two modes alternating ABAB / BABA from round to round) so that
the machine's noise hits both modes alike. Read the ratios, not the absolute numbers.

Every run is real processes on 127.0.0.1: a fresh ``remoteloader-master --workers 0`` (one
master serves one job spec, and the two modes are two specs) and ``--workers`` standalone
``remoteloader-worker --master ADDR``; the trainer is this process,
``RemoteDataLoader(spec, master=addr)``. One warm-up epoch (workers connect, the credit
window grows), then ``--epochs`` measured epochs, timed as a whole.

The table is ``generate_table`` (4 dense + 4 sparse, ORC, 2 partitions) written with stripes
of ``split_rows`` rows (16,384: 16 pieces of 1,024 rows a split), so that splits are the size
the spec plans and the worker's deterministic-order share (``cycle`` x pieces of
``split_rows``) fits them. Writing exact stripes runs at ~1M rows a minute here, so
``--rows / --copies`` rows are generated and hard-linked ``--copies`` times under other
partition names (what a row holds does not matter to throughput). With the writer's default
64 MB stripes (~170k-row splits, far above ``split_rows``) deterministic order hangs; see
RESULTS.md. ``--stripe-rows 0`` keeps the default stripes, to show it.

The slow worker: before the rounds, one calibration run (arrival order, every worker at full
speed, one warm-up epoch) reads each worker's ``busy_s`` and ``batches`` from
``remoteloader status --json`` before and after one more epoch; the median over workers of
busy seconds per piece is the time a worker takes to produce one piece, with the client, the
master and the other workers on the same cores as in the measured runs. One worker of every
half-speed run is started with ``--inject-batch-delay`` of that many seconds: it waits that
long before each piece, so a piece costs it twice its production time and it produces at
about half the rate of the others. (Its waits free some CPU for the others on these 2 cores,
so the ratio is a little under one half; the share of pieces it actually produced is
printed.) Busy time rather than a stopwatch on a worker: it is what the worker itself counts
as producing, excluding time blocked on its buffer or on credit.

Also reported, per case (median over rounds): the client's credit window at the end
(``loader.credit.pieces``) and how often it doubled (``loader.credit.grown``, over the whole
run), and the peak of pieces held in the client, sampled between batches: pieces waiting in
the assembler for their turn (``assembler.waiting``, deterministic order only) and those plus
the batches queued for the training loop, against the window (the issue: memory stays within
the credit window).

Targets (issue 28): deterministic >= 0.95x arrival rows/s with no fault, >= 0.90x with one
worker at half speed. Every process started here is stopped by pid, also on errors.

Run: ``.venv/bin/python -m benchmarks.order [--quick]`` (defaults: 4M rows, epochs of about 4
s, 3 rounds of 2 measured epochs, 2 workers: about 4-5 minutes on 2 cores, each run paying ~2 s
to start and stop its processes and a warm-up epoch; ``--quick``: 600k rows, 2 rounds of 1
epoch, about a minute, a smoke test whose sub-second epochs make noisy ratios).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from benchmarks.auth_cost import job_spec, reap, run_directory, tcp_master
from remoteloader import RemoteDataLoader
from remoteloader.tools.datagen import generate_table

BIN = Path(sys.executable).parent
MODES = ("arrival", "deterministic")
SCENARIOS = ("no fault", "one worker at half speed")
TARGETS = {"no fault": 0.95, "one worker at half speed": 0.90}
CYCLE = 4
SPLIT_ROWS = 16384


@dataclass
class Result:
    """One measured run: rows/s over the measured epochs and what the client held."""

    rows: int
    seconds: float
    window: int  # credit window at the end, pieces
    grown: int  # times it doubled, over the whole run (warm-up included)
    peak_waiting: int  # most pieces waiting in the assembler for their turn
    peak_held: int  # most pieces waiting + batches queued for the training loop
    over_window: int  # most pieces held beyond the window at that moment (0: always within)
    piece_mb: float  # mean piece size, MB
    slow_share: Optional[float] = None  # share of the measured pieces the slowed worker produced

    @property
    def rows_s(self) -> float:
        return self.rows / self.seconds


@dataclass
class Peaks:
    waiting: int = 0
    held: int = 0
    over: int = 0

    def sample(self, loader: RemoteDataLoader) -> None:
        run = loader._current
        if run is None:
            return
        waiting, held = run.assembler.waiting, run.assembler.waiting + run.assembler.ready_count
        self.waiting, self.held = max(self.waiting, waiting), max(self.held, held)
        self.over = max(self.over, held - loader.credit.pieces)


def make_table(root: Path, rows: int, copies: int, stripe_rows: int) -> Path:
    """``rows`` rows: ``rows // copies`` generated (2 partitions), then hard-linked ``copies``
    times under other partition names, since writing exact stripes is slow (~1M rows a minute
    here) and what a row holds does not matter to throughput."""
    gen = root / "gen"
    generate_table(str(gen), rows=rows // copies, partitions=2, dense=4, sparse=4, format="orc", seed=4,
                   progress=False, stripe_rows=stripe_rows or None)
    table = root / "t"
    for c in range(copies):
        for part in sorted(gen.iterdir()):
            day = part.name.split("-")[-1]
            target = table / f"ds=2026-{c + 1:02d}-{day}"
            target.mkdir(parents=True)
            for f in part.iterdir():
                os.link(f, target / f.name)
    return table


def order_spec(table: Path, mode: str) -> dict:
    """``auth_cost``'s job (4 dense + 4 sparse, batch 1024, split_rows 16384), with ``order`` in
    deterministic mode."""
    spec = job_spec(table)
    assert spec["split_rows"] == SPLIT_ROWS
    if mode == "deterministic":
        spec["order"] = {"deterministic": True, "cycle": CYCLE}
    return spec


def start_worker(addr: str, delay: float) -> subprocess.Popen:
    extra = ["--inject-batch-delay", f"{delay:.6f}"] if delay else []
    return subprocess.Popen([str(BIN / "remoteloader-worker"), "--master", addr, "--die-with-parent",
                             "--drain-timeout", "2", *extra])


@contextlib.contextmanager
def cluster(table: Path, workers: int, slow_delay: float = 0.0) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """A master with no workers of its own and ``workers`` standalone workers, the first slowed
    by ``slow_delay`` seconds a piece; the workers are stopped (by pid) before the master."""
    with tcp_master(table, None, 0) as addr:
        procs: list[subprocess.Popen] = []
        try:
            for i in range(workers):
                procs.append(start_worker(addr, slow_delay if i == 0 else 0.0))
            yield addr, procs
        finally:
            reap([p.pid for p in procs])


def worker_stats(addr: str) -> dict[int, dict]:
    """``remoteloader status --json``'s workers, by pid."""
    out = subprocess.run([str(BIN / "remoteloader"), "status", "--master", addr, "--json"],
                         capture_output=True, text=True, check=True, timeout=30)
    return {w["pid"]: w for w in json.loads(out.stdout)["workers"]}


def fresh_worker_stats(addr: str, pids: list[int]) -> dict[int, dict]:
    """Worker stats once every worker has heartbeated after this call (stats come with heartbeats)."""
    time.sleep(1.2)  # a heartbeat every 0.5 s: what the master reports is then newer than the epoch's end
    stats = worker_stats(addr)
    missing = [p for p in pids if p not in stats]
    if missing:
        raise RuntimeError(f"workers {missing} are not registered with the master")
    return stats


def consume_epoch(loader: RemoteDataLoader, peaks: Optional[Peaks] = None) -> int:
    rows = 0
    for b in loader:
        rows += len(b)
        if peaks is not None:
            peaks.sample(loader)
    return rows


def calibrate(table: Path, workers: int) -> float:
    """Seconds a worker is busy per piece, flat out in arrival order (median over workers)."""
    with cluster(table, workers) as (addr, procs):
        pids = [p.pid for p in procs]
        with RemoteDataLoader(order_spec(table, "arrival"), master=addr, timeout=120) as loader:
            consume_epoch(loader)
            before = fresh_worker_stats(addr, pids)
            consume_epoch(loader)
            after = fresh_worker_stats(addr, pids)
    per_piece = [(after[p]["busy_s"] - before[p]["busy_s"]) / max(1, after[p]["batches"] - before[p]["batches"])
                 for p in pids]
    print(f"# calibration: busy seconds per piece by worker: {', '.join(f'{t * 1e3:.2f} ms' for t in per_piece)}",
          file=sys.stderr, flush=True)
    return statistics.median(per_piece)


def run_once(table: Path, mode: str, workers: int, epochs: int, slow_delay: float) -> Result:
    """A fresh cluster, one warm-up epoch, ``epochs`` measured."""
    with cluster(table, workers, slow_delay) as (addr, procs):
        pids = [p.pid for p in procs]
        with RemoteDataLoader(order_spec(table, mode), master=addr, timeout=120) as loader:
            consume_epoch(loader)  # warm-up: workers register and start, the credit window grows
            peaks, rows, start = Peaks(), 0, time.perf_counter()
            for _ in range(epochs):
                rows += consume_epoch(loader, peaks)
            seconds = time.perf_counter() - start
            credit = loader.credit
            result = Result(rows, seconds, credit.pieces, credit.grown, peaks.waiting, peaks.held, peaks.over,
                            credit.piece_bytes / 1e6)
        if slow_delay:
            result.slow_share = slow_share(fresh_worker_stats(addr, pids), pids)
    return result


def slow_share(stats: dict[int, dict], pids: list[int]) -> float:
    """The first worker's share of the pieces produced over the whole run (warm-up and the
    next epoch's read-ahead included: reading the master between epochs would pause the trainer)."""
    made = {p: stats[p]["batches"] for p in pids}
    return made[pids[0]] / max(1, sum(made.values()))


@dataclass
class Case:
    scenario: str
    mode: str
    results: list[Result] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.results)


def rounds(table: Path, args: argparse.Namespace, delay: float, expected_rows: int) -> dict[tuple[str, str], Case]:
    cases = {(s, m): Case(s, m) for s in SCENARIOS for m in MODES}
    for i in range(args.rounds):
        for scenario in SCENARIOS:
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                r = run_once(table, mode, args.workers, args.epochs, delay if scenario != "no fault" else 0.0)
                if r.rows != expected_rows:
                    raise AssertionError(f"{scenario}, {mode}: {r.rows} rows delivered, expected {expected_rows}")
                cases[scenario, mode].results.append(r)
                share = "" if r.slow_share is None else f", slow worker made {r.slow_share:.0%} of the pieces"
                print(f"# round {i + 1} {scenario:>24} {mode:>13}: {r.rows_s:>9,.0f} rows/s ({r.seconds:.2f} s), "
                      f"window {r.window} (grown {r.grown}x), peak waiting {r.peak_waiting}, "
                      f"peak held {r.peak_held}{share}", file=sys.stderr, flush=True)
    return cases


def ratios(cases: dict[tuple[str, str], Case], scenario: str) -> list[float]:
    """Each round's deterministic / arrival rows/s (the two ran next to each other)."""
    a, d = cases[scenario, "arrival"].results, cases[scenario, "deterministic"].results
    return [y.rows_s / x.rows_s for x, y in zip(a, d)]


def report(cases: dict[tuple[str, str], Case], args: argparse.Namespace, delay: float, elapsed: float) -> bool:
    stripes = "the writer's default stripes" if not args.stripe_rows else f"stripes of {args.stripe_rows:,} rows"
    print(f"{args.rows // args.copies * args.copies:,} rows ({args.rows // args.copies:,} generated, linked "
          f"{args.copies} times; {stripes}), 4 dense + 4 sparse, ORC, batch 1024, split_rows {SPLIT_ROWS:,}, "
          f"cycle {CYCLE}; {args.workers} standalone workers + master + 1 trainer rank on 127.0.0.1, "
          f"{os.cpu_count()} cores; {args.rounds} interleaved rounds x {args.epochs} measured epochs "
          f"(+1 warm-up) per case; slow worker: --inject-batch-delay {delay * 1e3:.2f} ms a piece "
          f"(its measured busy time per piece); {elapsed:.0f} s")
    print("medians over rounds; ratio = median of each round's deterministic / arrival; held = pieces waiting "
          "in the assembler + batches queued, sampled between batches")
    print()
    print("| scenario | order | rows/s | ratio | target | credit window (pieces) | window doublings | "
          "peak waiting | peak held | held beyond window | slow worker's share |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    passed = True
    for scenario in SCENARIOS:
        ratio = statistics.median(ratios(cases, scenario))
        ok = ratio >= TARGETS[scenario]
        passed &= ok
        for mode in MODES:
            c = cases[scenario, mode]
            det = mode == "deterministic"
            cell = f"{ratio:.2f}" if det else "1.00"
            target = f">= {TARGETS[scenario]:.2f} {'PASS' if ok else 'FAIL'}" if det else ""
            share = "" if scenario == "no fault" else f"{c.median('slow_share'):.0%}"
            print(f"| {scenario} | {mode} | {c.median('rows_s'):,.0f} | {cell} | {target} | "
                  f"{c.median('window'):.0f} | {c.median('grown'):.0f} | {c.median('peak_waiting'):.0f} | "
                  f"{c.median('peak_held'):.0f} | {c.median('over_window'):.0f} | {share} |")
    print()
    for scenario in SCENARIOS:
        per_round = ", ".join(f"{x:.2f}" for x in ratios(cases, scenario))
        print(f"per-round ratios, {scenario}: {per_round}")
    piece = statistics.median(r.piece_mb for c in cases.values() for r in c.results)
    print(f"mean piece {piece:.2f} MB")
    return passed


def round_options(doc: str, rows: int) -> argparse.ArgumentParser:
    """The options every interleaved-rounds benchmark of a real cluster takes (this one,
    ``mix_splits``, ``mix_tables``): table rows, measured epochs, rounds and workers."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=rows)
    p.add_argument("--epochs", type=int, default=2, help="measured epochs per run (after one warm-up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    return p


def main() -> None:
    p = round_options(__doc__, rows=4_000_000)
    p.add_argument("--stripe-rows", type=int, default=SPLIT_ROWS,
                   help="rows per ORC stripe (0: the writer's default 64 MB stripes)")
    p.add_argument("--copies", type=int, default=4, help="the table is --rows / --copies generated rows, linked "
                                                         "this many times (generating exact stripes is slow)")
    p.add_argument("--quick", action="store_true", help="600k rows, 2 rounds of 1 measured epoch (about a minute)")
    args = p.parse_args()
    if args.quick:
        args.rows, args.copies, args.rounds, args.epochs = 600_000, 2, 2, 1
    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    # SIGTERM (a timeout, a kill by pid) unwinds like Ctrl-C, so the finally blocks stop the children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.perf_counter()
    with run_directory("rl-order-") as tmp:
        table = make_table(tmp, args.rows, args.copies, args.stripe_rows)
        delay = calibrate(table, args.workers)
        cases = rounds(table, args, delay, args.rows // args.copies * args.copies * args.epochs)
    passed = report(cases, args, delay, time.perf_counter() - start)
    print("PASS" if passed else "FAIL")


if __name__ == "__main__":
    main()
