"""Split choice at scale: the master's state under many workers, ranks and splits.

In-process, no sockets: the cost of ``JobState`` itself when 1,000 workers share 256
ranks whose epoch has 100 splits each. Every worker asks for splits in turn until
all are handed out (``choose_split`` + ``apply(SplitAssigned)``, what ``get_split``
does), then every rank acknowledges each split whole (``apply(SplitsConsumed)``).
This tree and a baseline commit (a git worktree) run in child processes of one
invocation. Reported per tree: microseconds per ``get_split`` decision and per
acknowledged split, and the time to start the epoch on every rank.

Run: ``.venv/bin/python -m benchmarks.split_choice [--workers 1000 --ranks 256 --splits-per-rank 100]``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = {"batch_size": 64, "seed": 0, "shuffle": True, "drop_last": False, "even_batches": "pad", "on_error": "fail",
        "table": "/synthetic", "features": {"dense": ["x"]}}


def measure(workers: int, ranks: int, splits_per_rank: int) -> dict:
    """Runs in the child, against whichever ``remoteloader`` its PYTHONPATH names."""
    from remoteloader.formats import DataFile, Unit
    from remoteloader.master import updates as U
    from remoteloader.master.state import JobState

    n = ranks * splits_per_rank
    units = tuple(Unit(i, i * 640, 640, 1) for i in range(n))
    rows = [[0, i, i + 1, 640, 640, 640 * i] for i in range(n)]
    if hasattr(U, "file_record"):  # typed updates (issue 24): the spec and records as such
        from remoteloader.spec import DatasetSpec
        job = U.JobSubmitted(DatasetSpec.from_dict(SPEC), "fp", {"x": "float"},
                             [U.file_record(DataFile("f0", "orc", "", n * 640, n, units))],
                             [U.SplitRecord(*r) for r in rows], [])
    else:
        job = U.JobSubmitted(SPEC, "fp", {"x": "float"}, [DataFile("f0", "orc", "", n * 640, n, units).to_wire()],
                             rows, [])
    # From protocol 7 on, the service decides partitions (journaled) and epochs are runs of a
    # client session; the baseline tree decided partitions inside apply.
    sessions = hasattr(U, "PartitionsChanged")
    st = JobState() if sessions else JobState(max_workers_per_client=32)
    st.apply(job)
    for w in range(workers):
        st.apply(U.WorkerRegistered(f"w{w}", "tcp://127.0.0.1:1", w, 0.0))
    for r in range(ranks):
        st.apply(U.ClientJoined(f"c{r}", r, ranks, 0.0))
    if sessions:
        st.apply(U.PartitionsChanged(sorted([r, m] for r, m in st.balanced_partitions(32).items())))
    t = time.perf_counter()
    for r in range(ranks):
        st.apply(U.EpochStarted(r, 0, f"c{r}", 0) if sessions else U.EpochStarted(r, 0))
    start_s = time.perf_counter() - t

    decisions, t = 0, time.perf_counter()
    assigned: list[tuple[int, int, int]] = []
    idle = 0
    while idle < workers:  # round robin over workers until none gets a split
        idle = 0
        for w in range(workers):
            chosen = st.choose_split(f"w{w}")
            decisions += 1
            if chosen is None:
                idle += 1
                continue
            run, progress = chosen
            st.apply(U.SplitAssigned(run.epoch if sessions else run, progress.split.id, f"w{w}", 0.0))
            assigned.append((progress.split.rank, progress.split.id, progress.pieces))
    choose_s = time.perf_counter() - t

    t = time.perf_counter()
    for rank, split_id, pieces in assigned:
        st.apply(U.SplitsConsumed(rank, 0, [[split_id, pieces]]))
    ack_s = time.perf_counter() - t
    assert all(p.done for re in st.ranks.values() for p in re.splits.values()), "an epoch split was left undone"
    return {"splits": len(assigned), "decisions": decisions, "start_ms": start_s * 1e3,
            "choose_us": choose_s / decisions * 1e6, "ack_us": ack_s / len(assigned) * 1e6}


def run_tree(src: Path, args: argparse.Namespace) -> dict:
    """``measure`` in a child whose only ``remoteloader`` is the one under ``src``."""
    from benchmarks.control_plane import run_in_tree  # here: the child imports this file from another tree

    return run_in_tree(src, __file__, f"mod.measure({args.workers}, {args.ranks}, {args.splits_per_rank})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--splits-per-rank", type=int, default=100)
    p.add_argument("--baseline", default="7c0b009", help="git ref to compare with (full scans in split choice)")
    args = p.parse_args()
    from benchmarks.control_plane import baseline_tree
    with baseline_tree(args.baseline) as base:
        results = {"baseline " + args.baseline: run_tree(base, args), "this tree": run_tree(ROOT, args)}
    print(f"{args.workers} workers, {args.ranks} ranks, {args.splits_per_rank} splits per rank\n")
    print(f"{'tree':<18} {'get_split us':>12} {'ack us':>8} {'start all ranks ms':>18} {'decisions':>10}")
    for name, r in results.items():
        print(f"{name:<18} {r['choose_us']:>12.1f} {r['ack_us']:>8.1f} {r['start_ms']:>18.1f} {r['decisions']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
