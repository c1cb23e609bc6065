"""How big a transformed split is, and how many rows keep one within a worker's budget.

A worker holds whole transformed splits (a piece is a view into its split), so what its
``--buffer-bytes`` bounds is splits: the one it is cutting, those whose pieces wait in
its buffer, and one read ahead. ``row_bytes`` estimates what a row costs after the
transforms by transforming a small sample through the workers' own code (the first
unit, stripe or row group, of the first non-empty file); ``split_rows_within`` is how
many rows keep one split within half the budget (with a margin for rows costlier than
the sample's), so that the split a worker cuts and one more fit. The master plans with
the smaller of that and ``split_rows`` when ``split_rows`` would exceed it.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

import numpy as np

from ..columns import SparseColumn
from ..formats import DEFAULT_COALESCE_GAP, DataFile
from .binding import BoundDataset
from .plan import BaseSplit, EpochSplit, make_task
from .processor import SplitProcessor, TransformedSplit
from .sampling import sampled_splits

DEFAULT_BUFFER_BYTES = 256 << 20  # a worker's budget: the client's default prefetch_bytes
# A worker's largest data message (its --max-message-bytes; one piece larger still goes, alone).
# Below glibc's largest dynamic mmap threshold (32 MiB on 64-bit), so the client's receive
# buffers are reused heap, not pages freshly mapped (and faulted in) for every message.
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
# A client's shared-memory arena at a worker on its host: the loader's default credit window
# (prefetch_bytes), so a partition of one worker never falls back to frames for want of room.
# Pages are taken as first written and regions reused lowest first: an arena holds about what
# its client has in flight, queued or in the training loop's hands.
DEFAULT_ARENA_BYTES = 256 << 20
# Splits are cut for rows this much larger than the sample's: a split of other rows (longer
# id lists) may cost more, and two splits of exactly half the budget would then not fit.
ESTIMATE_MARGIN = 1.1
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, most: Optional[int] = None) -> int:
    """Bytes from ``268435456``, ``256M``, ``256MiB``, ``1G`` (K, M, G, T: powers of 1024), at most ``most``."""
    m = _SIZE.match(str(text))
    if m is None:
        raise ValueError(f"invalid size {text!r} (expected bytes, or a number with K, M, G or T, e.g. 256M)")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"invalid size {text!r}: must be positive")
    if most is not None and value > most:
        raise ValueError(f"{text!r} is above {format_size(most)}, the largest allowed")
    return value


def format_size(nbytes: float) -> str:
    """``268435456`` -> ``256.0 MiB`` (for messages)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,.0f} B"


def split_nbytes(tensors: dict) -> int:
    """A transformed split's bytes: the sum of its tensors' (what a worker holds for it)."""
    return sum(int(a.nbytes) for a in tensors.values())


def row_bytes(bound: BoundDataset, files: Optional[Sequence[DataFile]] = None,
              coalesce_gap: int = DEFAULT_COALESCE_GAP) -> Optional[float]:
    """Transformed bytes per row of a sample: the first unit of the first file that has
    rows, read, sampled and transformed as a worker would (epoch 0). None when the table
    has no rows, or sampling keeps none of the sample's. Raises what a worker would
    (``SplitError``) if the sample cannot be read or transformed."""
    files = list(bound.files or [] if files is None else files)
    for fi, f in enumerate(files):
        unit = next((u for u in f.units if u.num_rows), None)
        if unit is None:
            continue
        raw = BaseSplit(0, fi, unit.index, unit.index + 1, unit.num_rows, unit.num_rows, 0)
        (base,) = sampled_splits(bound, files, [raw], coalesce_gap)
        if not base.rows:
            return None
        table = (bound.file_tables[fi], 0) if bound.file_tables else None  # a mix: read under the job's names
        task = make_task(files, base, EpochSplit(0, 0, 0, 0, base.rows, table=table), epoch=0)
        split = SplitProcessor(bound, coalesce_gap).transform(task)
        return split_nbytes(split.tensors) / split.rows
    return None


def warm_up() -> None:
    """Set up numba's compiler and load a kernel from its cache: the first compiled call
    of a process costs a few tenths of a second, which the first job's estimate would
    otherwise add to its bind (a master calls this as it starts)."""
    TransformedSplit.build(np.zeros((2, 1), np.float32), np.zeros(2, np.float32),
                           [SparseColumn(np.array([1, 2], np.int64), np.array([0, 1, 2], np.int64))], {}, None, 1)


def split_rows_within(budget_bytes: int, bytes_per_row: float) -> int:
    """Rows of a split whose transformed bytes stay within half of ``budget_bytes``, with
    ``ESTIMATE_MARGIN`` for rows that cost more than the sample's."""
    return max(1, int(budget_bytes // 2 / (ESTIMATE_MARGIN * max(bytes_per_row, 1e-9))))
