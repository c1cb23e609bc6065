"""What ``wire.unpack_pieces`` costs the client's training thread per message (issue 36): a
run of ``--pieces`` pieces of ``--rows`` rows of the 13 dense + 26 sparse spec (id lists of
mean length ``--mean-length``, about what ``firstx 20`` leaves of the generated table's
lists), packed and decoded as a worker sends it, then unpacked (every check, then cut into
views) ``--repeat`` times. Prints microseconds per message and per piece, and the
nanoseconds per sparse length (what a per-row pass costs), for ``wire.unpack_pieces`` and,
in the same run, for the form it replaced (``cumsum_form``: the value bounds read from a
full int64 cumsum of every length, ``jagged.offsets``, as before issue 36), alternating.
It reads nothing from the network.

Run: ``.venv/bin/python -m benchmarks.unpack_pieces [--pieces 1 4 16] [--repeat 300]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from remoteloader.columns import SparseColumn
from remoteloader.core.processor import TransformedSplit
from remoteloader.protocol import wire
from remoteloader import jagged
from remoteloader.protocol.messages import MAX_FRAME_BYTES, MAX_PIECES, Batch

DENSE, SPARSE = 13, 26


def cumsum_form(header, frames, keys: int) -> list:
    """``wire.unpack_pieces`` as it was before issue 36 (same checks, same views)."""
    rows = header["rows"]
    if not (0 < len(rows) <= MAX_PIECES and all(type(r) is int and 0 < r <= MAX_FRAME_BYTES for r in rows)):
        raise wire.ProtocolError("rows")
    arrays = wire.unpack_arrays(header["tensors"], frames)
    total = sum(rows)
    lengths, values = arrays.get(jagged.LENGTHS), arrays.get(jagged.VALUES)
    if lengths is None or values is None or lengths.ndim != 1 or values.ndim != 1:
        raise wire.ProtocolError("sparse")
    if lengths.shape[0] != keys * total or lengths.dtype != np.int32 or (total and keys and lengths.min() < 0):
        raise wire.ProtocolError("lengths")
    offsets = jagged.offsets(lengths)
    for name, a in arrays.items():
        if name in jagged.PER_VALUE:
            if a.shape != (offsets[-1],):
                raise wire.ProtocolError(name)
        elif name != jagged.LENGTHS and (a.ndim == 0 or a.shape[0] != total):
            raise wire.ProtocolError(name)
    if "labels" not in arrays or arrays["labels"].ndim != 1:
        raise wire.ProtocolError("labels")
    row_bounds = np.cumsum([0, *rows])
    pieces = jagged.cut(arrays, keys, row_bounds, offsets[keys * row_bounds])
    return [(header["split_id"], header["piece"] + i, piece) for i, piece in enumerate(pieces)]


def message(pieces: int, rows: int, mean_length: float, seed: int = 0) -> tuple[Batch, list, int]:
    """A decoded batch message of ``pieces`` pieces: its header, frames and bytes."""
    rng, total = np.random.default_rng(seed), pieces * rows
    sparse = []
    for _ in range(SPARSE):
        lengths = rng.poisson(mean_length, total)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        sparse.append(SparseColumn(rng.integers(0, 1 << 40, int(offsets[-1])), offsets))
    split = TransformedSplit.build(rng.random((total, DENSE), dtype=np.float32), rng.random(total, dtype=np.float32),
                                   sparse, {}, None, rows)
    descs, frames = wire.pack_arrays(split.arrays(0, total))
    header = Batch(session="s", seq=0, split_id=0, piece=0, rows=[rows] * pieces, held=0, tensors=descs)
    parts = [bytes(p) for p in wire.encode(header, frames)]
    decoded, data = wire.decode(parts)
    return decoded, data, sum(len(p) for p in parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pieces", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--mean-length", type=float, default=10.0)
    p.add_argument("--repeat", type=int, default=300, help="unpacks per timing")
    p.add_argument("--rounds", type=int, default=7, help="timings per size (the median is printed)")
    args = p.parse_args()
    print(f"unpack_pieces against the form it replaced, alternating: {DENSE} dense + {SPARSE} sparse, {args.rows} rows per piece, id lists of mean length "
          f"{args.mean_length:g}; median of {args.rounds} timings of {args.repeat} unpacks; {os.cpu_count()} cores")
    print()
    forms = {"unpack_pieces (reduceat)": wire.unpack_pieces, "before (cumsum of every length)": cumsum_form}
    print("| pieces per message | MB per message | form | us per message | us per piece | ns per sparse length "
          "| ratio |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for pieces in args.pieces:
        header, frames, nbytes = message(pieces, args.rows, args.mean_length)
        got = {name: f(header, frames, SPARSE) for name, f in forms.items()}  # warm-up, and the same answer
        for (_, _, a), (_, _, b) in zip(*got.values()):
            assert all(np.array_equal(a[k], b[k]) for k in a)
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, f in forms.items():
                start = time.perf_counter()
                for _ in range(args.repeat):
                    f(header, frames, SPARSE)
                times[name].append((time.perf_counter() - start) / args.repeat)
        new = statistics.median(times["unpack_pieces (reduceat)"])
        lengths = SPARSE * args.rows * pieces
        for name in forms:
            t = statistics.median(times[name])
            print(f"| {pieces} | {nbytes / 1e6:.1f} | {name} | {t * 1e6:,.0f} | {t * 1e6 / pieces:,.0f} | "
                  f"{t * 1e9 / lengths:.2f} | {t / new:.2f} |")

if __name__ == "__main__":
    main()
