"""Many jobs on one master (issue 39): FleetState.apply and MasterService in process, on a fake clock."""
from __future__ import annotations

import msgspec
import pytest

from remoteloader.master import updates as U
from remoteloader.master.fleet import FleetState
from remoteloader.master.journal import Journal
from remoteloader.master.service import MasterConfig, MasterService
from remoteloader.master.share import JobShares, effective_weight
from remoteloader.master.state import JobState
from remoteloader.spec import DatasetSpec, SpecError
from tests.conftest import spec_dict
from tests.test_master_service import Clock, call, heartbeat, hello, register, session
from tests.test_master_state import history


@pytest.fixture
def specs(tables) -> list[DatasetSpec]:
    """Three jobs on one table: other batch sizes, so other fingerprints."""
    return [DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=b)) for b in (100, 70, 50)]


def durable(service: MasterService) -> dict:
    """The whole fleet's snapshot, less the times a restart sets afresh (a grace period)."""
    raw = msgspec.to_builtins(service.fleet.snapshot())
    for snap in (raw["workers"], *raw["jobs"]):
        for w in snap["workers"]:
            del w["last_seen"]
        for c in snap["sessions"]:
            del c["seen"]
    return raw


def joined(service: MasterService, spec: DatasetSpec, client: str, rank: int = 0, world_size: int = 1, job: str = ""):
    """hello, again while the master binds the spec on its thread (told ``binding``)."""
    while (answer := hello(service, spec, client, rank, world_size, job))[1].get("code") == "binding":
        pass
    return answer


def start(service: MasterService, spec: DatasetSpec, name: str, world_size: int, job: str = "") -> None:
    for rank in range(world_size):
        t, reply = joined(service, spec, f"{name}{rank}", rank, world_size, job)
        assert t == "welcome", reply
        assert call(service, "start_epoch", session=session(service, f"{name}{rank}"), epoch=0)[0] == "epoch"


def test_jobs_of_other_specs_and_world_sizes_coexist_each_with_its_own_plan(specs):
    service = MasterService(MasterConfig(max_jobs=2), None, Clock())
    a, b = register(service, 2)
    start(service, specs[0], "a", 1)
    start(service, specs[1], "b", 2)
    assert list(service.fleet.jobs) == [specs[0].fingerprint(), specs[1].fingerprint()]
    assert [st.job.world_size for st in service.fleet.jobs.values()] == [1, 2]
    # Workers take splits of both jobs, by turns (equal weights), each task naming its job.
    tasks = [call(service, "get_split", worker_id=w)[1]["split"] for w in (a, b, a, b)]
    assert sorted(t["fingerprint"] for t in tasks) == sorted([specs[0].fingerprint()] * 2 + [specs[1].fingerprint()] * 2)
    # Each job keeps its own books of what a worker holds for it.
    for task in tasks:
        st = service.fleet.jobs[task["fingerprint"]]
        assert any((task["epoch"], task["split_id"]) in w.assigned for w in st.workers.values())
    # A split report names its job: it changes that job only.
    first = tasks[0]
    call(service, "split_produced", worker_id=a, epoch=first["epoch"], split_id=first["split_id"],
         job=first["fingerprint"])
    produced = [p for st in service.fleet.jobs.values() for r in st.ranks.values() for p in r.splits.values()
                if p.produced]
    assert len(produced) == 1 and produced[0].split.id == first["split_id"]
    # A third spec while both jobs are live: refused, naming the setting.
    t, reply = joined(service, specs[2], "c0")
    assert (t, reply["code"]) == ("error", "full") and "--max-jobs 2" in reply["message"]
    # A job of the same spec and another world size is still the live job's: busy.
    assert hello(service, specs[1], client="x", rank=0, world_size=3)[1]["code"] == "busy"
    status = service.status()
    assert [(j["fingerprint"], j["world_size"], j["clients"]) for j in status["jobs"]] == \
        [(specs[0].fingerprint(), 1, 1), (specs[1].fingerprint(), 2, 2)]
    assert {c["job"] for c in status["clients"]} == {specs[0].fingerprint(), specs[1].fingerprint()}
    assert sum(w["assigned"] for w in status["workers"]) == 4


def test_a_job_whose_loaders_left_gives_its_place_to_a_new_one(specs):
    service = MasterService(MasterConfig(max_jobs=2), None, Clock())
    (w,) = register(service)
    start(service, specs[0], "a", 1)
    start(service, specs[1], "b", 1)
    call(service, "get_split", worker_id=w)
    assert call(service, "goodbye", session=session(service, "a0")) == ("ok", {})
    # Job A is idle: its runs ended, its plan kept (its next loader need not bind again)...
    assert service.fleet.jobs[specs[0].fingerprint()].ranks == {}
    # ... until a new spec needs its place.
    start(service, specs[2], "c", 1)
    assert list(service.fleet.jobs) == [specs[1].fingerprint(), specs[2].fingerprint()]
    assert not any(a for st in service.fleet.jobs.values() for wi in st.workers.values() for a in wi.assigned
                   if st.job.fingerprint == specs[0].fingerprint())
    assert call(service, "start_epoch", session=session(service, "a0"), epoch=0)[1]["code"] == "unknown_client"


def test_a_spec_that_fails_to_bind_fails_its_loader_only(specs, tables):
    service = MasterService(MasterConfig(max_jobs=3), None, Clock())
    (w,) = register(service)
    start(service, specs[0], "a", 1)
    bad = spec_dict(tables["orc"], batch_size=30)
    bad["features"]["dense"] = ["no_such_column"]
    while (answer := call(service, "hello", rank=0, world_size=1, spec=bad, fingerprint="x"))[1]["code"] == "binding":
        pass
    t, reply = answer
    assert (t, reply["code"]) == ("error", "bad_spec") and "no_such_column" in reply["message"]
    assert list(service.fleet.jobs) == [specs[0].fingerprint()]
    assert call(service, "get_split", worker_id=w)[0] == "split"


def test_a_master_of_one_job_still_refuses_another_spec(specs):
    service = MasterService(MasterConfig(), None, Clock())
    start(service, specs[0], "a", 1)
    call(service, "goodbye", session=session(service, "a0"))
    assert hello(service, specs[1], client="b0")[1]["code"] == "spec_mismatch"


@pytest.mark.parametrize("compacted", [False, True])
def test_restart_on_the_journal_rebuilds_every_job(specs, tmp_path, compacted):
    clock = Clock()
    live = MasterService(MasterConfig(max_jobs=3), Journal(tmp_path), clock)
    a, b = register(live, 2)
    start(live, specs[0], "a", 1)
    start(live, specs[1], "b", 2)
    for w in (a, b, a):
        clock.now += 0.5
        task = call(live, "get_split", worker_id=w)[1]["split"]
        heartbeat(live, w, rows=100, ahead=0)
    call(live, "split_failed", worker_id=a, epoch=task["epoch"], split_id=task["split_id"], error="bad stripe",
         job=task["fingerprint"])
    live.sync()
    if compacted:
        live.journal.compact(live.fleet.snapshot())
    assert ([type(u).__name__ for u in Journal(tmp_path).replay()] == ["FleetSnapshot"]) == compacted
    live.journal.close()
    restarted = MasterService(MasterConfig(max_jobs=3), Journal(tmp_path), clock)
    assert durable(restarted) == durable(live)
    assert restarted.fleet.session_job == live.fleet.session_job
    # The sessions go on: a client of job B heartbeats to the new master.
    t, reply = call(restarted, "client_heartbeat", session=session(live, "b1"), seq=0, acks=[])
    assert t == "membership" and len(reply["workers"]) == 2


def test_a_journal_of_a_single_job_master_replays_as_a_fleet_of_that_job():
    """Journals written before issue 39 hold bare job updates and, compacted, one Snapshot."""
    single, fleet = JobState(), FleetState()
    for u in history():
        single.apply(u)
        fleet.apply(u)
    (st,) = fleet.jobs.values()
    assert st.snapshot() == single.snapshot()
    assert fleet.session_job == {"c0": "fp", "c1": "fp"}
    compacted = FleetState()
    compacted.apply(U.decode(U.encode(single.snapshot())))
    assert compacted.snapshot() == fleet.snapshot()
    assert not any(w.assigned for w in compacted.registry.workers.values())


def test_a_fleet_snapshot_that_does_not_fit_is_refused_with_the_state_untouched():
    fleet = FleetState()
    for u in history():
        fleet.apply(u)
    before = fleet.snapshot()
    with pytest.raises(ValueError):
        fleet.apply(msgspec.structs.replace(before, version=U.FLEET_SNAPSHOT_VERSION + 1))
    with pytest.raises(ValueError):  # a job's snapshot of another version
        fleet.apply(msgspec.structs.replace(before, jobs=[msgspec.structs.replace(before.jobs[0], version=2)]))
    assert fleet.snapshot() == before


def test_a_heartbeat_names_the_job_of_the_split_it_produces():
    """Another job's split of the same (epoch, id) is not progress of this one."""
    fleet = FleetState()
    for u in history():
        fleet.apply(u)
    fleet.apply(U.WorkerHeartbeat("w1", 1.0, 0, {"split": [0, 0, 1], "job": "other"}))
    assert fleet.jobs["fp"].workers["w1"].producing is None
    fleet.apply(U.WorkerHeartbeat("w1", 2.0, 0, {"split": [0, 0, 1], "job": "fp"}))
    assert fleet.jobs["fp"].workers["w1"].producing == (0, 0, 1)


# -- fair share between jobs (issue 39 item 3) -----------------------------------------------
def hand_out(shares: JobShares, weights: dict[str, float], turns: int, has_work=lambda job: True) -> dict[str, int]:
    """Splits of 100 rows handed out over ``turns`` requests: each to the first job in the
    order that has work (as get_split does)."""
    got = {job: 0 for job in weights}
    for _ in range(turns):
        job = next((j for j in shares.order(weights) if has_work(j)), None)
        if job is not None:
            shares.served(job, 100)
            got[job] += 1
    return got


def test_jobs_that_all_want_more_get_splits_in_proportion_to_their_weights():
    got = hand_out(JobShares(), {"a": 3.0, "b": 1.0}, 4000)
    assert abs(got["a"] / got["b"] - 3.0) < 0.3
    got = hand_out(JobShares(), {"a": 1.0, "b": 1.0, "c": 1.0}, 3000)
    assert max(got.values()) - min(got.values()) <= 1


def test_a_high_priority_job_comes_first_and_a_low_one_is_never_starved():
    weights = {"low": effective_weight(1, "low"), "normal": effective_weight(1, "normal"),
               "high": effective_weight(1, "high")}
    got = hand_out(JobShares(), weights, 7300)
    assert got["high"] > 7 * got["normal"] > 0 and got["normal"] > 7 * got["low"] > 0


def test_a_job_with_nothing_to_hand_out_banks_no_turns():
    """Job b has no work for 1,000 turns, then has: it gets its share from then on, not
    the 1,000 turns it could not use."""
    shares, idle = JobShares(), {"b"}
    hand_out(shares, {"a": 1.0, "b": 1.0}, 1000, has_work=lambda j: j not in idle)
    idle.clear()
    got = hand_out(shares, {"a": 1.0, "b": 1.0}, 100)
    assert abs(got["a"] - got["b"]) <= 2


def test_the_master_hands_out_splits_by_the_specs_weights(tables):
    """Two jobs with share weights 3 and 1 on one worker: its splits go about 3:1 (by rows)
    while both have splits pending."""
    heavy = DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=100, split_rows=300, share={"weight": 3}))
    light = DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=100, split_rows=300))
    service = MasterService(MasterConfig(max_jobs=2), None, Clock())
    (w,) = register(service)
    start(service, heavy, "h", 1)
    start(service, light, "l", 1)
    rows = {heavy.fingerprint(): 0, light.fingerprint(): 0}
    pending = min(sum(len(r.pending) for r in st.ranks.values()) for st in service.fleet.jobs.values())
    for _ in range(pending):  # while both jobs still have splits to hand out
        task = call(service, "get_split", worker_id=w)[1]["split"]
        rows[task["fingerprint"]] += task["row_hi"] - task["row_lo"]
    assert 2.4 < rows[heavy.fingerprint()] / rows[light.fingerprint()] < 3.6
    assert [(j["weight"], j["priority"]) for j in service.status()["jobs"]] == [(3.0, "normal"), (1.0, "normal")]


def test_a_spec_says_its_share_and_without_one_its_fingerprint_is_unchanged(tables):
    plain = spec_dict(tables["orc"])
    assert "share" not in DatasetSpec.from_dict(plain).to_dict()  # fingerprints of existing specs stay
    spec = DatasetSpec.from_dict(dict(plain, share={"weight": 2.5, "priority": "high"}))
    assert (spec.share_weight, spec.priority) == (2.5, "high")
    assert DatasetSpec.from_dict(spec.to_dict()) == spec
    for bad, match in [({"weight": 0}, "share.weight"), ({"weight": True}, "share.weight"),
                       ({"priority": "urgent"}, "share.priority"), ({"nice": 1}, "share.nice: unknown key")]:
        with pytest.raises(SpecError, match=match):
            DatasetSpec.from_dict(dict(plain, share=bad))


def test_status_and_metrics_show_a_line_per_job(specs):
    """`remoteloader status` prints a line per job of a shared fleet; the metrics carry a
    `job` label per job (its fingerprint: bounded by --max-jobs)."""
    from prometheus_client.parser import text_string_to_metric_families

    from remoteloader.master.metrics import MasterMetrics
    from rich.console import Console

    from remoteloader.tools.cli import job_header, job_line
    from remoteloader.tools.watch import Trends, render
    from tests.test_metrics import _exposition

    service = MasterService(MasterConfig(max_jobs=2), None, Clock())
    register(service, 1)
    start(service, specs[0], "a", 1)
    assert "oldest_of" not in service.status()["job"] and "oldest" not in job_header(service.status()["job"])
    start(service, specs[1], "b", 2)
    # The top level shows one job of two: it says so, and which (the oldest), as the ranks it lists are its.
    top = service.status()
    assert top["job"]["fingerprint"] == specs[0].fingerprint() and top["job"]["oldest_of"] == 2
    assert list(top["ranks"]) == ["0"]
    assert job_header(top["job"]).endswith("the oldest of the 2 jobs this master serves (its ranks below; "
                                           "every job's line follows)")
    console = Console(record=True, width=200, color_system=None)
    console.print(render(top, "tcp://127.0.0.1:5555", Trends(), now=0))
    text = console.export_text()
    assert f"job {specs[0].fingerprint()}" in text and "(the oldest of 2 jobs)" in text
    lines = [job_line(j) for j in service.status()["jobs"]]
    assert [line.split()[1] for line in lines] == [specs[0].fingerprint(), specs[1].fingerprint()]
    assert "world size 2, 2 clients, epoch 0 0% done" in lines[1] and "weight 1 normal" in lines[1]
    families = {f.name: f for f in text_string_to_metric_families(_exposition(MasterMetrics(service).read_state()))}
    assert {(s.labels["job_key"], s.value) for s in families["remoteloader_fleet_job_clients"].samples} == \
        {(specs[0].fingerprint(), 1), (specs[1].fingerprint(), 2)}
    assert all(set(s.labels) == {"job_key"} for name, f in families.items() if name.startswith("remoteloader_fleet_job")
               for s in f.samples)
