"""Following a growing table, in process: the spec's ``table.follow`` (validated, errors
naming the key), which partitions a stream reads (``until``), what a re-listing finds (new,
changed, removed files), and the master's books: each growth and each window journaled,
applied once and in order, replayed by a restarted master without a growth lost or
repeated; a window waits for data (``waiting``) until the stream ends."""
from __future__ import annotations

import os

import pytest

from remoteloader.core.plan import plan_epoch
from remoteloader.formats import in_stream, list_table, reaches, relist
from remoteloader.master import updates as U
from remoteloader.master.journal import Journal
from remoteloader.master.service import MasterConfig, MasterService
from remoteloader.spec import DatasetSpec, SpecError
from tests.follow_tables import follow_spec, land_partition
from tests.test_master_service import Clock, call, hello, session

HOUR = 3600  # a re-listing interval that never fires on its own: the tests list by hand


@pytest.mark.parametrize("every, seconds", [(60, 60.0), ("60s", 60.0), ("500ms", 0.5), ("5m", 300.0), (" 1h ", 3600.0),
                                            (0.25, 0.25)])
def test_follow_every_takes_seconds_or_a_duration(tmp_path, every, seconds):
    spec = DatasetSpec.from_dict(follow_spec(tmp_path, every=every, until="ds=2/hr=03/"))
    assert spec.table.follow == {"every": seconds, "until": "ds=2/hr=03"}
    assert DatasetSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("follow, error", [
    ({}, "table.follow.every: required key is missing"),
    ({"every": "soon"}, "table.follow.every: 'soon' is not a duration"),
    ({"every": True}, "table.follow.every: expected a duration"),
    ({"every": 0.001}, "table.follow.every: 0.001 s is not between"),
    ({"every": "30d"}, "table.follow.every: '30d' is not a duration"),
    ({"every": 60, "until": ""}, "table.follow.until: expected a non-empty string"),
    ({"every": 60, "until": "ds=1/../x"}, "table.follow.until: 'ds=1/../x' is not a partition path"),
    ({"every": 60, "until": 3}, "table.follow.until: expected a non-empty string"),
    ({"every": 60, "since": "ds=1"}, "table.follow.since: unknown key"),
    ([60], "table.follow: expected a mapping"),
])
def test_follow_errors_name_the_key(tmp_path, follow, error):
    spec = follow_spec(tmp_path)
    spec["table"]["follow"] = follow
    with pytest.raises(SpecError, match=error):
        DatasetSpec.from_dict(spec)


def test_a_fixed_table_keeps_its_fingerprint(tmp_path):
    fixed = follow_spec(tmp_path)
    del fixed["table"]["follow"]
    spec = DatasetSpec.from_dict(fixed)
    assert "follow" not in spec.to_dict()["table"]
    assert spec.fingerprint() != DatasetSpec.from_dict(follow_spec(tmp_path)).fingerprint()


def test_until_reads_partitions_up_to_and_including_it():
    assert in_stream("ds=1", "ds=2") and in_stream("ds=2/hr=23", "ds=2") and not in_stream("ds=3/hr=00", "ds=2")
    assert in_stream("ds=2/hr=03", "ds=2/hr=03") and not in_stream("ds=2/hr=04", "ds=2/hr=03")
    assert in_stream("", "ds=1") and in_stream("ds=9", None)
    assert reaches("ds=2/hr=00", "ds=2") and not reaches("ds=1", "ds=2") and not reaches("ds=2", None)


def test_relisting_finds_new_files_and_reports_changed_and_removed_ones(tmp_path):
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 300, files=3)
    known = {f.path: f for f in list_table(str(table))}
    land_partition(table, "ds=2", 300, 200)
    land_partition(table, "ds=3", 500, 100)
    first, second, third = sorted(known)
    os.remove(second)
    with open(third, "ab") as f:  # appended to: another size, another change time
        f.write(b"x")
    found = relist(str(table), "parquet", None, known, keep=lambda partition: in_stream(partition, "ds=2"))
    assert [f.partition for f in found.new] == ["ds=2"] and found.new[0].num_rows == 200
    assert found.removed == [f"{second}: removed after it was listed"]
    assert len(found.changed) == 1 and found.changed[0].startswith(f"{third}: changed after it was listed (listed with size")


def test_a_window_plans_its_own_base_splits_by_id(tmp_path):
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 1000)
    service = MasterService(MasterConfig(), None, Clock())
    service.submit(DatasetSpec.from_dict(follow_spec(table, every=HOUR)))
    job = service.state.job
    splits = job.splits
    window = plan_epoch(splits[1:3], 1, seed=3, shuffle=True, world_size=2)
    assert sorted({s.base for s in window}) == [1, 2] and sum(s.rows for s in window) == splits[1].rows + splits[2].rows


def grow(service: MasterService) -> None:
    """One re-listing, committed as the loop's tick commits it (and made durable)."""
    service.runtime[service.state.job.fingerprint].follower.relist_once()
    service.tick()
    service.sync()


def start(service: MasterService, epoch: int) -> tuple[str, dict]:
    reply = call(service, "start_epoch", session=session(service), epoch=epoch, consumed=[], done=[])
    service.sync()  # as the loop does before it replies
    return reply


def rows(epoch: dict) -> int:
    """Rows of an ``epoch`` reply's splits (each ``[id, rows, base, row_lo, padding]``)."""
    return sum(split[1] for split in epoch["splits"])


def test_growths_and_windows_are_journaled_once_and_replayed(tmp_path):
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 1000, files=2)
    spec = DatasetSpec.from_dict(follow_spec(table, every=HOUR, until="ds=3"))
    clock = Clock()
    service = MasterService(MasterConfig(), Journal(tmp_path / "journal"), clock)
    service.submit(spec)
    assert hello(service, spec)[0] == "welcome"
    plan = service.state.job.plan_fingerprint
    t, epoch0 = start(service, 0)
    assert t == "epoch" and rows(epoch0) == 1000
    t, reply = start(service, 1)  # nothing landed since window 0: the client is told to wait
    assert (t, reply["code"]) == ("error", "waiting") and "no new data" in reply["message"]
    assert start(service, 3)[1]["code"] == "bad_epoch"  # windows open in order
    land_partition(table, "ds=2", 1000, 700, files=2)
    grow(service)
    grow(service)  # listed again: nothing new, nothing committed
    t, epoch1 = start(service, 1)
    assert t == "epoch" and rows(epoch1) == 700
    job = service.state.job
    assert len(job.files) == 4 and job.plan_fingerprint == plan  # the plan a checkpoint is of stays
    assert {job.splits[base].file for _, _, base, *_ in epoch1["splits"]} == {2, 3}

    # A master restarted on its journal has both growths' files once, and window 1 as it was;
    # its follower lists from there: ds=3 is added once, and the stream ends.
    restarted = MasterService(MasterConfig(), Journal(tmp_path / "journal"), clock)
    job = restarted.state.job
    assert len(job.files) == 4 and job.windows == {0: (0, 4), 1: (4, len(job.splits))}
    land_partition(table, "ds=3", 1700, 300)
    grow(restarted)
    job = restarted.state.job
    assert len(job.files) == 5 and job.ended and job.total_rows == 2000
    assert restarted.runtime[job.fingerprint].follower is None  # ended: nothing more is listed
    follow = restarted.status()["jobs"][0]["follow"]
    assert follow["watermark"] == "ds=3" and follow["waiting_rows"] == 300 and follow["ended"]
    records = [type(u.update).__name__ for u in Journal(tmp_path / "journal").replay() if isinstance(u, U.ForJob)]
    assert records.count("TableGrew") == 2 and records.count("WindowOpened") == 2


def test_a_growth_or_window_out_of_order_is_refused(tmp_path):
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 500)
    service = MasterService(MasterConfig(), None, Clock())
    service.submit(DatasetSpec.from_dict(follow_spec(table, every=HOUR)))
    st = service.state
    with pytest.raises(ValueError, match="a growth from file 0"):
        st.apply(U.TableGrew(0, 0, [], [], [], False))
    with pytest.raises(ValueError, match="does not follow the job's windows"):
        st.apply(U.WindowOpened(1, 0, 1))
    with pytest.raises(ValueError, match="does not follow the job's windows"):
        st.apply(U.WindowOpened(0, 0, len(st.job.splits) + 1))


def test_a_snapshot_keeps_the_stream(tmp_path):
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 500)
    service = MasterService(MasterConfig(), None, Clock())
    spec = DatasetSpec.from_dict(follow_spec(table, every=HOUR))
    service.submit(spec)
    hello(service, spec)
    start(service, 0)
    land_partition(table, "ds=2", 500, 400)
    grow(service)
    snapshot = U.decode(U.encode(service.fleet.snapshot()))
    restored = MasterService(MasterConfig(), None, Clock())
    restored.fleet.apply(snapshot)
    job, before = restored.state.job, service.state.job
    assert (job.listed, job.windows, job.ended, len(job.files)) == (before.listed, before.windows, False, 2)
    assert job.plan_fingerprint == before.plan_fingerprint


def test_a_following_spec_refuses_a_single_file_and_local_mode(tmp_path):
    from remoteloader import LocalDataset
    from remoteloader.core.binding import bind

    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 100)
    single = follow_spec(table / "ds=1" / "part-00000.parquet")
    with pytest.raises(SpecError, match="table.follow: .* is a single file"):
        bind(DatasetSpec.from_dict(single))
    with pytest.raises(SpecError, match="table.follow: a LocalDataset reads a fixed table"):
        LocalDataset(follow_spec(table))


def test_validate_and_status_show_what_a_stream_reads(tmp_path, capsys):
    import json

    import yaml

    from remoteloader.tools.cli import follow_line, main

    table = tmp_path / "t"
    for i, (first, rows) in enumerate([(0, 500), (500, 300), (800, 300)]):
        land_partition(table, f"ds={i + 1}", first, rows)
    spec = follow_spec(table, every="30s", until="ds=2")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["validate", str(tmp_path / "spec.yaml"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["partitions"] == ["ds=1", "ds=2"] and report["rows"] == 800
    assert report["follow"] == {"every_s": 30.0, "until": "ds=2", "watermark": "ds=2", "ends_at_once": True,
                                "after_until": ["ds=3"]}

    service = MasterService(MasterConfig(), None, Clock())
    service.submit(DatasetSpec.from_dict(follow_spec(table, every=HOUR)))
    hello(service, DatasetSpec.from_dict(follow_spec(table, every=HOUR)))
    start(service, 0)
    line = follow_line(service.status()["jobs"][0])
    assert line.startswith(f"follow {service.state.job.fingerprint}: watermark ds=3, 3 files; window 0: 1,100 rows, "
                           "0 rows waiting for the next")


def test_workers_read_ahead_into_the_next_window_once_data_has_landed(tmp_path):
    """With window 0 all handed out, a worker asking for more opens window 1 early (if data
    landed) and reads ahead into it, as into a fixed table's next epoch; with nothing
    landed it gets no split, and no window is opened."""
    from tests.test_master_service import register

    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 600)
    spec = DatasetSpec.from_dict(follow_spec(table, every=HOUR))
    service = MasterService(MasterConfig(), None, Clock())
    service.submit(spec)
    (worker,) = register(service)
    hello(service, spec)
    start(service, 0)
    job = service.state.job
    for _ in range(len(job.splits)):
        assert call(service, "get_split", worker_id=worker, read_ahead=False)[0] == "split"
    assert call(service, "get_split", worker_id=worker)[0] == "no_split" and list(job.windows) == [0]
    land_partition(table, "ds=2", 600, 300)
    grow(service)
    t, reply = call(service, "get_split", worker_id=worker)
    assert t == "split" and reply["split"]["epoch"] == 1 and reply["split"]["file"]["partition"] == "ds=2"
    assert job.windows[1] == (job.windows[0][1], len(job.splits))
    t, epoch1 = start(service, 1)  # the trainer's start takes the window (and the run) workers began
    assert t == "epoch" and rows(epoch1) == 300


def test_a_relisting_that_fails_is_reported_and_the_next_one_goes_on(tmp_path):
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 300)
    service = MasterService(MasterConfig(), None, Clock())
    service.submit(DatasetSpec.from_dict(follow_spec(table, every=HOUR)))
    follower = service.runtime[service.state.job.fingerprint].follower
    os.rename(table, tmp_path / "away")  # the table is briefly gone (a remount, a permission flap)
    follower.relist_once()
    assert "cannot list table path" in follower.stats.error and not follower.take()
    assert "cannot list table path" in service.status()["jobs"][0]["follow"]["error"]
    os.rename(tmp_path / "away", table)
    land_partition(table, "ds=2", 300, 200)
    grow(service)
    assert follower.stats.error is None and len(service.state.job.files) == 2


def test_a_following_job_on_a_shared_fleet_keeps_its_stream_and_its_follower_stops_with_it(tmp_path):
    """A shared master (several jobs, a journal): a growth reaches the following job alone, a
    compacted journal restarts it with its follower, and the follower stops when the job
    ends to make room for another, and when the master closes."""
    from tests.test_fleet import joined

    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 600)
    following = DatasetSpec.from_dict(follow_spec(table, every=HOUR))
    fixed = DatasetSpec.from_dict({**follow_spec(table), "table": {"path": str(table)}})
    other = DatasetSpec.from_dict({**follow_spec(table), "table": {"path": str(table)}, "batch_size": 64})
    config = MasterConfig(max_jobs=2)
    live = MasterService(config, Journal(tmp_path / "journal"), Clock())
    for spec, name in ((following, "f"), (fixed, "x")):
        live.submit(spec)
        assert hello(live, spec, client=f"{name}0")[0] == "welcome"
        assert call(live, "start_epoch", session=session(live, f"{name}0"), epoch=0)[0] == "epoch"
    fp = following.fingerprint()
    assert live.runtime[fixed.fingerprint()].follower is None
    land_partition(table, "ds=2", 600, 300)
    live.runtime[fp].follower.relist_once()
    live.tick()
    live.sync()
    assert len(live.fleet.jobs[fp].job.files) == 2 and len(live.fleet.jobs[fixed.fingerprint()].job.files) == 1
    live.journal.compact(live.fleet.snapshot())
    live.close()
    assert not live.runtime[fp].follower.running
    live.journal.close()

    restarted = MasterService(config, Journal(tmp_path / "journal"), Clock())
    job = restarted.fleet.jobs[fp].job
    assert len(job.files) == 2 and job.windows == live.fleet.jobs[fp].job.windows
    follower = restarted.runtime[fp].follower
    assert follower.running and restarted.runtime[fixed.fingerprint()].follower is None
    call(restarted, "goodbye", session=session(live, "f0"))
    assert joined(restarted, other, "o0")[0] == "welcome"  # the idle following job gives its place
    assert fp not in restarted.fleet.jobs
    follower.join(5)  # ending the job stopped it (a listing under way finishes first)
    assert not follower.running
    restarted.close()


def test_a_file_rewritten_again_and_again_is_reported_once(tmp_path):
    """Each re-listing sees another size of a file a writer keeps appending to: it is one
    problem, journaled and kept once, not one a listing (the job's errors, its journal and
    its snapshot would grow for as long as the writer writes)."""
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 300)
    service = MasterService(MasterConfig(), Journal(tmp_path / "journal"), Clock())
    service.submit(DatasetSpec.from_dict(follow_spec(table, every=HOUR)))
    (path,) = [f.path for f in service.state.job.files]
    for _ in range(3):
        with open(path, "ab") as f:
            f.write(b"more")
        grow(service)
    problems = [e["message"] for e in service.state.errors if path in e["message"]]
    assert len(problems) == 1 and "changed after it was listed" in problems[0]
    grew = [u for u in Journal(tmp_path / "journal").replay() if isinstance(u, U.ForJob)
            and isinstance(u.update, U.TableGrew)]
    assert len(grew) == 1


@pytest.mark.parametrize("compacted", [False, True])
def test_a_restarted_master_plans_growths_with_the_split_size_the_job_was_planned_with(tmp_path, compacted):
    """Splits cut smaller to fit the workers' buffer (the master's row size estimate, which a
    restart does not redo) stay that small in what lands after a restart: a growth's splits
    are planned as the job's were, whichever master lists them."""
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 600)
    config = MasterConfig(buffer_bytes=8000)  # about 33 B a row: splits of 100 rows, not split_rows 300
    live = MasterService(config, Journal(tmp_path / "journal"), Clock())
    live.submit(DatasetSpec.from_dict(follow_spec(table, every=HOUR)))
    planned = {s.raw_rows for s in live.state.job.splits}
    assert max(planned) < 300
    if compacted:
        live.journal.compact(live.fleet.snapshot())
    live.close()
    live.journal.close()
    restarted = MasterService(config, Journal(tmp_path / "journal"), Clock())
    land_partition(table, "ds=2", 600, 600)
    grow(restarted)
    job = restarted.state.job
    assert len(job.files) == 2 and {s.raw_rows for s in job.splits[len(live.state.job.splits):]} == planned
    restarted.close()


def test_a_stream_whose_until_is_listed_at_bind_has_ended_at_once(tmp_path):
    """The first listing already holds ``until``: its files are the last read (spec.md), so
    the job starts ended: no follower lists the table again (adding what lands meanwhile),
    and the next window is empty at once instead of waiting for a re-listing."""
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 300)
    land_partition(table, "ds=2", 300, 200)
    spec = DatasetSpec.from_dict(follow_spec(table, every=HOUR, until="ds=2"))
    service = MasterService(MasterConfig(), None, Clock())
    service.submit(spec)
    job = service.state.job
    assert job.ended and service.runtime[job.fingerprint].follower is None
    hello(service, spec)
    assert rows(start(service, 0)[1]) == 500
    t, epoch1 = start(service, 1)
    assert t == "epoch" and rows(epoch1) == 0


def test_a_rank_waiting_for_the_next_window_is_not_forgotten(tmp_path):
    """A stream waits for data as long as it takes: each ``waiting`` answer is a sign of life,
    so a rank waiting longer than --client-timeout keeps its session (it was forgotten, its
    one rejoin forgotten again, and the loader failed after twice the timeout)."""
    table = tmp_path / "t"
    land_partition(table, "ds=1", 0, 300)
    spec = DatasetSpec.from_dict(follow_spec(table, every=HOUR))
    clock = Clock()
    service = MasterService(MasterConfig(client_timeout=10.0), None, clock)
    service.submit(spec)
    hello(service, spec)
    start(service, 0)
    for _ in range(6):  # 36 s of waiting, a retry every 6 s
        clock.now += 6.0
        assert start(service, 1)[1]["code"] == "waiting"
        service.tick()
    assert session(service) in service.state.clients
