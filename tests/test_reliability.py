"""Nothing lost, nothing twice: worker SIGKILL, master SIGKILL, hung workers, drain, resume, bad data."""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from remoteloader import RemoteDataLoader, SpecError
from tests.conftest import ROWS, spec_dict
from tests.test_end_to_end import assert_same, collect, read_reference


def test_chaos_worker_sigkill_exactly_once(tables, cluster):
    """20 seeded trials: each epoch kills 1-2 random workers at random moments."""
    expected = read_reference(tables["orc"])
    master = cluster.master("--heartbeat-timeout", "1", workers=3)
    rng = random.Random(2026)
    spec = spec_dict(tables["orc"], shuffle=True, batch_size=128, split_rows=600)
    with RemoteDataLoader(spec, master=master.addr, timeout=90, inflight=1) as loader:
        n = len(loader)
        for trial in range(20):
            kill_at = sorted(rng.sample(range(1, n), rng.randint(1, 2)))
            batches = []
            for i, b in enumerate(loader):
                batches.append(b)
                if kill_at and i == kill_at[0]:
                    kill_at.pop(0)
                    victims = master.worker_pids()
                    if victims:
                        with contextlib.suppress(ProcessLookupError):  # it exited since it was listed
                            os.kill(rng.choice(victims), signal.SIGKILL)
            got, sizes = collect(batches)
            assert_same(got, expected)
            assert len(sizes) == n, f"trial {trial}"


def test_master_sigkill_with_journal_resumes_the_epoch(tables, tmp_path, cluster):
    journal = tmp_path / "journal"
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec_dict(tables["parquet"], batch_size=100)))
    args = ("--journal", str(journal), "--heartbeat-timeout", "3")
    master = cluster.master(*args, workers=0)
    cluster.workers(master.addr, 2)
    with RemoteDataLoader(spec_path, master=master.addr, timeout=120) as loader:
        batches = []
        for i, b in enumerate(loader):
            batches.append(b)
            if i == 15:
                master.kill()
                time.sleep(0.5)
                cluster.master(*args, workers=0, bind=master.addr)
        got, _ = collect(batches)
        assert_same(got, read_reference(tables["parquet"]))
        assert len(batches) == len(loader)
    # The job's projection went into the popularity log kept with the journal.
    logged = json.loads((journal / "popularity.jsonl").read_text().splitlines()[0])
    assert logged["columns"] == ["float_0", "float_1", "idlist_0", "idlist_1", "label", "row_id"]


def test_trainer_keeps_receiving_while_the_master_is_frozen(tables, tmp_path, cluster):
    """Control is off the data path: with the master stopped (SIGSTOP), batches that workers
    hold or can produce from their splits keep coming; after it resumes, the epoch is exact."""
    args = ("--journal", str(tmp_path / "journal"), "--heartbeat-timeout", "30")
    master = cluster.master(*args, workers=0)
    cluster.workers(master.addr, 2, "--buffer-batches", "32")
    with RemoteDataLoader(spec_dict(tables["orc"], batch_size=50), master=master.addr, timeout=120) as loader:
        it = iter(loader)
        batches = [next(it) for _ in range(5)]
        time.sleep(1.0)  # the workers fill their buffers
        os.kill(master.proc.pid, signal.SIGSTOP)
        try:
            frozen = []
            deadline = time.monotonic() + 60  # a generous cap, not a timing claim
            while len(frozen) < 30 and time.monotonic() < deadline:
                frozen.append(next(it))
        finally:
            os.kill(master.proc.pid, signal.SIGCONT)
        assert len(frozen) == 30  # the old client blocked on its first heartbeat to a stopped master
        batches += frozen + list(it)
        got, _ = collect(batches)
        assert sorted(got) == list(range(ROWS))
        assert len(batches) == len(loader)


def test_master_restart_without_journal_still_exactly_once(tables, cluster):
    """The client is the source of truth for what it consumed, so even a fresh master can continue."""
    master = cluster.master("--heartbeat-timeout", "3", workers=0)
    cluster.workers(master.addr, 2)
    with RemoteDataLoader(spec_dict(tables["orc"], batch_size=100), master=master.addr, timeout=120) as loader:
        batches = []
        for i, b in enumerate(loader):
            batches.append(b)
            if i == 10:
                master.kill()
                cluster.master("--heartbeat-timeout", "3", workers=0, bind=master.addr)
        got, _ = collect(batches)
        assert sorted(got) == list(range(ROWS))


def test_hung_worker_loses_its_split(tables, cluster):
    """A worker that heartbeats but stops producing gives its split back after --split-timeout."""
    master = cluster.master("--split-timeout", "2", "--heartbeat-timeout", "5", workers=0)
    cluster.workers(master.addr, 1, "--inject-hang-after", "2")
    with RemoteDataLoader(spec_dict(tables["orc"], batch_size=100), master=master.addr, timeout=120) as loader:
        it = iter(loader)
        batches = [next(it)]
        cluster.workers(master.addr, 1)  # joins after the hung one took a split
        batches += list(it)
        got, _ = collect(batches)
        assert sorted(got) == list(range(ROWS))


def test_sigterm_drains_a_worker_without_loss(tables, cluster):
    master = cluster.master("--heartbeat-timeout", "5", workers=0)
    workers = cluster.workers(master.addr, 2, "--buffer-batches", "4")
    with RemoteDataLoader(spec_dict(tables["orc"], batch_size=64), master=master.addr, timeout=120) as loader:
        batches = []
        for i, b in enumerate(loader):
            batches.append(b)
            if i == 5:
                workers[0].send_signal(signal.SIGTERM)
        got, _ = collect(batches)
        assert sorted(got) == list(range(ROWS))
    assert workers[0].wait(30) == 0  # it left by itself once drained


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_at_random_points_repeatedly(tables, inprocess, world_size):
    """Checkpoint at random batches, restore in a fresh loader (and a new worker count): exactly once."""
    rng = random.Random(world_size)
    expected = set(range(ROWS))
    spec = spec_dict(tables["orc"], shuffle=True, batch_size=100)
    m1 = inprocess(2)
    m2 = inprocess(3)
    for epoch_trial in range(2):
        seen = [set() for _ in range(world_size)]
        states = [None] * world_size
        for hop, master in enumerate([m1, m2, m1]):  # two resumes, alternating worker counts
            loaders = [RemoteDataLoader(spec, master=master.addr, rank=r, world_size=world_size, timeout=90)
                       for r in range(world_size)]
            try:
                for r, loader in enumerate(loaders):
                    if states[r] is not None:
                        buf = io.BytesIO()
                        torch.save(states[r], buf)
                        buf.seek(0)
                        loader.load_state_dict(torch.load(buf))
                its = [iter(x) for x in loaders]
                stop_after = rng.randint(1, 12) if hop < 2 else None
                live = list(range(world_size))
                count = 0
                while live:
                    for r in list(live):
                        try:
                            b = next(its[r])
                        except StopIteration:
                            live.remove(r)
                            continue
                        ids = set(b.passthrough["row_id"].tolist())
                        assert not ids & seen[r]
                        seen[r] |= ids
                    count += 1
                    if stop_after is not None and count >= stop_after:
                        states = [x.state_dict() for x in loaders]
                        break
            finally:
                for x in loaders:
                    x.close()
        assert not (world_size == 2 and seen[0] & seen[1])
        assert set().union(*seen) == expected, f"trial {epoch_trial}"


def corrupt_copy(src: Path, dst: Path, how: str) -> None:
    import shutil

    shutil.copytree(src, dst)
    victim = sorted(dst.rglob("*.orc"))[1]
    data = victim.read_bytes()
    if how == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:  # garble the middle of the file, keep the footer: decoding fails, listing works
        mid = len(data) // 3
        victim.write_bytes(data[:mid] + bytes(4096) + data[mid + 4096:])


@pytest.mark.slow
def test_corrupt_file_fails_naming_the_file(tables, tmp_path, inprocess):
    table = tmp_path / "bad"
    corrupt_copy(tables["orc"], table, "garble")
    master = inprocess(2)
    with RemoteDataLoader(spec_dict(table), master=master.addr, timeout=60) as loader:
        with pytest.raises(RuntimeError, match=r"part-00001\.orc"):
            list(loader)


@pytest.mark.slow
def test_corrupt_file_skipped_with_on_error_skip(tables, tmp_path, inprocess):
    table = tmp_path / "bad"
    corrupt_copy(tables["orc"], table, "garble")
    master = inprocess(2)
    with RemoteDataLoader(spec_dict(table, on_error="skip"), master=master.addr, timeout=60) as loader:
        with pytest.warns(RuntimeWarning, match=r"skipped .*part-00001\.orc"):
            got, _ = collect(loader)
        assert 0 < len(got) < ROWS
        assert loader.warnings


def retyped_partition(src: Path, dst: Path) -> Path:
    """A copy of the table whose second partition stores float_1 as strings."""
    import shutil

    import pyarrow as pa
    import pyarrow.orc as orc

    shutil.copytree(src, dst)
    victim = sorted((dst / "ds=2026-01-02").glob("*.orc"))[0]
    t = orc.read_table(victim)
    t = t.set_column(t.schema.get_field_index("float_1"), "float_1", t.column("float_1").cast(pa.string()))
    orc.write_table(t, victim)
    return victim


@pytest.mark.slow
def test_partition_schema_disagreement_fails_naming_file_and_column(tables, tmp_path, inprocess):
    victim = retyped_partition(tables["orc"], tmp_path / "t")
    master = inprocess(1)
    loader = RemoteDataLoader(spec_dict(tmp_path / "t"), master=master.addr, timeout=60)
    with pytest.raises(SpecError, match=rf"float_1.*{victim.name}|{victim.name}.*float_1"):
        len(loader)
    loader.close()


@pytest.mark.slow
def test_partition_schema_disagreement_skipped_and_reported(tables, tmp_path, inprocess):
    victim = retyped_partition(tables["orc"], tmp_path / "t")
    master = inprocess(2)
    with RemoteDataLoader(spec_dict(tmp_path / "t", on_error="skip"), master=master.addr, timeout=60) as loader:
        with pytest.warns(RuntimeWarning, match=victim.name):
            got, _ = collect(loader)
        assert 0 < len(got) < ROWS
    # A column the spec does not read may differ freely: nothing is skipped then.
    spec = spec_dict(tmp_path / "t")
    spec["features"]["dense"] = ["float_0"]
    with RemoteDataLoader(spec, master=inprocess(1).addr, timeout=60) as loader:
        assert sum(len(b) for b in loader) == ROWS


def linked_copy(table: Path, to: Path) -> Path:
    """A copy of ``table`` made of symlinks to its files, whose last file's link dangles,
    beside a file of another format (notes.txt)."""
    files = sorted(p for p in table.rglob("*.orc"))
    for f in files:
        dest = to / f.relative_to(table)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.symlink_to(f)
    victim = to / files[-1].relative_to(table)
    victim.unlink()
    victim.symlink_to(to / "gone.orc")
    (to / files[0].relative_to(table)).parent.joinpath("notes.txt").write_text("x")
    return victim


def test_a_dangling_link_among_the_data_files_is_an_error_naming_it_or_skipped_and_reported(tables, tmp_path,
                                                                                             inprocess):
    # Issue 38: pyarrow leaves a dangling symlink out of a listing without a word, and the
    # epoch delivered 4,000 rows of a 5,000-row table.
    from remoteloader.core.binding import bind
    from remoteloader.formats import Skipped, TableError, list_table
    from remoteloader.spec import load_spec

    victim = linked_copy(tables["orc"], tmp_path / "t")
    with pytest.raises(TableError, match=rf"{victim.name}: a dangling symlink"):
        list_table(str(tmp_path / "t"))
    with pytest.raises(SpecError, match=rf"{victim.name}: a dangling symlink .*on_error: skip"):
        bind(load_spec(spec_dict(tmp_path / "t")))
    left_out = Skipped()
    list_table(str(tmp_path / "t"), skipped=left_out)
    assert [u.split(": ")[0] for u in left_out.unreadable] == [str(victim)]
    assert any("notes.txt: not a orc file" in u for u in left_out.ignored)
    bound = bind(load_spec(spec_dict(tmp_path / "t", on_error="skip")))
    assert any(victim.name in s for s in bound.skipped) and any("notes.txt" in s for s in bound.ignored)
    with RemoteDataLoader(spec_dict(tmp_path / "t", on_error="skip"), master=inprocess(1).addr, timeout=60) as loader:
        with pytest.warns(RuntimeWarning, match=victim.name):
            got, _ = collect(loader)
        assert 0 < len(got) < ROWS
