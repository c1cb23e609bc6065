"""Features inside map columns: virtual column names and vectorized key extraction.

Production tables keep features in map columns keyed by feature id (kinds from
``column_kind``: 'map:float', 'map:id_list', 'map:scored'). A feature inside one is read
by a virtual column name:

* ``X[K]``: key ``K`` of map column ``X``; a float DenseColumn for 'map:float', an
  id_list SparseColumn for 'map:id_list'; rows without the key are null.
* ``X[K].ids`` / ``X[K].scores``: the ids (id_list) and scores (float_list, aligned) of
  key ``K`` of a 'map:scored' column.

Reading a virtual column reads its whole map column (the slow baseline that flattening
removes) and extracts the keys with numpy over whole buffers, no Python per row. If a
row holds a key twice, its first entry counts. ``flat_name`` gives the column a flattened
table stores the feature in.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import numpy as np
import pyarrow as pa

from ..columns import Column, DenseColumn, SparseColumn
from .convert import _numpy
from .types import TableError

_VIRTUAL = re.compile(r"^(?P<base>.+)\[(?P<key>-?\d+)\](?:\.(?P<part>ids|scores))?$")
_KINDS = {("map:float", None): "float", ("map:id_list", None): "id_list",
          ("map:scored", "ids"): "id_list", ("map:scored", "scores"): "float_list"}


@dataclass(frozen=True)
class Virtual:
    name: str
    base: str  # the map column
    key: int
    part: Optional[str]  # None | "ids" | "scores"


def parse_virtual(name: str) -> Optional[Virtual]:
    """The parts of a virtual column name, or None if ``name`` is not one."""
    m = _VIRTUAL.match(name)
    return Virtual(name, m["base"], int(m["key"]), m["part"]) if m else None


def virtual_column_kind(schema: Mapping[str, str], name: str) -> Optional[str]:
    """'float' | 'id_list' | 'float_list' for a virtual column of ``schema`` (column ->
    kind, as from ``table_schema``), None if ``name`` is none (or is a real column)."""
    v = parse_virtual(name)
    if v is None or name in schema:
        return None
    return _KINDS.get((schema.get(v.base, ""), v.part))


def flat_name(name: str) -> str:
    """The flattened column of a feature: ``X[K]`` -> ``X_K``, ``X[K].ids`` -> ``X_K_ids``,
    ``X[K].scores`` -> ``X_K_scores``; other names are returned unchanged."""
    v = parse_virtual(name)
    if v is None:
        return name
    return f"{v.base}_{v.key}" + (f"_{v.part}" if v.part else "")


def extract(array: Union[pa.Array, pa.ChunkedArray], kind: str, wanted: Sequence[Virtual]) -> dict[str, Column]:
    """The columns of ``wanted`` (virtual columns of one map column of ``kind``)."""
    for v in wanted:
        if (kind, v.part) not in _KINDS:
            raise TableError(f"column {v.name!r}: {v.base!r} is {kind}, which has no such feature"
                             + (" (use .ids / .scores)" if kind == "map:scored" else ""))
    chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
    keys = np.array(sorted({v.key for v in wanted}), dtype=np.int64)
    parts = [_extract_chunk(c, kind, keys, wanted) for c in chunks]
    if not parts:
        parts = [_extract_chunk(pa.array([], array.type), kind, keys, wanted)]
    return {v.name: _join_columns([p[v.name] for p in parts]) for v in wanted}


def key_entries(chunk: pa.MapArray, keys: Optional[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The map entries with a key in ``keys`` (all if None), grouped by key:
    (entry indices into the map's children, their rows, their keys), sorted by key and
    then by row. Entries of null rows are left
    out; where a row holds a key twice, only its first entry is kept."""
    raw = chunk.offsets.to_numpy()  # n + 1 offsets into the children, honouring a slice
    lo, hi = int(raw[0]), int(raw[-1])
    all_keys = _numpy(chunk.keys.slice(lo, hi - lo), np.int64)
    rows = np.repeat(np.arange(len(chunk), dtype=np.int64), np.diff(raw))
    selected = np.isin(all_keys, keys) if keys is not None else np.ones(len(all_keys), bool)
    if chunk.null_count:
        selected &= chunk.is_valid().to_numpy(zero_copy_only=False)[rows]
    entries = np.flatnonzero(selected)
    # Group by key, rows ascending inside a group (stable sort of row-ordered entries).
    entries = entries[np.argsort(all_keys[entries], kind="stable")]
    entry_keys, entry_rows = all_keys[entries], rows[entries]
    repeated = (np.diff(entry_keys) == 0) & (np.diff(entry_rows) == 0)
    if repeated.any():
        keep = np.concatenate([[True], ~repeated])
        entries, entry_keys, entry_rows = entries[keep], entry_keys[keep], entry_rows[keep]
    return entries + lo, entry_rows, entry_keys


def _extract_chunk(chunk: pa.MapArray, kind: str, keys: np.ndarray, wanted: Sequence[Virtual]) -> dict[str, Column]:
    entries, rows, entry_keys = key_entries(chunk, keys)
    n = len(chunk)
    sources = {part: Items(chunk.items, kind, part or "ids") for part in {v.part for v in wanted}}
    out = {}
    for v in wanted:
        lo, hi = np.searchsorted(entry_keys, [v.key, v.key + 1])
        out[v.name] = sources[v.part].column(entries[lo:hi], rows[lo:hi], n)
    return out


class Items:
    """The items (values) of a map column's entries as numpy buffers, taken once per chunk:
    floats for 'map:float', lists for 'map:id_list', the ids or the scores of 'map:scored'."""

    def __init__(self, items: pa.Array, kind: str, part: str = "ids"):
        self.part = part
        self.dense = kind == "map:float"
        self.valid = items.is_valid().to_numpy(zero_copy_only=False) if items.null_count else None
        if self.dense:
            self.values = _numpy(items, np.float64 if pa.types.is_float64(items.type) else np.float32)
            return
        self.offsets = items.offsets.to_numpy()  # indexes the whole child below
        inner = items.values if kind == "map:id_list" else items.keys if part == "ids" else items.items
        self.values = _numpy(inner, np.float32 if part == "scores" else np.int64)

    def column(self, entries: np.ndarray, rows: np.ndarray, n: int) -> Column:
        """A column of ``n`` rows holding the items of ``entries`` in rows ``rows``
        (ascending); rows without an entry are null."""
        valid = np.zeros(n, bool)
        valid[rows] = True if self.valid is None else self.valid[entries]
        if self.dense:
            values = np.zeros(n, self.values.dtype)
            values[rows] = self.values[entries]
            return DenseColumn(values, None if valid.all() else valid)
        starts = self.offsets[entries].astype(np.int64)
        lengths = self.offsets[entries + 1] - starts
        if self.valid is not None:
            lengths = np.where(self.valid[entries], lengths, 0)
        row_lengths = np.zeros(n, np.int64)
        row_lengths[rows] = lengths
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(row_lengths, out=offsets[1:])
        # Source index of every kept value: its entry's start plus its place in the row.
        gather = np.repeat(starts - offsets[:-1][rows], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return SparseColumn(self.values[gather], offsets, valid=None if valid.all() else valid)


def _join_columns(parts: list[Column]) -> Column:
    if len(parts) == 1:
        return parts[0]
    valid = None
    if any(p.valid is not None for p in parts):
        valid = np.concatenate([np.ones(len(p), bool) if p.valid is None else p.valid for p in parts])
    if isinstance(parts[0], DenseColumn):
        return DenseColumn(np.concatenate([p.values for p in parts]), valid)
    lengths = np.concatenate([np.diff(p.offsets) for p in parts])
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return SparseColumn(np.concatenate([p.values for p in parts]), offsets, valid=valid)
