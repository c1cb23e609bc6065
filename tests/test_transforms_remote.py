"""Every operator, and table-level sampling, through remote workers (an in-process cluster: the
wire and the worker's pipeline as in a worker process): equal to local mode."""
from __future__ import annotations

import numpy as np
import pytest

from remoteloader import LocalDataset, RemoteDataLoader
from remoteloader.tools.datagen import generate_table
from remoteloader.transforms import sampling_keep

ROWS = 3000


@pytest.fixture(scope="module")
def scored_table(tmp_path_factory):
    path = tmp_path_factory.mktemp("scored") / "t"
    generate_table(str(path), rows=ROWS, partitions=2, dense=4, sparse=4, scored=1, format="parquet", seed=5,
                   row_group_rows=400, progress=False)
    return path


def every_op_spec(table) -> dict:
    return {
        "table": {"path": str(table)},
        "features": {
            "label": "label",
            "dense": [
                {"name": "d_clamp", "column": "float_0", "transforms": [{"op": "clamp", "min": 0.0, "max": 5.0}]},
                {"name": "d_boxcox", "column": "float_1", "transforms": [{"op": "boxcox", "lambda1": 0.5, "lambda2": 1.0}]},
                {"name": "d_logit", "column": "float_2",
                 "transforms": [{"op": "clamp", "min": 0.0, "max": 1.0}, {"op": "logit"}]},
                {"name": "d_onehot", "column": "float_3", "transforms": [{"op": "onehot", "borders": [0.1, 1.0, 10.0]}]},
                {"name": "d_bucket", "column": "float_0", "transforms": [{"op": "bucketize", "borders": [0.5, 1.0, 2.0]}]},
                {"name": "d_hour", "column": "ts", "transforms": [{"op": "get_local_hour", "tz_offset_seconds": 3600}]},
                {"name": "d_fill", "column": "float_2", "transforms": [{"op": "fill_null", "value": -1.0}]},
                {"name": "d_mod", "column": "row_id", "transforms": [{"op": "positive_modulus", "modulus": 7}]},
                {"name": "d_hash", "column": "row_id", "transforms": [{"op": "sigrid_hash", "salt": 1, "max_value": 50}]},
                {"name": "d_jaccard", "inputs": ["s_first", "idlist_1"], "transforms": [{"op": "compute_score", "kind": "jaccard"}]},
                {"name": "d_overlap", "inputs": ["idlist_0", "s_first"], "transforms": [{"op": "compute_score", "kind": "has_overlap"}]},
                {"name": "d_cosine", "inputs": ["s_scored", "s_scored"], "transforms": [{"op": "compute_score", "kind": "cosine"}]},
            ],
            "sparse": [
                {"name": "s_first", "column": "idlist_0", "transforms": [{"op": "firstx", "x": 5}]},
                {"name": "s_hash", "column": "idlist_1", "transforms": [{"op": "sigrid_hash", "salt": 9, "max_value": 1000}]},
                {"name": "s_bucket", "column": "idlist_2", "transforms": [{"op": "bucketize", "borders": [1000, 1000000]}]},
                {"name": "s_map", "column": "idlist_3", "transforms": [{"op": "map_id", "mapping": {1: 10, 2: 20}, "default": 0}]},
                {"name": "s_mod", "column": "idlist_0", "transforms": [{"op": "positive_modulus", "modulus": 1000}]},
                {"name": "s_enum", "column": "idlist_1", "transforms": [{"op": "enumerate", "start": 1}]},
                {"name": "s_inter", "inputs": ["idlist_0", "s_first"], "transforms": [{"op": "id_list_intersect"}]},
                {"name": "s_cart", "inputs": ["s_first", "s_first"], "transforms": [{"op": "cartesian", "max_value": 1000}]},
                {"name": "s_ngram", "column": "idlist_2", "transforms": [{"op": "ngram", "n": 2, "max_value": 5000}]},
                {"name": "s_scored", "column": "idscore_0", "scores": "idscore_0_scores", "transforms": [{"op": "firstx", "x": 3}]},
                {"name": "s_clamp", "column": "idlist_3", "transforms": [{"op": "clamp", "min": 0, "max": 100000}]},
                {"name": "s_fill", "column": "idlist_2", "transforms": [{"op": "fill_null"}]},
            ],
            "passthrough": ["row_id"],
        },
        "batch_size": 128,
        "split_rows": 500,
        "shuffle": True,
        "sampling": {"rate": 0.5, "seed": 3, "weight": True},
    }


def by_row(batches) -> dict:
    out = {}
    for b in batches:
        kjt = b.sparse_features
        per_key = {k: kjt[k] for k in kjt.keys()}
        lists = {k: jt.to_dense() for k, jt in per_key.items()}
        weights = kjt.weights_or_none()
        wsplit = {}
        if weights is not None:
            lengths = kjt.lengths().view(len(kjt.keys()), -1).sum(1).tolist()
            for k, w in zip(kjt.keys(), weights.split(lengths)):
                wsplit[k] = w.split(per_key[k].lengths().tolist())
        for i, rid in enumerate(b.passthrough["row_id"].tolist()):
            assert rid not in out
            out[rid] = (b.dense_features[i].numpy(), None if b.weights is None else float(b.weights[i]),
                        float(b.labels[i]),
                        {k: v[i].tolist() for k, v in lists.items()},
                        {k: v[i].tolist() for k, v in wsplit.items()})
    return out


@pytest.mark.slow
def test_every_operator_remote_equals_local_with_sampling(scored_table, inprocess):
    spec = every_op_spec(scored_table)
    master = inprocess(2)
    with RemoteDataLoader(spec, master=master.addr, timeout=90) as loader:
        batches = list(loader)
        assert len(batches) == len(loader)
        remote = by_row(batches)
    local = by_row(LocalDataset(spec))
    keep, _ = sampling_keep(np.arange(ROWS), 0.5, 3)
    assert set(remote) == set(local) == set(np.flatnonzero(keep).tolist())
    assert batches[0].dense_features.shape[1] == 11 + 4  # onehot widens d_onehot to 4 columns
    for rid, (dense, weight, label, lists, weights) in local.items():
        r = remote[rid]
        np.testing.assert_array_equal(r[0], dense)
        assert r[1] == weight == 2.0 and r[2] == label
        assert r[3] == lists and r[4] == weights
    assert any(v[3]["s_inter"] for v in local.values()) and any(v[4]["s_scored"] for v in local.values())
