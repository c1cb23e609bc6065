"""Two tables mixed 3:1 (spec ``tables``) through the loader on 2 ranks: every full batch holds
exactly 48 rows of the first table and 16 of the second (batch 64), each table is read exactly
once (``when_done: drop``), or the second in whole passes (``restart``); the renamed column
comes from the table's own column; the sequences are the same with 1, 2 (real processes)
and 4 workers, through a worker SIGKILLed mid-epoch, through a master SIGKILLed mid-epoch
and restarted on its journal, through a state_dict() (each rank's part, and the job's
position as DCP saves it), and from LocalDataset whatever its DataLoader workers; a DCP
position of 2 ranks resumes exactly once on 1 and on 3; validate and status show the mix."""
from __future__ import annotations

import json
import os
import signal
from collections import Counter
from types import SimpleNamespace

import pytest

from remoteloader import LocalDataset, RemoteDataLoader
from remoteloader.client import local, resume
from tests.conftest import master_status, spec_dict
from tests.test_order import consume, digest, stopped_mid_epoch

pytestmark = pytest.mark.slow
A_ROWS, B_ROWS, B_FIRST = 3000, 1000, 10**6  # table b's row ids start at B_FIRST
BATCH = 64


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    from remoteloader.tools.datagen import generate_table

    root = tmp_path_factory.mktemp("mixed")
    for name, rows, seed, first in (("a", A_ROWS, 7, 0), ("b", B_ROWS, 8, B_FIRST)):
        generate_table(str(root / name), rows=rows, partitions=2, dense=4, sparse=4, format="parquet", seed=seed,
                       row_group_rows=100, files_per_partition=2, progress=False, first_row_id=first)
    return root


def mix_spec(root, b_when_done="drop", b_rows=None) -> dict:
    """a and b at 3:1; b names its ``row_id`` column ``ts`` for the job (a renaming to check)."""
    spec = spec_dict(root / "a", shuffle=True, seed=5, split_rows=200, batch_size=BATCH,
                     order={"deterministic": True})
    del spec["table"]
    spec["features"]["passthrough"] = ["row_id", "ts"]
    spec["tables"] = [{"path": str(root / "a"), "weight": 3, "when_done": "drop"},
                      {"path": str(root / "b"), "weight": 1, "when_done": b_when_done, "columns": {"ts": "row_id"},
                       **({"partitions": b_rows} if b_rows else {})}]
    return spec


def checked(per_rank, b_passes=1):
    """Each rank's digests, after checking the shares, the rows of each table and the renaming."""
    assert len({len(b) for b in per_rank}) == 1  # equal batch counts on the ranks
    ids = Counter()
    for batches in per_rank:
        for i, b in enumerate(batches):
            rows = b.passthrough["row_id"].tolist()
            from_b = [r >= B_FIRST for r in rows]
            if i < len(batches) - 1:
                assert (len(rows), sum(from_b)) == (BATCH, 16)  # 3:1 of 64: exact
            ts = b.passthrough["ts"].tolist()
            assert all(t == r for t, r, in_b in zip(ts, rows, from_b) if in_b)  # b's ts is its row_id
            ids.update(rows)
    assert sorted(r for r in ids if r < B_FIRST) == list(range(A_ROWS))  # a: every row exactly once
    b_counts = Counter(n for r, n in ids.items() if r >= B_FIRST)
    if b_passes == 1:
        assert b_counts == {1: B_ROWS}
    else:  # whole passes and a part of the next: every row at least once, no row more than once a pass
        assert sum(b_counts.values()) == B_ROWS and set(b_counts) <= set(range(1, b_passes + 1))
    return [[digest(b) for b in batches] for batches in per_rank]


def run(addr, spec, world=2, before_close=lambda: None, on_batch=None):
    loaders = [RemoteDataLoader(spec, master=addr, rank=r, world_size=world, timeout=90) for r in range(world)]
    try:
        per_rank = consume(loaders, on_batch)
        before_close()
        return per_rank
    finally:
        for x in loaders:
            x.close()


@pytest.fixture(scope="module")
def reference(tables):
    """Each rank's sequence with 2 real worker processes, one SIGKILLed early in the epoch (while
    it holds pieces of both tables the ranks have no credit for yet); and what status says."""
    from tests.conftest import Cluster

    cluster = Cluster()
    try:
        master = cluster.master(workers=2)
        victim, killed, statuses = master.started_worker_pids(2)[0], [], []

        def kill(rank, i):
            if rank == 0 and i == 2:
                os.kill(victim, signal.SIGKILL)
                killed.append(i)

        per_rank = run(master.addr, mix_spec(tables), before_close=lambda: statuses.append(master_status(master.addr)),
                       on_batch=kill)
        assert killed
        status = statuses[0]
    finally:
        cluster.stop()
    return SimpleNamespace(sequences=checked(per_rank), status=status)


def test_validate_shows_what_an_epoch_of_the_mix_reads(tables, tmp_path, capsys):
    from remoteloader.tools.cli import main

    path = tmp_path / "mix.json"
    path.write_text(json.dumps(mix_spec(tables)))
    assert main(["validate", str(path), "--json"]) == 0
    mix = json.loads(capsys.readouterr().out)["mix"]
    assert [(t["rows"], t["rows_per_batch"], t["rows_per_epoch"], t["columns"]) for t in mix["tables"]] == \
           [(A_ROWS, 48, A_ROWS, {}), (B_ROWS, 16, B_ROWS, {"ts": "row_id"})]
    full, last = divmod(A_ROWS, 48)  # on one rank: 62 batches of 48 + 16, then 24 + 8
    assert mix["segments"] == [{"first_batch": 0, "batches": full, "rows": [48, 16]},
                               {"first_batch": full, "batches": 1, "rows": [last, B_ROWS - 16 * full]}]
    assert main(["validate", str(path)]) == 0
    assert "tables[1]" in capsys.readouterr().out


def test_the_mix_is_exact_and_status_shows_it(reference):
    mix = reference.status["job"]["mix"]
    assert [t["weight"] for t in mix["tables"]] == [3, 1]
    assert [t["rows_read"] for t in mix["tables"]] == [A_ROWS, B_ROWS]


@pytest.mark.parametrize("workers", [1, 4])
def test_the_mixed_sequence_is_the_same_whatever_the_number_of_workers(tables, inprocess, reference, workers):
    assert checked(run(inprocess(workers).addr, mix_spec(tables))) == reference.sequences


def test_a_restarted_table_is_read_in_whole_passes(tables, inprocess):
    """b is 500 rows (one partition), 250 a rank a pass, restarted while a's 1500 rows a rank take
    32 batches (48 rows each, 12 in the last) with 16 rows of b each: 512 rows, two whole passes
    and 12 rows of a third on each rank."""
    spec = mix_spec(tables, "restart", b_rows=["ds=2026-01-01"])
    per_rank = run(inprocess(2).addr, spec)
    ids = Counter(r for batches in per_rank for b in batches for r in b.passthrough["row_id"].tolist())
    assert sorted(r for r in ids if r < B_FIRST) == list(range(A_ROWS))
    assert Counter(n for r, n in ids.items() if r >= B_FIRST) == {2: 500 - 24, 3: 24}
    for batches in per_rank:
        assert [len(b) for b in batches] == [BATCH] * 31 + [12 + 16]


def test_a_state_dict_continues_the_same_sequence(tables, inprocess, reference):
    master = inprocess(2)
    spec = mix_spec(tables)
    first, parts = stopped_mid_epoch(spec, master.addr, [3, 5])  # ranks stop at other batches

    def resumed_from(state: dict) -> list:
        again = [RemoteDataLoader(spec, master=master.addr, rank=r, world_size=2, timeout=90) for r in range(2)]
        for x in again:
            x.load_state_dict(state)
        # The batches still to come of the epoch: exact from each rank's own part (a job's
        # position counts its consumed rows as spread evenly over the ranks, as DDP saves them).
        lengths = [len(x) for x in again]
        rest = consume(again)
        for x in again:
            x.close()
        assert "version" in state or [len(r) for r in rest] == lengths
        return [f + r for f, r in zip(first, rest)]

    assert checked(resumed_from(parts)) == reference.sequences  # each rank's own part
    # The job's position (what DCP saves under torch.distributed), on the same world size: in place.
    assert checked(resumed_from(resume.job_position(resume.rank_parts(parts)))) == reference.sequences


def exactly_once_in_shares(per_rank) -> None:
    """Every row of each table once, and each rank's batches in shares of 48 and 16 rows but
    its last and at most one other (where a table runs out, what it has left)."""
    rows = [r for batches in per_rank for b in batches for r in b.passthrough["row_id"].tolist()]
    assert sorted(rows) == list(range(A_ROWS)) + list(range(B_FIRST, B_FIRST + B_ROWS))
    for batches in per_rank:
        other = [(len(b), int((b.passthrough["row_id"] >= B_FIRST).sum())) for b in batches[:-1]]
        assert sum(1 for shares in other if shares != (BATCH, 16)) <= 1 and all(n == BATCH for n, _ in other)


def test_a_dcp_position_of_2_ranks_resumes_exactly_once_on_1_and_on_3(tables, cluster, tmp_path):
    """Checkpointed mid-epoch on 2 ranks (the job's position, through DCP's files): on 1 rank
    and on 3, the rest of each table's pass is dealt to the new ranks, every row once."""
    import torch.distributed.checkpoint as dcp

    master = cluster.master(workers=2)
    spec = mix_spec(tables)
    first, parts = stopped_mid_epoch(spec, master.addr, [9, 13])  # ranks stop at other batches
    position = resume.job_position(resume.rank_parts(parts))
    dcp.save({"loader": position}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    saved = resume.read_rank_states(tmp_path / "ckpt", "loader")
    assert saved["done"] == position["done"]
    for world in (1, 3):
        again = [RemoteDataLoader(spec, master=master.addr, rank=r, world_size=world, timeout=90)
                 for r in range(world)]
        for x in again:
            x.load_state_dict(saved)
        with pytest.raises(TypeError, match="known once that epoch has started"):
            len(again[0])  # the master composes the resumed epoch from what each new rank has left
        rest = consume(again)
        for x in again:
            x.close()
        assert len({len(batches) for batches in rest}) == 1  # even_batches: equal counts on the new ranks
        exactly_once_in_shares([first[0] + first[1], *rest])


def test_a_master_sigkilled_mid_epoch_and_restarted_on_its_journal_keeps_the_mix_exact(tables, cluster, tmp_path):
    """The restarted master replays the mixed plan and what was consumed: each table once, the
    same sequences as without the kill (LocalDataset's, the reference's: see the test below)."""
    args = ("--journal", str(tmp_path / "journal"))
    master = cluster.master(*args, workers=2)
    spec, restarted = mix_spec(tables), []

    def kill(rank: int, i: int) -> None:
        if rank == 1 and i == 10 and not restarted:
            master.kill()
            restarted.append(cluster.master(*args, workers=2, bind=master.addr))

    per_rank = run(master.addr, spec, on_batch=kill)
    assert restarted
    assert checked(per_rank) == checked([list(LocalDataset(spec, rank=r, world_size=2)) for r in range(2)])


def test_local_dataset_yields_the_same_sequence_whatever_its_dataloader_workers(tables, reference, monkeypatch):
    spec = mix_spec(tables)
    assert checked([list(LocalDataset(spec, rank=r, world_size=2)) for r in range(2)]) == reference.sequences
    per_rank = []
    for r in range(2):
        batches = []
        for shard in range(3):  # what each of 3 DataLoader workers would yield, in turn
            monkeypatch.setattr(local, "get_worker_info", lambda s=shard: SimpleNamespace(id=s, num_workers=3))
            batches += list(LocalDataset(spec, rank=r, world_size=2))
        per_rank.append(batches)
    assert checked(per_rank) == reference.sequences


def test_a_renamed_label_is_what_sampling_the_size_estimate_and_the_batches_read(tables):
    """b's label is its float_3 column: sampling by label reads it there, as do the master's
    size estimate and the workers (here LocalDataset, the same processor)."""
    from remoteloader.core.binding import bind
    from remoteloader.core.sampling import plan_job_splits
    from remoteloader.core.sizing import row_bytes
    from remoteloader.spec import DatasetSpec

    spec = mix_spec(tables)
    spec["tables"][1]["columns"] = {"ts": "row_id", "label": "float_3"}
    spec["features"]["passthrough"].append("float_3")
    spec["sampling"] = {"rate": 0.5, "seed": 1, "label_value": 0}
    bound = bind(DatasetSpec.from_dict(spec))
    assert row_bytes(bound) > 0
    kept = sum(s.rows for s in plan_job_splits(bound))
    batches = list(LocalDataset(spec))
    rows = [r for b in batches for r in b.passthrough["row_id"].tolist()]
    assert 0 < kept < A_ROWS + B_ROWS and len(rows) == len(set(rows)) == kept  # drop, drop: every kept row once
    for b in batches:
        in_b = b.passthrough["row_id"] >= B_FIRST
        assert (b.labels[in_b] == b.passthrough["float_3"][in_b].float()).all()
