"""Arrow arrays to the worker's columns (DenseColumn / SparseColumn), vectorized.

Every conversion works on whole buffers: no Python runs per row (only per chunk). Arrays
may be sliced, chunked, or contain null list entries backed by non-empty sublists (legal
in Arrow): list columns follow ``flatten()`` / ``value_lengths()`` semantics, computed
with numpy from the offsets because Arrow's own kernels are slow on these paths.
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

from ..columns import Column, DenseColumn, SparseColumn
from .types import TableError


def column_kind(type_: pa.DataType) -> str:
    """'float' | 'int' | 'id_list' | 'float_list' | 'map:float' | 'map:id_list' |
    'map:scored' | 'other:<arrow type>'."""
    if pat.is_floating(type_):
        return "float"
    if pat.is_integer(type_):
        return "int"
    if pat.is_list(type_) or pat.is_large_list(type_):
        item = type_.value_type
        if pat.is_integer(item):
            return "id_list"
        if pat.is_floating(item):
            return "float_list"
    return map_kind(type_) or f"other:{type_}"


def map_kind(type_: pa.DataType) -> Optional[str]:
    """The kind of a feature map column keyed by integer feature ids, or None:
    'map:float' (map<int, float>: dense features), 'map:id_list' (map<int, list<int>>:
    id-list features), 'map:scored' (map<int, map<int, float>>: id -> score features)."""
    if not pat.is_map(type_) or not pat.is_integer(type_.key_type):
        return None
    item = type_.item_type
    if pat.is_floating(item):
        return "map:float"
    if (pat.is_list(item) or pat.is_large_list(item)) and pat.is_integer(item.value_type):
        return "map:id_list"
    if pat.is_map(item) and pat.is_integer(item.key_type) and pat.is_floating(item.item_type):
        return "map:scored"
    return None


def arrow_to_column(array: Union[pa.Array, pa.ChunkedArray]) -> Column:
    """float -> float32 DenseColumn (float64 stays float64), int -> int64 DenseColumn,
    list<int> -> SparseColumn of int64 ids, list<float> -> SparseColumn of float32 values.

    Null dense rows hold 0 and null list rows have length 0, both flagged in ``valid``
    (``None`` when there are no nulls). Null items inside a list become 0. Arrays without
    nulls are converted without copying where the dtype already matches, so the returned
    arrays can be read-only views of Arrow buffers (columns are never mutated in place).
    """
    kind = column_kind(array.type)
    # Chunks are converted one by one and joined with numpy: Arrow's own concatenation
    # of list arrays (combine_chunks) runs several times slower than a copy.
    chunks = (array.chunks if isinstance(array, pa.ChunkedArray) else [array]) or [pa.array([], array.type)]
    if kind in ("float", "int"):
        dtype = np.int64 if kind == "int" else np.float64 if pat.is_float64(array.type) else np.float32
        values = _join([_numpy(c, dtype) for c in chunks])
        return DenseColumn(values, _join_valid(chunks))
    if kind in ("id_list", "float_list"):
        parts = [_list_chunk(c, np.int64 if kind == "id_list" else np.float32) for c in chunks]
        lengths = _join([p[1] for p in parts])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return SparseColumn(_join([p[0] for p in parts]), offsets, valid=_join_valid(chunks))
    raise TableError(f"unsupported column type {array.type} (need a number or a list of numbers)")


def _list_chunk(array: pa.Array, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of a list array, with ``flatten()`` / ``value_lengths()``
    semantics: the slice offset is honoured and a null entry has no values, even when
    its offsets span some (Arrow allows that)."""
    raw = array.offsets.to_numpy()  # the slice's n + 1 offsets into the unsliced child
    lengths = np.diff(raw)
    values = _numpy(array.values.slice(raw[0], raw[-1] - raw[0]), dtype)
    if array.null_count:
        valid = array.is_valid().to_numpy(zero_copy_only=False)
        if lengths[~valid].any():
            values = values[np.repeat(valid, lengths)]
            lengths = np.where(valid, lengths, 0)
    return values, lengths


def _numpy(array: pa.Array, dtype: type) -> np.ndarray:
    if array.null_count:
        array = array.fill_null(0)
    out = array.to_numpy(zero_copy_only=False)
    return out if out.dtype == dtype else out.astype(dtype)


def _join(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _join_valid(chunks: list[pa.Array]) -> Optional[np.ndarray]:
    if not any(c.null_count for c in chunks):
        return None
    return _join([c.is_valid().to_numpy(zero_copy_only=False) for c in chunks])
