"""Encode and decode cost of typed messages (protocol 9) against the hand-checked maps of
protocol 8, side by side in one process.

The baseline is ``remoteloader/protocol/wire.py`` of a commit (``--baseline``, default
HEAD), loaded from ``git show`` as a module of its own. Each message is what a peer
really sends, built and encoded as the sender does (the typed side constructs its Struct,
the baseline passes fields) and decoded as the receiver does (the typed side with the one
decoder, the baseline with ``decode``'s map checks):

* ``heartbeat``: a worker's, with its full stats;
* ``credit``: the client's grant;
* ``batch``: the header of a run of 4 pieces with 6 tensors (frames not counted);
* ``split``: a ``get_split`` answer for a file of 2,000 stripes, whose split covers 4.
  Protocol 8 carries every unit of the file (8,000 integers), protocol 9 the split's;
  ``split (same units)`` gives protocol 8 only the split's units too, to separate what
  the types cost from what the smaller message saves.

Run: ``.venv/bin/python -m benchmarks.wire_cost [--baseline REV] [--n 100000]``.
Reported: microseconds per encode and per decode, and their ratio (typed / baseline).
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from remoteloader.protocol import messages as M
from remoteloader.protocol import wire

ROOT = Path(__file__).resolve().parent.parent
STATS = {"rows": 123456, "batches": 2000, "splits": 40, "busy_s": 12.5, "cpu": 0.75, "mem": 1.5e9, "time": 1.7e9,
         "capacity": 64, "ahead": 3, "split": [2, 17, 9],
         "io": {"requests": 900, "bytes_requested": 1 << 30, "bytes_needed": 1 << 29, "splits": 40},
         "discarded": {"stale_run": 2, "silent": 1}}
TENSORS = [["dense", "float32", [1024, 13]], ["labels", "float32", [1024]], ["sparse.values", "int64", [26624]],
           ["sparse.lengths", "int32", [26624]], ["weights", "float32", [1024]], ["pt.row_id", "int64", [1024]]]
UNITS = [[i, i * 640, 640, 64 << 10] for i in range(2000)]


def baseline_wire(rev: str) -> Any:
    """``wire.py`` of ``rev`` as a module of its own (it imports nothing of the package)."""
    source = subprocess.run(["git", "show", f"{rev}:remoteloader/protocol/wire.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_wire.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_wire", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def task(units: list) -> dict:
    return {"epoch": 1, "split_id": 517, "rank": 3, "base": 200, "first_unit": 800, "stop_unit": 804,
            "raw_rows": 2560, "position": 512000, "base_rows": 2560, "row_lo": 0, "row_hi": 2560, "skip": 0,
            "session": "s-0123456789ab", "seq": 4, "fingerprint": "f" * 16,
            "file": {"path": "/data/table/part-00017.orc", "format": "orc", "partition": "ds=2026-01-01",
                     "num_rows": 1280000, "nbytes": 2000 * (64 << 10), "units": units}}


def cases(old: Any) -> dict[str, tuple[Callable[[], list], Callable[[], list]]]:
    """name -> (baseline encode, typed encode), each building the message as its sender does."""
    token = "ab" * 32
    stats = M.WorkerStats(rows=123456, batches=2000, splits=40, busy_s=12.5, cpu=0.75, mem=1.5e9, time=1.7e9,
                          capacity=64, ahead=3, split=M.ProducingSplit(2, 17, 9),
                          io=M.IOCounters(requests=900, bytes_requested=1 << 30, bytes_needed=1 << 29, splits=40),
                          discarded=M.Discarded(stale_run=2, silent=1))
    descs = [M.TensorDesc(*d) for d in TENSORS]
    record = M.SplitTaskRecord(file=M.FileRecord(
        "/data/table/part-00017.orc", "orc", "ds=2026-01-01", 1280000, 2000 * (64 << 10),
        [M.UnitRecord(*u) for u in UNITS[800:804]]), **{k: v for k, v in task([]).items() if k != "file"})
    return {
        "heartbeat": (lambda: old.encode("heartbeat", worker_id="w-0123456789", token=token, buffered=12, stats=STATS),
                      lambda: wire.encode(M.Heartbeat(worker_id="w-0123456789", token=token, buffered=12,
                                                      stats=stats))),
        "credit": (lambda: old.encode("credit", session="s-0123456789ab", token=token, seq=4, batches=4096,
                                      bytes=1 << 34),
                   lambda: wire.encode(M.Credit(session="s-0123456789ab", token=token, seq=4, pieces=4096,
                                                bytes=1 << 34))),
        "batch": (lambda: old.encode("batch", session="s-0123456789ab", seq=4, split_id=517, piece=8,
                                     rows=[256] * 4, held=20, tensors=TENSORS),
                  lambda: wire.encode(M.Batch(session="s-0123456789ab", seq=4, split_id=517, piece=8, rows=[256] * 4,
                                              held=20, tensors=descs))),
        "split": (lambda: old.encode("split", split=task(UNITS)), lambda: wire.encode(M.Split(split=record))),
        "split (same units)": (lambda: old.encode("split", split=task(UNITS[800:804])),
                               lambda: wire.encode(M.Split(split=record))),
    }


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    best = float("inf")
    for _ in range(3):  # the best of three: the least disturbed
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="4b6911a",
                        help="the commit whose wire.py is the baseline (4b6911a: protocol 8, the last untyped one)")
    parser.add_argument("--n", type=int, default=100_000, help="messages per measurement (split: a tenth)")
    args = parser.parse_args()
    old = baseline_wire(args.baseline)
    print(f"baseline: protocol {old.PROTOCOL_VERSION} ({args.baseline}); typed: protocol {wire.PROTOCOL_VERSION}")
    print(f"{'message':20} {'bytes 8':>8} {'bytes 9':>8} {'enc 8 us':>9} {'enc 9 us':>9} {'ratio':>6} "
          f"{'dec 8 us':>9} {'dec 9 us':>9} {'ratio':>6}")
    for name, (encode_old, encode_new) in cases(old).items():
        n = args.n // 10 if name.startswith("split") else args.n
        raw_old, raw_new = encode_old()[0], encode_new()[0]
        enc_old, enc_new = per_call_us(encode_old, n), per_call_us(encode_new, n)
        dec_old = per_call_us(lambda: old.decode([raw_old]), n)
        dec_new = per_call_us(lambda: wire.decode([raw_new]), n)
        print(f"{name:20} {len(raw_old):8d} {len(raw_new):8d} {enc_old:9.2f} {enc_new:9.2f} {enc_new / enc_old:6.2f} "
              f"{dec_old:9.2f} {dec_new:9.2f} {dec_new / dec_old:6.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
