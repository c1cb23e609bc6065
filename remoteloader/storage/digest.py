"""Order-sensitive digests of feature values, to verify a rewritten table without holding
it: every value is hashed with its global row number and its place in the row, and the
hashes are summed modulo 2**64; a digest also counts present (non-null) rows and values.
Two columns with equal digests hold the same values in the same rows (up to a 2**-64
chance), and a digest adds up part by part, so files are checked stripe by stripe.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..columns import Column, DenseColumn

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ROW = np.uint64(0x9E3779B97F4A7C15)


@dataclass
class Digest:
    present: int = 0  # non-null rows
    values: int = 0
    hash: int = 0

    def add(self, other: "Digest") -> None:
        self.present += other.present
        self.values += other.values
        self.hash = (self.hash + other.hash) % (1 << 64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 that spreads every input bit."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


def value_hashes(values: np.ndarray, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One uint64 per value, from its bits, its global row and its place in the row."""
    values = np.ascontiguousarray(values)
    bits = values.view(np.uint32).astype(np.uint64) if values.dtype.itemsize == 4 else values.view(np.uint64)
    with np.errstate(over="ignore"):
        return _mix(bits ^ _mix(rows.astype(np.uint64) * _ROW + positions.astype(np.uint64)))


def total(hashes: np.ndarray) -> int:
    return int(hashes.sum(dtype=np.uint64)) if len(hashes) else 0


def column_digest(column: Column, first_row: int) -> Digest:
    """The digest of a column whose first row is global row ``first_row``."""
    n = len(column)
    valid = np.ones(n, bool) if column.valid is None else column.valid
    rows = np.flatnonzero(valid) + first_row
    if isinstance(column, DenseColumn):
        values = column.values[valid]
        return Digest(len(rows), len(values), total(value_hashes(values, rows, np.zeros(len(rows), np.int64))))
    lengths = np.diff(column.offsets)
    value_rows = np.repeat(np.arange(n, dtype=np.int64), lengths)
    positions = np.arange(len(value_rows), dtype=np.int64) - column.offsets[:-1][value_rows]
    return Digest(len(rows), int(lengths.sum()),
                  total(value_hashes(column.values[:len(value_rows)], value_rows + first_row, positions)))


def grouped_totals(hashes: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Sums of ``hashes[start:stop]`` for every group, modulo 2**64 (empty groups sum to 0)."""
    sums = np.zeros(len(hashes) + 1, np.uint64)
    np.cumsum(hashes, dtype=np.uint64, out=sums[1:])
    with np.errstate(over="ignore"):
        return sums[stops] - sums[starts]
