"""CUDA soak (issue 36): pinned and device staging at realistic sizes, on a real GPU.

The CPU tests of ``test_pinning`` fake the allocator and the device; this runs the real
thing wherever CUDA is present (and skips elsewhere): a 13 dense + 26 sparse table in batches
of 4,096 rows whose splits end in tails of varying length (merged into batches between whole
pieces), two epochs with ``pin_memory=True`` and two with ``device="cuda"``, through a pinned
pool small enough that slabs are evicted and reused. Every epoch must deliver every row once,
with the same labels and dense values as the host path, and nothing may hang.
``REMOTELOADER_SOAK_ROWS`` sets the table's rows (default 300,000: 74 batches an epoch).
"""
from __future__ import annotations

import os

import pytest
import torch

from remoteloader import RemoteDataLoader
from remoteloader.client.batch import batch_tensors
from remoteloader.tools.datagen import generate_table

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BATCH = 4096


def soak_spec(table: str) -> dict:
    return {
        "table": {"path": table},
        "features": {
            "label": "label",
            "dense": [{"name": f"d{i}", "column": f"float_{i}", "transforms": [{"op": "clamp", "min": 0.0, "max": 1e6}]}
                      for i in range(13)],
            "sparse": [{"name": f"s{i}", "column": f"idlist_{i}",
                        "transforms": [{"op": "firstx", "x": 20}, {"op": "sigrid_hash", "salt": i, "max_value": 200_000}]}
                       for i in range(26)],
            "passthrough": ["row_id"],
        },
        "batch_size": BATCH,
        "split_rows": 21_000,  # splits of 5 stripes of 4,200 rows: 5 whole pieces and a 976-row tail
        "shuffle": True,
    }


def epoch_rows(loader: RemoteDataLoader, device: bool) -> dict[int, tuple[float, float]]:
    """row id -> (label, sum of its dense values) over one epoch, checking each batch's placement."""
    out: dict[int, tuple[float, float]] = {}
    for b in loader:
        for t in batch_tensors(b):
            if device:
                assert t.device.type == "cuda"
            else:
                assert t.is_pinned() and loader.pin_pool.owns(t)
        ids = b.passthrough["row_id"].cpu()
        labels = b.labels.cpu()
        dense = b.dense_features.cpu().sum(dim=1)
        if b.padding is not None:
            keep = ~b.padding.cpu()
            ids, labels, dense = ids[keep], labels[keep], dense[keep]
        for i, label, d in zip(ids.tolist(), labels.tolist(), dense.tolist()):
            assert i not in out, f"row {i} delivered twice"
            out[i] = (label, d)
    return out


def test_cuda_soak_pinned_and_device_staging_at_realistic_sizes(tmp_path):
    rows = int(os.environ.get("REMOTELOADER_SOAK_ROWS", "300000"))
    table = str(tmp_path / "soak")
    generate_table(table, rows=rows, partitions=2, dense=13, sparse=26, stripe_rows=4200, seed=11, progress=False)
    workers = max(2, min(8, (os.cpu_count() or 2) - 2))
    spec = soak_spec(table)
    with RemoteDataLoader(spec, num_workers=workers, timeout=120) as host:
        reference = {i: (label, d) for b in host for i, label, d in zip(
            b.passthrough["row_id"].tolist(), b.labels.tolist(), b.dense_features.sum(dim=1).tolist())}
    assert len(reference) == rows
    for kwargs in ({"pin_memory": True}, {"device": "cuda"}):
        # 64 MiB of slabs: a batch is about 10 MB (a 16 MiB class), so the pool holds four.
        with RemoteDataLoader(spec, num_workers=workers, timeout=120, pin_bytes=64 << 20, **kwargs) as loader:
            for epoch in range(2):
                got = epoch_rows(loader, device="device" in kwargs)
                assert got.keys() == reference.keys(), f"{kwargs} epoch {epoch}: rows missing or extra"
                assert got == reference, f"{kwargs} epoch {epoch}: values differ from the host path"
            stats = loader.pin_stats
            assert stats.merged > 0 and stats.taken == stats.staged
            assert loader.pin_pool.stats.peak_bytes <= loader.pin_pool.max_bytes
            assert loader.pin_pool.stats.reused > 0
