"""The vertical slice on loopback: master, workers, RemoteDataLoader. Exactly once with correct
values, the embedded default, the console scripts and a master without an allowlist run real
processes; the spec and rank semantics run on in-process clusters (tests/cluster.py), the
same code on threads."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pyarrow.orc as orc
import pyarrow.parquet as pq
import pytest

from remoteloader import LocalDataset, RemoteDataLoader, SpecError
from remoteloader.protocol.rpc import MasterUnavailable
from tests.conftest import BIN, ROWS, master_status, spec_dict, wait_gone
from tests.transforms_reference import sigrid_hash as ref_sigrid_hash


def read_reference(table: Path, partitions=None) -> dict[int, dict]:
    """What the spec of ``spec_dict`` must yield per row_id, computed from pyarrow's own read."""
    rows = {}
    for f in sorted(table.rglob("*.orc")) + sorted(table.rglob("*.parquet")):
        if partitions and f.parent.name not in partitions:
            continue
        t = orc.read_table(f) if f.suffix == ".orc" else pq.read_table(f)
        d = t.to_pydict()
        for i, rid in enumerate(d["row_id"]):
            f0, f1 = d["float_0"][i], d["float_1"][i]
            rows[rid] = {
                "label": d["label"][i],
                "dense": [0.0 if f0 is None else f0, min(max(0.0 if f1 is None else f1, 0.0), 5.0)],
                "s0": (d["idlist_0"][i] or [])[:3],
                "s1": [ref_sigrid_hash(x, 5, 1000) for x in (d["idlist_1"][i] or [])],
            }
    return rows


def collect(batches) -> tuple[dict[int, dict], list[int]]:
    got, sizes = {}, []
    for b in batches:
        sizes.append(len(b))
        s0, s1 = b.sparse_features["s0"].to_dense(), b.sparse_features["s1"].to_dense()
        for i, rid in enumerate(b.passthrough["row_id"].tolist()):
            assert rid not in got, f"row {rid} delivered twice"
            got[rid] = {"label": float(b.labels[i]), "dense": b.dense_features[i].tolist(),
                        "s0": s0[i].tolist(), "s1": s1[i].tolist()}
    return got, sizes


def assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for rid, exp in expected.items():
        g = got[rid]
        assert g["label"] == exp["label"], rid
        assert np.allclose(g["dense"], exp["dense"], rtol=1e-6), rid
        assert g["s0"] == exp["s0"], rid
        assert g["s1"] == exp["s1"], rid


@pytest.mark.parametrize("fmt,workers", [("orc", 1), ("parquet", 2), ("orc", 3)])
def test_every_row_exactly_once_with_correct_values(tables, cluster, fmt, workers):
    master = cluster.master(workers=workers)
    expected = read_reference(tables[fmt])
    assert len(expected) == ROWS
    with RemoteDataLoader(spec_dict(tables[fmt]), master=master.addr, timeout=60) as loader:
        got, sizes = collect(loader)
        assert_same(got, expected)
        assert len(sizes) == len(loader) == math.ceil(ROWS / 256)
        assert all(s == 256 for s in sizes[:-1]) and sizes[-1] == ROWS % 256
        got2, _ = collect(loader)  # the second epoch: again every row once
        assert got2.keys() == expected.keys()


@pytest.mark.slow
def test_partition_filter_and_projection(tables, inprocess):
    master = inprocess(2)
    spec = spec_dict(tables["parquet"], drop_last=True)
    spec["table"]["partitions"] = ["ds=2026-01-02"]
    expected = read_reference(tables["parquet"], partitions={"ds=2026-01-02"})
    assert 0 < len(expected) < ROWS
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        batches = list(loader)
        assert len(batches) == len(loader) == len(expected) // 256
        b = batches[0]
        assert b.dense_features.shape == (256, 2) and b.dense_features.dtype.is_floating_point
        assert b.sparse_features.keys() == ["s0", "s1"]
        assert set(b.passthrough) == {"row_id"}
        got, _ = collect(batches)
    assert set(got) <= set(expected) and len(got) == len(expected) // 256 * 256
    assert_same(got, {k: expected[k] for k in got})


@pytest.mark.slow
def test_two_ranks_disjoint_union_is_epoch(tables, inprocess):
    master = inprocess(2)
    spec = spec_dict(tables["orc"], shuffle=True, seed=3)
    loaders = [RemoteDataLoader(spec, master=master.addr, rank=r, world_size=2, timeout=60) for r in range(2)]
    try:
        for epoch in range(2):
            # Trainers consume in lockstep (as under DDP); a rank that stops reading would
            # eventually fill its workers' buffers.
            its = [iter(x) for x in loaders]
            per_rank = [[], []]
            done = [False, False]
            while not all(done):
                for r in range(2):
                    if not done[r]:
                        try:
                            per_rank[r].append(next(its[r]))
                        except StopIteration:
                            done[r] = True
            sets = []
            for r in range(2):
                got, _ = collect(per_rank[r])
                assert len(per_rank[r]) == len(loaders[r])
                sets.append(set(got))
            assert not sets[0] & sets[1]
            assert sets[0] | sets[1] == set(range(ROWS))
            assert abs(len(sets[0]) - len(sets[1])) <= 1
    finally:
        for x in loaders:
            x.close()


@pytest.mark.slow
def test_local_mode_matches_remote(tables, inprocess):
    import torch

    master = inprocess(2)
    spec = spec_dict(tables["parquet"], shuffle=True)
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        remote, _ = collect(loader)
    local_single, _ = collect(LocalDataset(spec))
    dl = torch.utils.data.DataLoader(LocalDataset(spec), batch_size=None, num_workers=2)
    local_multi, _ = collect(dl)
    expected = read_reference(tables["parquet"])
    assert_same(remote, expected)
    assert_same(local_single, expected)
    assert_same(local_multi, expected)


@pytest.mark.slow
def test_embedded_default_leaves_no_process(tables):
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    loader = RemoteDataLoader(spec_dict(tables["orc"]), num_workers=2, timeout=60)
    spawned = [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in before]
    got, _ = collect(loader)
    assert len(got) == ROWS
    assert spawned
    loader.close()
    wait_gone(spawned)


@pytest.mark.slow
def test_embedded_cluster_dies_with_killed_owner(tables, tmp_path):
    """SIGKILL of the training process must not orphan the master or its workers."""
    script = tmp_path / "owner.py"
    script.write_text(
        "import sys, time, psutil\n"
        "from remoteloader import RemoteDataLoader\n"
        "from tests.conftest import spec_dict\n"
        f"loader = RemoteDataLoader(spec_dict({str(tables['orc'])!r}), num_workers=2)\n"
        "next(iter(loader))\n"
        "print(' '.join(str(c.pid) for c in psutil.Process().children(recursive=True)), flush=True)\n"
        "time.sleep(600)\n")
    root = str(Path(__file__).parent.parent)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root,
                             env={**os.environ, "PYTHONPATH": root})
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) >= 3  # master + 2 workers
    finally:
        owner.kill()
        owner.wait()
    wait_gone(pids)


def test_console_scripts_work_together(tables, tmp_path, cluster):
    """An operator's set-up: master and worker as separate processes, spec given to the master."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec_dict(tables["orc"])))
    master = cluster.master("--spec", str(spec_path), workers=0)
    cluster.workers(master.addr, 2)
    # Both registered before reading: an epoch this small can end before a slow-starting
    # second worker registers, and this test is about the two of them together.
    deadline = time.monotonic() + 60
    while len(master_status(master.addr)["workers"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    with RemoteDataLoader(spec_path, master=master.addr, timeout=60) as loader:
        got, _ = collect(loader)
    assert len(got) == ROWS
    assert len(master_status(master.addr)["workers"]) == 2


@pytest.mark.slow
def test_spec_mismatch_is_refused(tables, inprocess):
    master = inprocess(1)
    with RemoteDataLoader(spec_dict(tables["orc"]), master=master.addr, timeout=60) as loader:
        assert len(loader) > 0
    other = RemoteDataLoader(spec_dict(tables["orc"], batch_size=100), master=master.addr, timeout=60)
    with pytest.raises(RuntimeError, match="fingerprint .* differs"):
        len(other)
    other.close()


def test_a_refused_spec_names_the_keys_that_differ_and_their_values(tables, inprocess):
    master = inprocess(1)
    with RemoteDataLoader(spec_dict(tables["orc"]), master=master.addr, timeout=60) as loader:
        assert len(loader) > 0
        other = RemoteDataLoader(spec_dict(tables["orc"], batch_size=100, seed=3), master=master.addr, timeout=60)
        with pytest.raises(RuntimeError, match=r"in batch_size: 100 here, 256 there; seed: 3 here, 0 there"):
            len(other)
        other.close()


def test_unreachable_master_is_a_clear_error(tables):
    loader = RemoteDataLoader(spec_dict(tables["orc"]), master="tcp://127.0.0.1:9", connect_timeout=0.3)
    with pytest.raises(MasterUnavailable, match="did not answer"):
        next(iter(loader))
    loader.close()


@pytest.mark.slow
def test_bad_column_reaches_the_client_with_its_name(tables, inprocess):
    master = inprocess(1)
    spec = spec_dict(tables["orc"])
    spec["features"]["dense"].append({"name": "ghost", "column": "no_such_column"})
    with pytest.raises(SpecError, match="ghost.*no_such_column"):
        len(RemoteDataLoader(spec, master=master.addr, timeout=60))


@pytest.mark.slow
def test_row_counts_balance_across_many_workers(tables, inprocess):
    master = inprocess(3)
    with RemoteDataLoader(spec_dict(tables["orc"], batch_size=100), master=master.addr, timeout=60) as loader:
        got, sizes = collect(loader)
    assert sorted(got) == list(range(ROWS))
    assert Counter(sizes) == Counter({100: ROWS // 100})


@pytest.mark.slow
def test_master_without_allowlist_serves_no_client_spec(tables):
    proc = subprocess.Popen([str(BIN / "remoteloader-master"), "--bind", "tcp://127.0.0.1:0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        addr = proc.stdout.readline().rsplit(" ", 1)[1].strip()
        with pytest.raises(SpecError, match="table.path: this master does not serve that table"):
            len(RemoteDataLoader(spec_dict(tables["orc"]), master=addr, timeout=30))
    finally:
        proc.kill()
        proc.wait()
        wait_gone([proc.pid])
