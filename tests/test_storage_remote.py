"""Map-column tables through the whole service: the CLI flattens, the spec selects a key
of a map column, and remote workers read both layouts to the same batches."""
from __future__ import annotations

import numpy as np

from remoteloader import LocalDataset, RemoteDataLoader
from remoteloader.tools.cli import main as cli
from tests.test_transforms_remote import by_row


def key(i: int) -> int:
    return 100 + 7 * i  # the generator's map key of feature i (docs/storage.md)


def test_map_columns_remote_equal_flattened(tmp_path, cluster):
    maps, flat = tmp_path / "maps", tmp_path / "flat"
    assert cli(["gen-data", "--out", str(maps), "--rows", "2000", "--dense", "3", "--sparse", "3", "--scored", "1",
                "--layout", "map", "--quiet"]) == 0
    assert cli(["flatten", str(maps), str(flat), "--quiet"]) == 0

    def spec(table, ref):
        return {"table": {"path": str(table)},
                "features": {"label": "label",
                             "dense": [{"name": "d1", "column": ref("float_features", 1)}],
                             "sparse": [{"name": "s2", "column": ref("id_list_features", 2),
                                         "transforms": [{"op": "firstx", "x": 4}]},
                                        {"name": "sc", "column": ref("id_score_list_features", 0)}],
                             "passthrough": ["row_id"]},
                "batch_size": 128, "split_rows": 700}

    map_spec = spec(maps, lambda m, i: {"map": m, "key": key(i)})
    flat_spec = spec(flat, lambda m, i: f"{m}_{key(i)}")
    flat_spec["features"]["sparse"][1] = {"name": "sc", "column": f"id_score_list_features_{key(0)}_ids",
                                          "scores": f"id_score_list_features_{key(0)}_scores"}
    master = cluster.master(workers=2)
    with RemoteDataLoader(map_spec, master=master.addr, timeout=90) as loader:
        remote = by_row(loader)
    local = by_row(LocalDataset(flat_spec))
    assert remote.keys() == local.keys() == set(range(2000))
    for rid, (dense, _, label, lists, weights) in local.items():
        r = remote[rid]
        np.testing.assert_array_equal(r[0], dense)
        assert (r[2], r[3], r[4]) == (label, lists, weights)
    assert any(v[4]["sc"] for v in local.values())
