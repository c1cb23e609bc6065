"""The worker's in-memory columnar form: what readers produce and transforms consume.

Two shapes cover every feature of a recommendation table:

* ``DenseColumn``: one value per row (``values`` is 1-D, or 2-D ``[rows, k]`` for an
  operator such as ``onehot`` that widens a feature into ``k`` adjacent columns).
* ``SparseColumn``: a list of int64 ids per row, stored as ``values`` (all ids
  concatenated) and ``offsets`` (``rows + 1`` int64 entries, ``offsets[0] == 0``),
  optionally with one float32 ``weights`` entry (score) per id.

Both carry an optional row-validity mask (``valid``; ``None`` means no nulls). A null
dense row holds 0 in ``values``; a null list row has length 0. Columns are never
mutated in place: kernels return new columns, so a column can feed several features.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np


@dataclass(frozen=True)
class DenseColumn:
    values: np.ndarray
    valid: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(self.values.shape[0])

    @property
    def width(self) -> int:
        return 1 if self.values.ndim == 1 else int(self.values.shape[1])

    def take(self, rows: np.ndarray) -> "DenseColumn":
        return DenseColumn(self.values[rows], None if self.valid is None else self.valid[rows])

    def slice(self, start: int, stop: int) -> "DenseColumn":
        return DenseColumn(self.values[start:stop], None if self.valid is None else self.valid[start:stop])


@dataclass(frozen=True)
class SparseColumn:
    values: np.ndarray
    offsets: np.ndarray
    weights: Optional[np.ndarray] = None
    valid: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def slice(self, start: int, stop: int) -> "SparseColumn":
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return SparseColumn(
            self.values[lo:hi],
            self.offsets[start : stop + 1] - lo,
            None if self.weights is None else self.weights[lo:hi],
            None if self.valid is None else self.valid[start:stop],
        )

    def take(self, rows: np.ndarray) -> "SparseColumn":
        """Rows in the order given (a permutation or any index array), one gather per buffer."""
        rows = np.asarray(rows, dtype=np.int64)
        starts = self.offsets[:-1][rows]
        lengths = self.offsets[1:][rows] - starts
        offsets = np.zeros(rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # Index of every kept element: its row's start plus its position inside the row.
        gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return SparseColumn(
            self.values[gather],
            offsets,
            None if self.weights is None else self.weights[gather],
            None if self.valid is None else self.valid[rows],
        )


Column = Union[DenseColumn, SparseColumn]
