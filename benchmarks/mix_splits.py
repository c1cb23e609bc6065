"""What batches that mix splits cost (issue 40 item 0): rows/s of whole epochs for one trainer
rank consuming flat out with ``mix_splits`` K = 1, 2, 4 and 8, side by side in one run,
interleaved (every round runs the four, in an order rotated from round to round) so that the
machine's noise hits them alike; and the mixing itself: how many distinct splits and distinct
partitions each full batch holds. Read the ratios, not the absolute numbers.

Every run is real processes on 127.0.0.1, as in ``benchmarks/order.py`` (whose table and
cluster this reuses): a fresh ``remoteloader-master --workers 0`` (one master serves one job
spec, and each K is another spec) and ``--workers`` standalone ``remoteloader-worker``; the
trainer is this process. The job: 4 dense + 4 sparse, batch 1024, ``split_rows`` 16,384
(stripes of that many rows: 16 pieces a split), ``shuffle: true``. One warm-up epoch, in
which each full batch's splits (the epoch splits its rows came from, as the assembler built
it) are mapped to base splits and their files' partitions, then ``--epochs`` measured epochs.

Also reported: the trainer process's CPU per batch over the measured epochs (every thread of
this process: receiving, assembling, the copies), since with K > 1 every batch is a copy of K
slices where K = 1 hands most pieces out whole.

``--staged``: the trainer takes batches as a GPU trainer does, ``pin_memory=True``: every
batch is built once, off the training thread, into a reused staging slab (``client/staging.py``)
-- a whole piece copied as it is (K = 1), the rows of K pieces merged (K > 1): one copy either
way. This host has no accelerator, so the slabs are plain memory (the pinning primitive
``staging.alloc_pinned`` replaced, as tests/test_pinning.py does) and nothing goes to a device;
page-locking and the device copy would cost K = 1 and K > 1 alike. Without it (the default) the
training loop reads nothing of a batch but its length, so K = 1's whole pieces cost it nothing
and only K > 1 copies.

Target (issue 40): rows/s with K = 8 (and 2, 4) >= 0.9x of K = 1. Every process started here
is stopped by pid, also on errors.

Run: ``.venv/bin/python -m benchmarks.mix_splits [--quick] [--staged]`` (defaults: 4M rows, 3 rounds of 2
measured epochs, 2 workers: about 5 minutes on 2 cores; ``--quick``: 600k rows, 2 rounds of
1 epoch, a smoke test).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from benchmarks.auth_cost import job_spec, run_directory
from benchmarks.order import SPLIT_ROWS, cluster, consume_epoch, make_table, round_options
from remoteloader import RemoteDataLoader
from remoteloader.client import assembly, staging
from remoteloader.core.binding import bind
from remoteloader.core.plan import plan_base_splits
from remoteloader.spec import DatasetSpec

MIXES = (1, 2, 4, 8)
TARGET = 0.90
BATCH = 1024


def mix_spec(table: Path, mix: int) -> dict:
    spec = job_spec(table)
    assert spec["split_rows"] == SPLIT_ROWS and spec["batch_size"] == BATCH
    spec["shuffle"] = True
    if mix > 1:
        spec["mix_splits"] = mix
    return spec


@dataclass
class Timed:
    """One run's measured epochs: rows, seconds and this process's CPU (every thread)."""
    rows: int
    seconds: float
    client_cpu_s: float

    @property
    def rows_s(self) -> float:
        return self.rows / self.seconds

    @property
    def cpu_us_per_batch(self) -> float:
        return self.client_cpu_s * 1e6 / (self.rows / BATCH)


@dataclass
class Result(Timed):
    splits: list[int]  # distinct base splits of each full batch of the warm-up epoch
    partitions: list[int]  # distinct partitions of each


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def recorded_epoch(loader: RemoteDataLoader, record: Callable[[dict, assembly.Ready], None]) -> int:
    """One epoch (its rows), calling ``record(the run's plan splits, batch)`` on each full batch
    as the assembler builds it (its record of which pieces the batch took rows of)."""
    consume = assembly.EpochAssembler.consume

    def recording(self: assembly.EpochAssembler, ready: assembly.Ready) -> None:
        if len(ready) == BATCH:
            record(loader.position.run.plan.splits, ready)
        consume(self, ready)

    assembly.EpochAssembler.consume = recording
    try:
        return consume_epoch(loader)
    finally:
        assembly.EpochAssembler.consume = consume


def mixing_epoch(loader: RemoteDataLoader, partition_of: list[str]) -> tuple[list[int], list[int], int]:
    """One epoch, recording each full batch's base splits and their partitions."""
    splits: list[int] = []
    partitions: list[int] = []

    def record(plan: dict, ready: assembly.Ready) -> None:
        bases = {plan[part.split_id].base for part in ready.parts}
        splits.append(len(bases))
        partitions.append(len({partition_of[b] for b in bases}))

    rows = recorded_epoch(loader, record)
    return splits, partitions, rows


@contextlib.contextmanager
def staging_without_accelerator():
    """The loader's pinned staging path on a host without CUDA: slabs of plain memory."""
    alloc, available = staging.alloc_pinned, torch.cuda.is_available
    staging.alloc_pinned = lambda nbytes: torch.empty(nbytes, dtype=torch.uint8)
    torch.cuda.is_available = lambda: True
    try:
        yield
    finally:
        staging.alloc_pinned, torch.cuda.is_available = alloc, available


def run_once(table: Path, mix: int, workers: int, epochs: int, partition_of: list[str], staged: bool) -> Result:
    with cluster(table, workers) as (addr, _), \
            (staging_without_accelerator() if staged else contextlib.nullcontext()):
        with RemoteDataLoader(mix_spec(table, mix), master=addr, timeout=120, pin_memory=staged) as loader:
            assert loader.pin_pool is not None or not staged
            splits, partitions, _ = mixing_epoch(loader, partition_of)  # also the warm-up
            rows, start, cpu = 0, time.perf_counter(), cpu_s()
            for _ in range(epochs):
                rows += consume_epoch(loader)
            return Result(rows, time.perf_counter() - start, cpu_s() - cpu, splits, partitions)


@dataclass
class Case:
    """One case's runs, a run a round: its medians over the rounds."""
    results: list[Timed] = field(default_factory=list)

    @property
    def rows_s(self) -> float:
        return statistics.median(r.rows_s for r in self.results)

    @property
    def cpu_us_per_batch(self) -> float:
        return statistics.median(r.cpu_us_per_batch for r in self.results)


def report(cases: dict[int, Case], args: argparse.Namespace, elapsed: float) -> bool:
    print(f"{args.rows // args.copies * args.copies:,} rows ({args.rows // args.copies:,} generated, linked "
          f"{args.copies} times: {2 * args.copies} partitions; stripes of {SPLIT_ROWS:,} rows), 4 dense + 4 sparse, "
          f"ORC, batch {BATCH}, split_rows {SPLIT_ROWS:,}, shuffle; {args.workers} standalone workers + master + "
          f"1 trainer rank on 127.0.0.1, {os.cpu_count()} cores; {args.rounds} interleaved rounds x {args.epochs} "
          f"measured epochs (+1 warm-up) per K; {elapsed:.0f} s"
          + ("; staged as for a GPU trainer (pin_memory=True, plain-memory slabs)" if args.staged else ""))
    print("rows/s: median over rounds; ratio: median of each round's K / K = 1; splits and partitions: per full "
          "batch of the warm-up epochs (min / median / max)")
    print()
    print("| mix_splits | rows/s | ratio | target | per-round ratios | trainer CPU a batch | distinct splits a batch | "
          "distinct partitions a batch |")
    print("|---:|---:|---:|---:|---|---:|---|---|")
    passed = True
    for mix, c in cases.items():
        per_round = [r.rows_s / b.rows_s for r, b in zip(c.results, cases[1].results)]
        ratio = statistics.median(per_round)
        ok = mix == 1 or ratio >= TARGET
        passed &= ok
        splits = [n for r in c.results for n in r.splits]
        parts = [n for r in c.results for n in r.partitions]
        target = "" if mix == 1 else f">= {TARGET:.2f} {'PASS' if ok else 'FAIL'}"

        def spread(xs: list[int]) -> str:
            return f"{min(xs)} / {statistics.median(xs):g} / {max(xs)}"
        print(f"| {mix} | {c.rows_s:,.0f} | {ratio:.2f} | {target} | {', '.join(f'{x:.2f}' for x in per_round)} | "
              f"{c.cpu_us_per_batch:.0f} us | {spread(splits)} | {spread(parts)} |")
    return passed


def main() -> None:
    p = round_options(__doc__, rows=4_000_000)
    p.add_argument("--copies", type=int, default=4, help="the table is --rows / --copies generated rows, linked "
                                                         "this many times under other partitions")
    p.add_argument("--quick", action="store_true", help="600k rows, 2 rounds of 1 measured epoch")
    p.add_argument("--staged", action="store_true", help="batches staged as for a GPU trainer (pin_memory=True, "
                                                         "plain-memory slabs here): one copy a batch at every K")
    args = p.parse_args()
    if args.quick:
        args.rows, args.copies, args.rounds, args.epochs = 600_000, 2, 2, 1
    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the finally blocks stop the children
    start = time.perf_counter()
    with run_directory("rl-mix-") as tmp:
        table = make_table(tmp, args.rows, args.copies, SPLIT_ROWS)
        spec = DatasetSpec.from_dict(mix_spec(table, 1))
        files = bind(spec).files
        partition_of = [files[s.file].partition for s in plan_base_splits(files, spec.split_rows)]
        expected = args.rows // args.copies * args.copies * args.epochs
        cases = {mix: Case() for mix in MIXES}
        for i in range(args.rounds):
            for mix in MIXES[i % len(MIXES):] + MIXES[:i % len(MIXES)]:
                r = run_once(table, mix, args.workers, args.epochs, partition_of, args.staged)
                if r.rows != expected:
                    raise AssertionError(f"mix_splits {mix}: {r.rows} rows delivered, expected {expected}")
                cases[mix].results.append(r)
                print(f"# round {i + 1} mix_splits {mix}: {r.rows_s:>9,.0f} rows/s ({r.seconds:.2f} s), trainer CPU "
                      f"{r.cpu_us_per_batch:.0f} us a batch, splits a "
                      f"batch {statistics.median(r.splits):g}, partitions {statistics.median(r.partitions):g}",
                      file=sys.stderr, flush=True)
    passed = report(cases, args, time.perf_counter() - start)
    print("PASS" if passed else "FAIL")


if __name__ == "__main__":
    main()
