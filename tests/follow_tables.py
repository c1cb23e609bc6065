"""Growing tables for the following tests and benchmark: partitions of consecutive row ids,
landed as a writer commits them (written under a ``_``-prefixed name, which listings skip,
then renamed into place)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROW_GROUP = 100


def partition_table(first_row: int, rows: int) -> pa.Table:
    ids = np.arange(first_row, first_row + rows, dtype=np.int64)
    rng = np.random.default_rng(first_row)
    lengths = rng.integers(0, 4, rows)
    return pa.table({
        "row_id": ids,
        "label": (ids % 2).astype(np.float32),
        "float_0": rng.random(rows, dtype=np.float32),
        "idlist_0": pa.ListArray.from_arrays(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
                                             rng.integers(0, 1000, int(lengths.sum()))),
    })


def land_partition(table: Path, name: str, first_row: int, rows: int, files: int = 1) -> None:
    """Partition ``name`` with rows ``[first_row, first_row + rows)`` in ``files`` files."""
    staging = table / f"_landing-{name.replace('/', '-')}"
    staging.mkdir(parents=True)
    bounds = np.linspace(first_row, first_row + rows, files + 1).astype(int)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        pq.write_table(partition_table(int(lo), int(hi - lo)), staging / f"part-{i:05d}.parquet",
                       row_group_size=ROW_GROUP)
    (table / name).parent.mkdir(parents=True, exist_ok=True)
    os.rename(staging, table / name)


def follow_spec(table: Path, every: float = 0.1, until=None, **overrides) -> dict:
    spec = {"table": {"path": str(table), "follow": {"every": every, "until": until}},
            "features": {"label": "label", "dense": ["float_0"], "sparse": [{"name": "s0", "column": "idlist_0"}],
                         "passthrough": ["row_id"]},
            "batch_size": 128, "split_rows": 300, "shuffle": True, "seed": 3}
    spec.update(overrides)
    return spec


def rows_of(batches) -> list[int]:
    """The row ids of ``batches``, padding rows (even_batches: pad) left out."""
    out = []
    for b in batches:
        ids = b.passthrough["row_id"]
        out += (ids if b.padding is None else ids[~b.padding]).tolist()
    return out
