"""What mixing tables by weight costs (issue 40 item 2): rows/s of whole epochs for one trainer
rank consuming flat out, a 3:1 mix of two tables (``tables``, both ``when_done: drop``) against
one table of the same total size (the same files, linked under one path), side by side in one
run, interleaved (each round runs both, in an order that alternates) so that the machine's
noise hits them alike; and the realised mix: how many rows of each table every full batch
holds (the plan says 768 and 256 of 1,024). Read the ratio, not the absolute numbers.

Every run is real processes on 127.0.0.1, as in ``benchmarks/mix_splits.py`` (whose cluster
this reuses): a fresh ``remoteloader-master --workers 0`` and ``--workers`` standalone
``remoteloader-worker``; the trainer is this process. The job: 4 dense + 4 sparse, batch 1024,
``split_rows`` 16,384 (stripes of that many rows), ``shuffle: true``. Table a holds 3/4 of
the rows, table b 1/4, so both run out with the epoch's last batch; the single table is a's
and b's files together. One warm-up epoch, in which each full batch's rows of each table are
counted (from the plan's lane of each piece it took rows of), then ``--epochs`` measured epochs.

Run: ``.venv/bin/python -m benchmarks.mix_tables [--quick]`` (defaults: 2M rows, 3 rounds of 2
measured epochs, 2 workers: about 4 minutes on 2 cores; ``--quick``: 400k rows, 2 rounds of
1 epoch, a smoke test).
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.auth_cost import job_spec, run_directory
from benchmarks.mix_splits import BATCH, Case, Timed, cpu_s, recorded_epoch
from benchmarks.order import SPLIT_ROWS, cluster, consume_epoch, make_table, round_options
from remoteloader import RemoteDataLoader
from remoteloader.client import assembly

CASES = ("one table", "3:1 mix")


def tables(root: Path, rows: int) -> tuple[Path, Path, Path]:
    """Tables a (3/4 of ``rows``) and b (1/4), and the single table holding both's files."""
    a = make_table(root / "a", rows * 3 // 4, 3, SPLIT_ROWS)
    b = make_table(root / "b", rows // 4, 1, SPLIT_ROWS)
    one = root / "one"
    for name, table in (("a", a), ("b", b)):
        for part in sorted(table.iterdir()):
            target = one / f"{part.name}-{name}"
            target.mkdir(parents=True)
            for f in part.iterdir():
                os.link(f, target / f.name)
    return a, b, one


def case_spec(case: str, a: Path, b: Path, one: Path) -> dict:
    spec = job_spec(one)
    assert spec["split_rows"] == SPLIT_ROWS and spec["batch_size"] == BATCH
    spec["shuffle"] = True
    if case == "3:1 mix":
        del spec["table"]
        spec["tables"] = [{"path": str(a), "weight": 3, "when_done": "drop"},
                          {"path": str(b), "weight": 1, "when_done": "drop"}]
    return spec


@dataclass
class Result(Timed):
    shares: list[int]  # rows of table a in each full batch of the warm-up epoch (mix only)


def shares_epoch(loader: RemoteDataLoader) -> tuple[list[int], int]:
    """One epoch, counting each full batch's rows of table 0 (from each piece's lane)."""
    shares: list[int] = []

    def record(plan: dict, ready: assembly.Ready) -> None:
        shares.append(sum(stop - start for (_, start, stop), part in zip(ready.pieces, ready.parts)
                          if plan[part.split_id].lane[0] == 0))

    return shares, recorded_epoch(loader, record)


def run_once(spec: dict, root: Path, workers: int, epochs: int, mixed: bool) -> Result:
    with cluster(root, workers) as (addr, _):
        with RemoteDataLoader(spec, master=addr, timeout=120) as loader:
            shares: list[int] = []
            if mixed:  # the warm-up epoch, recording the mix
                shares = shares_epoch(loader)[0]
            else:
                consume_epoch(loader)
            rows, start, cpu = 0, time.perf_counter(), cpu_s()
            for _ in range(epochs):
                rows += consume_epoch(loader)
            return Result(rows, time.perf_counter() - start, cpu_s() - cpu, shares)


def report(cases: dict[str, Case], args: argparse.Namespace, elapsed: float) -> None:
    print(f"{args.rows:,} rows (a: {args.rows * 3 // 4:,}, b: {args.rows // 4:,}; the single table: both's files), "
          f"4 dense + 4 sparse, ORC, batch {BATCH}, split_rows {SPLIT_ROWS:,}, shuffle; {args.workers} standalone "
          f"workers + master + 1 trainer rank on 127.0.0.1, {os.cpu_count()} cores; {args.rounds} interleaved "
          f"rounds x {args.epochs} measured epochs (+1 warm-up) per case; {elapsed:.0f} s")
    print("rows/s: median over rounds; ratio: median of each round's mix / one table")
    print()
    print("| case | rows/s | ratio | per-round ratios | trainer CPU a batch | rows of a in a full batch (min / median / max) "
          "| full batches off 768:256 |")
    print("|---|---:|---:|---|---:|---|---:|")
    base = cases["one table"]
    for name, c in cases.items():
        per_round = [r.rows_s / b.rows_s for r, b in zip(c.results, base.results)]
        shares = [n for r in c.results for n in r.shares]
        mix = f"{min(shares)} / {statistics.median(shares):g} / {max(shares)} | {sum(n != 768 for n in shares)} of " \
              f"{len(shares)}" if shares else "- | -"
        print(f"| {name} | {c.rows_s:,.0f} | {statistics.median(per_round):.2f} | "
              f"{', '.join(f'{x:.2f}' for x in per_round)} | {c.cpu_us_per_batch:.0f} us | {mix} |")


def main() -> None:
    p = round_options(__doc__, rows=2_000_000)
    p.add_argument("--quick", action="store_true", help="400k rows, 2 rounds of 1 measured epoch")
    args = p.parse_args()
    if args.quick:
        args.rows, args.rounds, args.epochs = 400_000, 2, 1
    args.rows -= args.rows % 4
    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the finally blocks stop the children
    start = time.perf_counter()
    with run_directory("rl-mixtables-") as tmp:
        a, b, one = tables(tmp, args.rows)
        expected = (args.rows * 3 // 4 // 3 * 3 + args.rows // 4) * args.epochs
        cases = {name: Case() for name in CASES}
        for i in range(args.rounds):
            for name in (CASES if i % 2 == 0 else CASES[::-1]):
                r = run_once(case_spec(name, a, b, one), tmp, args.workers, args.epochs, name != "one table")
                if r.rows != expected:
                    raise AssertionError(f"{name}: {r.rows} rows delivered, expected {expected}")
                if name != "one table" and any(n != 768 for n in r.shares):
                    raise AssertionError(f"{name}: a full batch holds {sorted(set(r.shares))} rows of table a, not 768")
                cases[name].results.append(r)
                print(f"# round {i + 1} {name}: {r.rows_s:>9,.0f} rows/s ({r.seconds:.2f} s)", file=sys.stderr,
                      flush=True)
    report(cases, args, time.perf_counter() - start)


if __name__ == "__main__":
    main()
