"""The jagged layout of sparse features, written once for both sides of the wire.

``keys`` sparse features over ``rows`` rows are ``lengths`` (``keys * rows`` entries,
**key-major**: all rows of key 0, then of key 1, ..., as torchrec's KeyedJaggedTensor),
``values`` (the ids, in the same order) and optional ``weights`` (one per value).

A *run* of consecutive pieces puts the pieces one after the other, each key-major over
its own rows (piece-major across pieces). Every piece is then one contiguous range of
every tensor, so a worker sends a run as one frame per tensor and the client cuts it back
into its pieces, both as views; a batch is a run of one piece.

Tensors go by their wire names: ``sparse.values`` and ``sparse.weights`` hold one entry
per value, ``sparse.lengths`` one per row and key, every other tensor one per row.
Slicing works on numpy arrays and torch tensors alike. Python never copies one block, row
or value at a time. The worker's copy of a split's feature columns into a run is compiled
(``kernels``, loaded at its first copy, so a process that never makes runs never loads
numba); the client's merge of row ranges of pieces (tails, mixed batches) is one
``np.concatenate`` per tensor over views of the pieces' blocks, whose bounds come from each
piece's ``ends``, made once a piece.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Optional, Protocol, Sequence, TypeVar

import numpy as np

VALUES, WEIGHTS, LENGTHS = "sparse.values", "sparse.weights", "sparse.lengths"
PER_VALUE = (VALUES, WEIGHTS)

T = TypeVar("T")  # an array: numpy's or torch's (only sliced)


class SparseColumn(Protocol):
    """One feature's ids over rows (``columns.SparseColumn``; not imported, so that this
    module, which the wire uses, sits below every layer of the package)."""

    @property
    def values(self) -> np.ndarray: ...

    @property
    def offsets(self) -> np.ndarray: ...  # int64 [rows + 1]

    @property
    def weights(self) -> Optional[np.ndarray]: ...


@dataclass(frozen=True)
class Jagged:
    """The sparse tensors of one piece (key-major) or of a run of pieces (piece-major)."""

    keys: int
    rows: int
    lengths: np.ndarray  # [keys * rows]
    values: np.ndarray
    weights: Optional[np.ndarray] = None  # like values

    @cached_property
    def ends(self) -> np.ndarray:
        """int64 ``[keys * rows + 1]``: where each length's values start, then the end (made at
        the first merge that takes rows of the piece, kept for the next ones)."""
        return offsets(self.lengths)


def offsets(lengths: np.ndarray) -> np.ndarray:
    """int64 ``[n + 1]``: where the values of each length start, then the end."""
    out = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def take_rows(tensors: Mapping[str, T], keys: int, rows: tuple[int, int], values: tuple[int, int]) -> dict[str, T]:
    """Rows ``[lo, hi)`` of a run, starting and ending on piece boundaries, whose values are
    ``[va, vb)`` of the run's: views."""
    lo, hi = rows
    va, vb = values
    out = {}
    for name, t in tensors.items():  # a handful of tensors, per piece: plain comparisons are the cheapest here
        if name == VALUES or name == WEIGHTS:
            out[name] = t[va:vb]
        elif name == LENGTHS:
            out[name] = t[keys * lo:keys * hi]
        else:
            out[name] = t[lo:hi]
    return out


def cut(tensors: Mapping[str, T], keys: int, row_bounds: np.ndarray, value_bounds: np.ndarray) -> list[dict[str, T]]:
    """A run cut into its pieces (views): piece ``i`` holds rows ``row_bounds[i:i + 2]`` and
    values ``value_bounds[i:i + 2]``."""
    rows, values = row_bounds.tolist(), value_bounds.tolist()  # Python ints slice faster than numpy's
    return [take_rows(tensors, keys, (rows[i], rows[i + 1]), (values[i], values[i + 1])) for i in range(len(rows) - 1)]


def key_ranges(key: int, rows: int, offset_per_key: Sequence[int]) -> tuple[slice, slice]:
    """Where feature ``key`` of a key-major piece lies: its lengths, and its values (and weights)."""
    return slice(key * rows, (key + 1) * rows), slice(offset_per_key[key], offset_per_key[key + 1])


def piece_major(sparse: Sequence[SparseColumn], rows: int, piece_rows: int) -> tuple[Jagged, np.ndarray]:
    """Features (one column per key) as a run of pieces of ``piece_rows`` rows (the last may be
    short), and where each piece's values start (int64 ``[pieces + 1]``). A piece's rows of one
    feature are one contiguous block of that column's values: a copy of pieces x keys blocks,
    never a gather per value. Weights are there when any column has them (1.0 for the others)."""
    keys = len(sparse)
    bounds = np.append(np.arange(0, rows, piece_rows), rows)
    if keys == 0:
        return Jagged(0, rows, np.zeros(0, np.int32), np.zeros(0, np.int64)), np.zeros(bounds.shape[0], np.int64)
    starts = np.stack([c.offsets[bounds] for c in sparse])  # [keys, pieces + 1], into each column's values
    sizes = np.diff(starts, axis=1)  # [keys, pieces]
    kernels = _kernels()
    at, value_starts = kernels.places(sizes)
    # One compiled pass per key writes its lengths (straight from its offsets) and copies its
    # values: per row and key, the lengths are written once, with no intermediate arrays.
    lengths = np.empty(keys * rows, np.int32)
    values = np.empty(int(value_starts[-1]), np.int64)
    for k, c in enumerate(sparse):
        kernels.piece_major_key(c.offsets, c.values, k, keys, piece_rows, at[k], lengths, values)
    weights = None
    if any(c.weights is not None for c in sparse):
        weights = np.empty(values.shape[0], np.float32)
        _interleave([c.weights if c.weights is not None else np.ones(c.values.shape[0], np.float32) for c in sparse],
                    starts[:, :-1], sizes, weights)
    return Jagged(keys, rows, lengths, values, weights), value_starts


@dataclass(frozen=True)
class ConcatPlan:
    """A merge of row ranges of key-major pieces (``plan_concat``): the blocks each of its
    tensors is made of, in order (views of the pieces' arrays), and its size."""

    keys: int
    total_rows: int
    total_values: int
    lengths: list[np.ndarray]
    values: list[np.ndarray]
    weights: Optional[list[np.ndarray]]


def plan_concat(parts: Sequence[tuple[Jagged, int, int]]) -> ConcatPlan:
    """Rows ``[start, stop)`` of each key-major piece, in order: the output is key-major, so its
    blocks go key by key, and within a key part by part. Where a part's rows of each key start
    and end in its values is read from the piece's ``ends`` (made once a piece, though a mixed
    batch's piece serves several batches): a strided view, no pass over its lengths."""
    keys = parts[0][0].keys
    bounds = []
    total_values = 0
    for piece, start, stop in parts:
        if stop == start:
            continue
        ends, rows = piece.ends, piece.rows
        first, last = ends[start::rows][:keys].tolist(), ends[stop::rows][:keys].tolist()
        total_values += sum(last) - sum(first)
        bounds.append((piece, start, stop, rows, first, last))
    lengths = [piece.lengths[k * rows + start:k * rows + stop]
               for k in range(keys) for piece, start, stop, rows, _, _ in bounds]
    values = [piece.values[first[k]:last[k]] for k in range(keys) for piece, _, _, _, first, last in bounds]
    weights = None
    if parts[0][0].weights is not None:
        weights = [piece.weights[first[k]:last[k]] for k in range(keys) for piece, _, _, _, first, last in bounds]
    return ConcatPlan(keys, sum(stop - start for _, start, stop in parts), total_values, lengths, values, weights)


def concat_into(plan: ConcatPlan, lengths: np.ndarray, values: np.ndarray, weights: Optional[np.ndarray]) -> Jagged:
    """The merge ``plan`` describes, written into ``lengths`` (``keys * total_rows``),
    ``values`` and ``weights`` (``total_values``, or None): one copy call per tensor."""
    if plan.lengths:  # else no rows, or no keys: nothing to copy
        np.concatenate(plan.lengths, out=lengths)
        np.concatenate(plan.values, out=values)
        if weights is not None:
            np.concatenate(plan.weights, out=weights)
    return Jagged(plan.keys, plan.total_rows, lengths, values, weights)


def concat_rows(parts: Sequence[tuple[Jagged, int, int]]) -> Jagged:
    """Rows ``[start, stop)`` of each key-major piece, in order, as one key-major piece (the
    client's tail merge) in new arrays."""
    first = parts[0][0]
    plan = plan_concat(parts)
    values = np.empty(plan.total_values, first.values.dtype)
    weights = None if first.weights is None else np.empty(plan.total_values, first.weights.dtype)
    return concat_into(plan, np.empty(plan.keys * plan.total_rows, first.lengths.dtype), values, weights)


def _interleave(sources: Sequence[np.ndarray], starts: np.ndarray, sizes: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Copy block ``b`` of each source ``s`` (``sizes[s, b]`` entries from ``starts[s, b]``) into
    ``out`` in (block, source) order: the worker's sources are keys and its blocks pieces, the
    client's sources are pieces and its blocks keys. Returns where each block starts, then the end."""
    kernels = _kernels()
    at, block_starts = kernels.places(sizes)
    for s, source in enumerate(sources):
        kernels.copy_blocks(source, starts[s], at[s], sizes[s], out)
    return block_starts


def _kernels():
    from . import kernels  # numba: 0.3-0.5 s of a process's start, paid at the first copy

    return kernels
