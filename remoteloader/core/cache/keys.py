"""Content-addressed names of cache blocks: no stale block can ever be served.

A block is (split key, block key). The **split key** names the stored rows: the file's
identity (path, size, the digest of its tail, and what the filesystem says of the file
version, ``DataFile.identity``: on a local or POSIX filesystem its inode, modification and
change times in nanoseconds, so a file rewritten in place with the same size and tail
misses), the unit range, and table-level sampling (rate, seed, label filter, and the
canonical position its hashes use). The **block key** names what was computed from those
rows: for a feature, its whole transform closure (``FeaturePipeline.closure``: sources
with their types, scores, null default, every step's op, op version and normalized
parameters, input features recursively); for a raw block, the column and its type. Columns
are named as the table stores them: a mix of tables' ``columns`` renaming is undone in the
keys, so a block is the same whichever job (and job name) reads the column.

Three namespaces of block keys never meet, whatever a table's columns are called:
features (``"feature"``), table columns as read (``"raw"``, the column's name and type)
and the cache's own internal blocks (``"internal"``: the per-row sampling weights), so a
column named ``weights``, ``label`` or ``row_id`` is just a column.

``KERNEL_VERSION`` is bumped whenever any op's semantics change (a fixed bug included),
which retires every feature block at once; an op's own ``version`` retires only its
features. ``FORMAT_VERSION`` is bumped when what a block holds changes (its layout is the
segment format's business, versioned there).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Optional

import numpy as np

from ...formats import DataFile
from ...transforms import FeaturePipeline

KERNEL_VERSION = 1
# 2: split keys name the file's version (DataFile.identity); raw blocks and internal blocks
# in namespaces of their own; segments of format 2 (a footer MAC checked before parsing).
FORMAT_VERSION = 2


def _canonical(value: Any) -> Any:
    """JSON for what ``json`` cannot encode itself: numpy scalars and arrays (dtype kept)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return {"ndarray": str(value.dtype), "shape": list(value.shape), "data": value.tolist()}
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot name a {type(value).__name__} in a cache key")


def digest(*parts: Any) -> str:
    """32 hex digits naming ``parts`` (JSON, keys sorted: 1 and 1.0 and True stay distinct)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=_canonical, allow_nan=True)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def split_key(file: DataFile, first_unit: int, stop_unit: int, position: int, sampling: Optional[dict]) -> str:
    """The stored rows of units ``[first_unit, stop_unit)`` of ``file``, after ``sampling``."""
    if not file.tail_digest:
        raise ValueError(f"{file.path}: no tail digest (the file was not listed by this version)")
    # ``identity`` is "" only for a file journaled by an older master (listed before identities
    # existed): its key then rests on path, size and tail alone, as that master's did.
    rows = ["rows", FORMAT_VERSION, file.path, file.nbytes, file.tail_digest, file.identity, file.format,
            first_unit, stop_unit]
    if sampling is None:
        return digest(*rows)
    # The position only matters to sampling, whose hashes it seeds.
    return digest(*rows, "sampled", position, sampling)


def feature_key(pipeline: FeaturePipeline, feature: str, stored: Callable[[str], str] = str) -> str:
    """``stored``: each column's name in the table read (a mix's renaming): a block names what
    it was computed from as stored, so a renamed column's blocks are those of its own name."""
    return digest("feature", KERNEL_VERSION, FORMAT_VERSION, pipeline.closure(feature, stored))


def raw_key(column: str, kind: str) -> str:
    """A table column as read (label, passthrough, a cached source), whatever its name."""
    return digest("raw", FORMAT_VERSION, "column", column, kind)


def sampling_weights_key() -> str:
    """The per-row sampling weights (``sampling.weight: true``): an internal block, in a
    namespace no table column's raw key can reach."""
    return digest("internal", FORMAT_VERSION, "sampling-weights")
