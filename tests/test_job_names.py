"""Job names (issue 39): two loaders of one spec under two names are two jobs of a shared fleet.

In process, on a fake clock: the master keys jobs by (fingerprint, name) through its state,
journal, status and metrics; the per-job cache policy; the loader's name, its default and a
checkpoint's job.
"""
from __future__ import annotations

import msgspec
import pytest
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families

from remoteloader.client import jobname, resume
from remoteloader.core.cache.segments import BlockSigner
from remoteloader.core.cache.store import BlockStore
from remoteloader.master import updates as U
from remoteloader.master.cache_plan import CachePlanner
from remoteloader.master.journal import Journal
from remoteloader.master.metrics import MasterMetrics
from remoteloader.master.service import MasterConfig, MasterService
from remoteloader.protocol.messages import check_job_name, job_key
from remoteloader.spec import DatasetSpec
from tests.conftest import ROWS, spec_dict
from tests.test_cache_policy import MIN_ROWS, _costs
from tests.test_checkpoint import spec_of, two_rank_parts
from tests.test_fleet import durable, joined, start
from tests.test_master_service import Clock, call, heartbeat, register, session
from tests.test_metrics import _exposition


@pytest.fixture
def spec(tables) -> DatasetSpec:
    return DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=100))


def test_one_spec_under_two_names_is_two_jobs_each_with_its_own_plan_and_ranks(spec):
    service = MasterService(MasterConfig(max_jobs=3), None, Clock())
    a, b = register(service, 2)
    start(service, spec, "x", 1, job="sweep-1")
    start(service, spec, "y", 2, job="sweep-2")  # the same spec, another world size: another job, not busy
    fp = spec.fingerprint()
    assert list(service.fleet.jobs) == [f"{fp}/sweep-1", f"{fp}/sweep-2"]
    assert [st.job.world_size for st in service.fleet.jobs.values()] == [1, 2]
    # Split tasks name the job's key; a report with it changes that job only.
    task = call(service, "get_split", worker_id=a)[1]["split"]
    assert task["fingerprint"] == f"{fp}/sweep-1"
    assert call(service, "get_spec", fingerprint=task["fingerprint"])[1]["fingerprint"] == task["fingerprint"]
    call(service, "split_produced", worker_id=a, epoch=task["epoch"], split_id=task["split_id"], job=task["fingerprint"])
    produced = {k: sum(p.produced for r in st.ranks.values() for p in r.splits.values())
                for k, st in service.fleet.jobs.items()}
    assert produced == {f"{fp}/sweep-1": 1, f"{fp}/sweep-2": 0}
    # Within a job, as before: another world size is busy, the same one takes the rank over.
    assert joined(service, spec, "z0", 0, 3, job="sweep-2")[1]["code"] == "busy"
    assert joined(service, spec, "x0-again", 0, 1, job="sweep-1")[0] == "welcome"
    assert call(service, "start_epoch", session=session(service, "x0"), epoch=0)[1]["code"] == "replaced"
    # An unnamed loader of the spec is a third job.
    start(service, spec, "u", 1)
    assert list(service.fleet.jobs)[-1] == fp
    status = service.status()
    assert [(j["job"], j["fingerprint"], j.get("name")) for j in status["jobs"]] == \
        [(f"{fp}/sweep-1", fp, "sweep-1"), (f"{fp}/sweep-2", fp, "sweep-2"), (fp, fp, None)]
    assert status["job"]["key"] == f"{fp}/sweep-1" and status["job"]["name"] == "sweep-1"
    assert {c["job"] for c in status["clients"]} == set(service.fleet.jobs)


def test_a_master_of_one_job_ignores_the_name(spec):
    service = MasterService(MasterConfig(), None, Clock())
    service.submit(spec)
    assert joined(service, spec, "a0", job="sweep-1")[0] == "welcome"
    assert list(service.fleet.jobs) == [spec.fingerprint()]


@pytest.mark.parametrize("name", ["a/b", "-x", "x" * 41, "a b"])
def test_a_name_that_is_none_is_refused_on_the_wire_and_by_the_loader(spec, name):
    service = MasterService(MasterConfig(max_jobs=2), None, Clock())
    t, reply = joined(service, spec, "a0", job=name)
    assert t == "error" and "job" in reply["message"]
    with pytest.raises(ValueError, match="a job name is 1 to 40 letters"):
        check_job_name(name)
    with pytest.raises(ValueError, match="a job name"):
        jobname.resolve_job_name(name, spec.fingerprint(), 0, 1)


@pytest.mark.parametrize("compacted", [False, True])
def test_restart_on_the_journal_keeps_the_named_jobs(spec, tmp_path, compacted):
    clock = Clock()
    live = MasterService(MasterConfig(max_jobs=2), Journal(tmp_path), clock)
    (w,) = register(live)
    start(live, spec, "x", 1, job="t1")
    start(live, spec, "y", 1, job="t2")
    task = call(live, "get_split", worker_id=w)[1]["split"]
    live.sync()
    if compacted:
        live.journal.compact(live.fleet.snapshot())
    live.journal.close()
    restarted = MasterService(MasterConfig(max_jobs=2), Journal(tmp_path), clock)
    assert list(restarted.fleet.jobs) == list(live.fleet.jobs) and durable(restarted) == durable(live)
    assert [st.job.name for st in restarted.fleet.jobs.values()] == ["t1", "t2"]
    assert call(restarted, "split_produced", worker_id=w, epoch=task["epoch"], split_id=task["split_id"],
                job=task["fingerprint"]) == ("ok", {})


def test_a_journal_record_of_before_names_reads_as_an_unnamed_job(spec):
    """Records written before names have no ``name``: decoded, they are the fingerprint's job."""
    record = U.JobSubmitted(spec, spec.fingerprint(), {}, [], [], [])
    old = msgspec.to_builtins(U.ForJob(spec.fingerprint(), record))
    del old["update"]["name"]  # the record as a journal of before names holds it
    assert U.decode(msgspec.msgpack.encode(old)) == U.ForJob(spec.fingerprint(), record)
    with pytest.raises(ValueError, match="submitted as"):  # a key that is not the record's job
        MasterService(MasterConfig(max_jobs=2), None, Clock()).fleet.apply(U.ForJob(job_key("f", "x"), record))


def test_two_names_of_one_spec_share_work(spec):
    """The jobs read the same blocks: a worker given one job's split of a base split gets the
    other job's split of it next, and another worker meanwhile another split."""
    service = MasterService(MasterConfig(max_jobs=2), None, Clock())
    a, b = register(service, 2)
    start(service, spec, "x", 1, job="t1")
    start(service, spec, "y", 1, job="t2")
    first = call(service, "get_split", worker_id=a)[1]["split"]
    other = call(service, "get_split", worker_id=b)[1]["split"]
    second = call(service, "get_split", worker_id=a)[1]["split"]
    keys = list(service.fleet.jobs)
    assert service.shared_work.sharing(*keys)
    assert (first["fingerprint"], second["fingerprint"]) == tuple(keys)
    assert (second["base"], second["row_lo"]) == (first["base"], first["row_lo"])  # the same rows
    assert (other["base"], other["row_lo"]) != (first["base"], first["row_lo"])
    assert service.shared_work.counters.deferred == 1


def test_client_metrics_are_per_rank_and_job_and_go_with_an_ended_job(specs_of_two):
    spec, third = specs_of_two
    service = MasterService(MasterConfig(max_jobs=2), None, Clock())
    register(service)
    metrics = MasterMetrics(service, process_metrics=False)
    for name in ("t1", "t2"):
        start(service, spec, name, 1, job=name)
    for rows, name in ((100, "t1"), (300, "t2")):
        for step in (1, 2):
            service.clock.now += 1
            call(service, "client_heartbeat", session=session(service, f"{name}0"), seq=0, acks=[],
                 stats={"rows": rows * step, "batches": step, "wait_s": 0.0})

    def rows_by_job() -> dict:
        text = _exposition(metrics.read_state())
        family = {f.name: f for f in text_string_to_metric_families(text)}["remoteloader_client_rows"]
        return {(s.labels["rank"], s.labels["job_key"]): s.value for s in family.samples if s.name.endswith("_total")}

    fp = spec.fingerprint()
    assert rows_by_job() == {("0", f"{fp}/t1"): 200, ("0", f"{fp}/t2"): 600}  # rank 0 of each job, apart
    call(service, "goodbye", session=session(service, "t1" + "0"))
    service.tick()
    assert rows_by_job()[("0", f"{fp}/t1")] == 200  # a rank that left still counts while its job is held
    start(service, third, "c", 1)  # job t1's place goes to a new job: its series go too
    assert set(rows_by_job()) == {("0", f"{fp}/t2")}


@pytest.fixture
def specs_of_two(tables) -> tuple[DatasetSpec, DatasetSpec]:
    return tuple(DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=b)) for b in (100, 70))


def test_the_auto_cache_policy_decides_for_each_job_of_a_shared_fleet(tables, tmp_path):
    specs = [DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=b, cache={"mode": "auto", "expected_epochs": e}))
             for b, e in ((100, 3), (70, 1))]
    store = BlockStore(str(tmp_path / "cache"), BlockSigner.plain())
    service = MasterService(MasterConfig(max_jobs=2), Journal(str(tmp_path / "journal")), Clock(), cache=store)
    service.cache = CachePlanner(store, probe=False)
    service.cache.probed = (1e9, 5e8)  # a fast cache
    (w,) = register(service)
    start(service, specs[0], "a", 1)
    start(service, specs[1], "b", 1)
    heavy, once = (service.fleet.jobs[s.fingerprint()] for s in specs)
    pipeline = service.runtime[heavy.job.key].bound.pipeline
    # Heavy transforms in both; the first job reads its rows twice more, the second never again
    # (expected_epochs 1): caching pays for the first alone, on what each job's own costs say.
    heartbeat(service, w, costs=_costs(heavy.job.key, MIN_ROWS * 2, pipeline.feature_names, pipeline.input_columns,
                                       50e-6)
              + _costs(once.job.key, MIN_ROWS * 2, pipeline.feature_names, pipeline.input_columns, 50e-6))
    service.tick()
    assert {mode for mode, _ in heavy.cache_plan.values()} == {"transformed"}
    assert {mode for mode, _ in once.cache_plan.values()} <= {"compute"}
    cache = service.status()["cache"]
    assert set(cache["jobs"]) == {heavy.job.key, once.job.key} and "groups" not in cache
    assert {g["mode"] for g in cache["jobs"][heavy.job.key]["groups"]} == {"transformed"}
    # Journaled per job: a restarted master keeps each job's plan.
    service.sync()
    service.journal.close()
    restarted = MasterService(MasterConfig(max_jobs=2), Journal(str(tmp_path / "journal")), Clock(), cache=store)
    assert {k: st.cache_plan for k, st in restarted.fleet.jobs.items()} == \
        {k: st.cache_plan for k, st in service.fleet.jobs.items()}
    store.close()


# -- the loader's side -------------------------------------------------------------------------
def test_the_default_name_is_torchruns_run_id(monkeypatch):
    monkeypatch.setenv(jobname.ENV_RUN_ID, "e2e-run-7")
    assert jobname.resolve_job_name(None, "fp", 0, 1) == ("e2e-run-7", False, None)
    monkeypatch.setenv(jobname.ENV_RUN_ID, "none")  # torchrun's own default rdzv id: no name
    assert jobname.resolve_job_name(None, "fp", 0, 1) == ("", False, None)
    monkeypatch.setenv(jobname.ENV_RUN_ID, "x" * 80)  # no valid name: named by its digest
    name = jobname.resolve_job_name(None, "fp", 0, 1).name
    assert name.startswith("run-") and check_job_name(name) == name
    assert jobname.resolve_job_name("sweep-3", "fp", 0, 1) == ("sweep-3", True, None)


def test_under_torch_distributed_the_ranks_agree_through_the_store(monkeypatch):
    monkeypatch.delenv(jobname.ENV_RUN_ID, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        name, given, slot = jobname.resolve_job_name(None, "fp-agree", 0, 1)
        assert name and not given and slot == 0  # a fresh name, published for the other ranks
        store = dist.distributed_c10d._get_default_store()
        assert store.get(jobname.STORE_KEY.format(fingerprint="fp-agree", seq=0)).decode() == name
        # Another rank's (or a restarted process's) loader of the spec reads it; a name given that differs fails.
        jobname.release("fp-agree", slot)
        assert jobname.resolve_job_name(None, "fp-agree", 0, 1) == (name, False, 0)
        jobname.release("fp-agree", 0)
        with pytest.raises(ValueError, match="every rank must pass the same job="):
            jobname.resolve_job_name("other", "fp-agree", 0, 1)
    finally:
        jobname.release("fp-agree", 0)
        dist.destroy_process_group()


def test_a_loader_made_again_after_close_is_the_same_job_and_two_open_at_once_are_two(monkeypatch):
    """A slot of the spec's open loaders, not a count of those ever made: a loader recreated
    after the last one closed (every epoch, or in a restarted process while the other ranks
    hold theirs) names the job the other ranks' open loaders name."""
    monkeypatch.delenv(jobname.ENV_RUN_ID, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        first = jobname.resolve_job_name(None, "fp-slots", 0, 1)
        second = jobname.resolve_job_name(None, "fp-slots", 0, 1)  # the first still open: another job
        assert second.name != first.name and second.slot != first.slot
        jobname.release("fp-slots", first.slot)
        jobname.release("fp-slots", second.slot)
        assert jobname.resolve_job_name(None, "fp-slots", 0, 1).name == first.name
    finally:
        jobname._open.pop("fp-slots", None)
        dist.destroy_process_group()


def test_a_rank_given_no_name_and_one_by_default_agree_on_it(monkeypatch):
    """``job=""`` is published as itself: the store's compare_set would take an empty value
    for "not set", and the next rank's default overwrite it (two half jobs)."""
    monkeypatch.delenv(jobname.ENV_RUN_ID, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert jobname.resolve_job_name("", "fp-unnamed", 0, 1)[:2] == ("", True)
        jobname.release("fp-unnamed", 0)  # the next is another rank's loader of the job
        assert jobname.resolve_job_name(None, "fp-unnamed", 0, 1)[:2] == ("", False)
        jobname.release("fp-unnamed", 0)
        with pytest.raises(ValueError, match="names another job than ''"):
            jobname.resolve_job_name("sweep-1", "fp-unnamed", 0, 1)
    finally:
        jobname._open.pop("fp-unnamed", None)
        dist.destroy_process_group()


def test_a_checkpoint_names_its_job_and_resumes_only_it():
    spec = spec_of(batch_size=100)
    parts = {r: dict(p, job="sweep-3") for r, p in two_rank_parts(spec).items()}
    position = resume.job_position(parts)
    assert position["job"] == "sweep-3"
    assert resume.saved_job(position) == "sweep-3" and resume.saved_job({"rank_0": parts[0]}) == "sweep-3"
    assert resume.saved_job(resume.job_position(two_rank_parts(spec))) == ""  # saved by an unnamed loader
    assert resume.saved_job({k: v for k, v in position.items() if k != "job"}) is None  # of before names
    with pytest.raises(ValueError, match="disagree on 'job'"):
        resume.job_position({0: parts[0], 1: dict(parts[1], job="sweep-4")})
    with pytest.raises(ValueError, match="the checkpoint's job"):
        resume.saved_job(dict(position, job="../x"))


def test_a_loader_without_a_name_takes_its_checkpoints_job(tables, inprocess):
    cluster = inprocess(1)
    with cluster.loader(spec_dict(tables["orc"], batch_size=100)) as loader:
        assert loader.job == ""
        state = loader.state_dict()
        assert state["rank_0"]["job"] == ""
    named = {k: dict(v, job="sweep-3") for k, v in state.items()}
    with cluster.loader(spec_dict(tables["orc"], batch_size=100)) as loader:
        loader.state_dict()  # as DCP does before it loads: the loader meets the master as its default job
        before = loader.session.id
        loader.load_state_dict(named)  # a default name: the checkpoint's job is resumed, in its next session
        assert loader.job == loader.session.job_name == "sweep-3" and loader.session.id != before
        assert loader.state_dict()["rank_0"]["job"] == "sweep-3"
        assert sum(len(b) for b in loader) == ROWS  # and it reads its epoch, as the checkpoint's job


def test_a_loader_given_another_name_forks_the_checkpoint_as_its_own_job(tables, inprocess):
    """Two trials warm-started from one checkpoint: each given its own ``job=`` resumes the
    position as its own job, and each reads the rest of the epoch once; the checkpoint's job
    is not taken over."""
    cluster = inprocess(1, config=MasterConfig(max_jobs=3, heartbeat_timeout=2.0))  # a shared fleet
    spec = spec_dict(tables["orc"], batch_size=100)
    with cluster.loader(spec, job="base") as loader:
        it = iter(loader)
        first = sum(len(next(it)) for _ in range(3))
        state = loader.state_dict()
        assert state["rank_0"]["job"] == "base"
    forks = [cluster.loader(spec, job=name) for name in ("trial-1", "trial-2")]
    try:
        for loader in forks:
            loader.load_state_dict(state)
            assert loader.job == loader.session.job_name != "base"
            assert loader.state_dict()["rank_0"]["job"] == loader.job
        iters = [iter(loader) for loader in forks]
        rows = [0, 0]
        for i, it in enumerate(iters):  # both live at once: two jobs of one spec
            rows[i] += len(next(it))
        for i, it in enumerate(iters):
            rows[i] += sum(len(b) for b in it)
        assert rows == [ROWS - first, ROWS - first]
    finally:
        for loader in forks:
            loader.close()


def test_a_closed_loader_frees_its_slot_for_the_next(tables, inprocess, monkeypatch):
    """``close()`` releases the loader's slot: the loader made next names the same job."""
    monkeypatch.delenv(jobname.ENV_RUN_ID, raising=False)
    cluster = inprocess(1)
    spec = spec_dict(tables["orc"], batch_size=100)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with cluster.loader(spec) as loader:
            first = loader.job
            with cluster.loader(spec) as other:  # open beside it: another job
                assert other.job not in ("", first)
        with cluster.loader(spec) as loader:
            assert loader.job == first
    finally:
        dist.destroy_process_group()


def test_a_refused_checkpoint_leaves_the_loaders_job_as_it_was(tables, inprocess):
    """The job is taken over only once the state is accepted: a state of another spec is
    refused (naming the key) and the loader goes on as its own job, in its own session."""
    with inprocess(1).loader(spec_dict(tables["orc"], batch_size=100)) as loader:
        state = {k: dict(v, job="sweep-3") for k, v in loader.state_dict().items()}
    with inprocess(1).loader(spec_dict(tables["orc"], batch_size=100, seed=7)) as loader:
        loader.state_dict()
        before = loader.session.id
        with pytest.raises(ValueError, match="seed"):
            loader.load_state_dict(state)
        assert (loader.job, loader.session.job_name, loader.session.id) == ("", "", before)


def test_the_longest_job_key_fits_every_wire_field_that_names_a_job():
    """A job key, ``<fingerprint>/<name>`` at the longest name, fits the fields bounded at 64
    (split tasks, a heartbeat's job costs) as well as the ``Id`` ones."""
    import msgspec.inspect as mi

    from remoteloader.protocol import messages as M

    key = job_key(DatasetSpec.from_dict(spec_dict("/t", batch_size=1)).fingerprint(), "x" * M.JOB_NAME_MAX)
    bounds = {(record.__name__, f.name): f.type.max_length
              for record in (M.SplitTaskRecord, M.JobCosts, M.GetSpec, M.Spec, M.Register, M.Registered)
              for f in mi.type_info(record).fields if f.name in ("fingerprint", "job")}
    assert bounds[("SplitTaskRecord", "fingerprint")] == bounds[("JobCosts", "fingerprint")] == 64
    assert all(len(key) <= bound for bound in bounds.values()), (len(key), bounds)
