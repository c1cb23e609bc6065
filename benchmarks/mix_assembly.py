"""The trainer's CPU per batch of assembling mixed batches (issue 40, ``mix_splits``), in
process: no workers, no sockets, so only the client's own path is timed, and the machine's
other load moves it little (this thread's CPU time, not wall time).

Pieces as the benchmark job's workers send them (``benchmarks/mix_splits.py``: 4 dense + 4
sparse features, batch 1024, ``split_rows`` 16,384, so 16 whole pieces a split; id lists of
``--mean-length`` ids a row), each a ``Batch`` over its own arrays, as ``fetch.py`` makes
them from received frames. Every epoch feeds a rank's splits to an ``EpochAssembler`` in the
order its schedule uses them and takes every batch as the training loop does: ``add``,
``next_ready``, ``Ready.batch`` (the copy of K slices when K > 1), ``consume`` and
``take_acks`` every 8 batches. Reported: this thread's CPU per batch, median over rounds.

``--baseline DIR`` runs the same measurement with ``remoteloader`` imported from ``DIR`` (an
older tree, e.g. ``git archive <commit> remoteloader | tar -x -C DIR``) in a subprocess,
alternating with this tree round by round, so both see the same machine: the ratio is the
figure to read.

Run: ``python -m benchmarks.mix_assembly [--baseline DIR] [--rounds 5]`` (~1 minute).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

import numpy as np

BATCH, SPLIT_ROWS, DENSE, SPARSE = 1024, 16384, 4, 4
MIXES = (1, 2, 4, 8)


def make_pieces(splits: int, mean_length: float, seed: int = 0) -> dict:
    """``{split id: [Batch of each piece]}``: every piece its own arrays (as received)."""
    from remoteloader.client.batch import Batch

    rng = np.random.default_rng(seed)
    out = {}
    for sid in range(splits):
        pieces = []
        for _ in range(SPLIT_ROWS // BATCH):
            lengths = rng.poisson(mean_length, SPARSE * BATCH).astype(np.int32)
            arrays = {"dense": rng.random((BATCH, DENSE), dtype=np.float32),
                      "labels": rng.random(BATCH, dtype=np.float32),
                      "sparse.lengths": lengths,
                      "sparse.values": rng.integers(0, 1 << 40, int(lengths.sum()))}
            pieces.append(Batch.from_numpy(arrays, [f"s{i}" for i in range(SPARSE)]))
        out[sid] = pieces
    return out


def epoch(pieces: dict, mix: int) -> tuple[float, int]:
    """This thread's CPU seconds for one epoch of the rank's splits, and its batches."""
    from remoteloader.client.assembly import EpochAssembler
    from remoteloader.core.schedule import lane_schedule

    splits = [(sid, SPLIT_ROWS) for sid in pieces]
    order = lane_schedule(splits, BATCH, mix) if mix > 1 else [(sid, p) for sid, _ in splits
                                                                for p in range(SPLIT_ROWS // BATCH)]
    start = time.thread_time()
    assembler = EpochAssembler(splits, BATCH, drop_last=False, mix_splits=mix)
    batches = rows = 0
    for sid, p in order:
        if assembler.wants(sid, p):
            assembler.add(sid, p, pieces[sid][p])
        while (ready := assembler.next_ready()) is not None:
            rows += len(ready.batch)
            assembler.consume(ready)
            batches += 1
            if batches % 8 == 0:
                assembler.take_acks()
    assert assembler.exhausted and batches == len(order) and rows == len(splits) * SPLIT_ROWS
    return time.thread_time() - start, batches


def measure(splits: int, mean_length: float, rounds: int, profile: int = 0) -> dict[int, float]:
    """Median CPU microseconds per batch for each K, over ``rounds`` (K order rotated)."""
    pieces = make_pieces(splits, mean_length)
    for mix in MIXES:
        epoch(pieces, mix)  # warm-up: numba's kernels, the allocator
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        epoch(pieces, profile)
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(18)
    per: dict[int, list[float]] = {m: [] for m in MIXES}
    for r in range(rounds):
        for mix in MIXES[r % len(MIXES):] + MIXES[:r % len(MIXES)]:
            cpu, batches = epoch(pieces, mix)
            per[mix].append(cpu * 1e6 / batches)
    return {m: statistics.median(v) for m, v in per.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--splits", type=int, default=32,
                   help="splits of one rank's epoch (16 pieces each), a multiple of 8: each lane whole splits")
    p.add_argument("--mean-length", type=float, default=12.0, help="mean ids a row of each sparse feature")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline", help="a tree holding an older remoteloader/ to compare with")
    p.add_argument("--profile", type=int, default=0, metavar="K", help="print a cProfile of one epoch at this K")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a subprocess's answer
    args = p.parse_args()
    if args.splits < 1 or args.splits % max(MIXES):
        p.error(f"--splits {args.splits}: a positive multiple of {max(MIXES)} (each of K lanes holds whole splits)")
    if args.json:
        print(json.dumps(measure(args.splits, args.mean_length, 1, args.profile)))
        return
    trees = {"this tree": os.getcwd()}
    if args.baseline:
        trees = {"baseline": os.path.abspath(args.baseline), **trees}
    results: dict[str, dict[int, list[float]]] = {name: {m: [] for m in MIXES} for name in trees}
    for r in range(args.rounds):
        for name, root in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
            # Run from the tree's root: ``-m`` puts the working directory first on the path.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.getcwd()])}
            out = subprocess.run([sys.executable, "-m", "benchmarks.mix_assembly", "--json", "--splits",
                                  str(args.splits), "--mean-length", str(args.mean_length),
                                  "--profile", str(args.profile if r == 0 else 0)],
                                 env=env, cwd=root, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"the {name} run failed:\n{out.stderr}")
            if out.stderr.strip() and r == 0:
                print(f"--- {name}\n{out.stderr}", file=sys.stderr)
            for m, us in json.loads(out.stdout).items():
                results[name][int(m)].append(us)
    print(f"trainer CPU a batch (us, this thread, median of {args.rounds} rounds), {args.splits} splits, "
          f"mean length {args.mean_length:g}")
    print("| K | " + " | ".join(trees) + (" | this / baseline |" if args.baseline else " |"))
    for m in MIXES:
        meds = [statistics.median(results[name][m]) for name in trees]
        row = f"| {m} | " + " | ".join(f"{v:.0f}" for v in meds)
        if args.baseline:
            row += f" | {meds[1] / meds[0]:.2f}"
        print(row + " |")


if __name__ == "__main__":
    main()
