"""MasterService in process, on a fake clock: request handling and restarts without sockets."""
from __future__ import annotations

import dataclasses
import time

import msgpack
import msgspec
import pytest

from remoteloader.master import updates as U
from remoteloader.master.journal import Journal
from remoteloader.master.service import MasterConfig, MasterService
from remoteloader.protocol.wire import PROTOCOL_VERSION, ProtocolError, decode
from remoteloader.spec import DatasetSpec
from tests.conftest import spec_dict
from tests.wire_helpers import ask


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def spec(tables) -> DatasetSpec:
    return DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=100))


def make_service(spec: DatasetSpec, clock: Clock, journal: Journal | None = None, **config) -> MasterService:
    service = MasterService(MasterConfig(**config), journal, clock)
    if service.state.job is None:
        service.submit(spec)
    return service


def call(service: MasterService, t: str, **fields) -> tuple[str, dict]:
    if "worker_id" in fields and "token" not in fields:  # sent as that worker, holding its registered.token
        fields["token"] = service.keys.worker_token(fields["worker_id"])
    return ask(service, {"v": PROTOCOL_VERSION, "t": t, **fields})


def register(service: MasterService, n: int = 1) -> list[str]:
    fingerprint = service.state.job.fingerprint if service.state.job else ""
    return [call(service, "register", addr=f"tcp://127.0.0.1:{7000 + i}", pid=100 + i,
                 fingerprint=fingerprint)[1]["worker_id"] for i in range(n)]


SESSIONS: dict[tuple[int, str], str] = {}  # (service, the test's name for a client) -> the session its hello got


def hello(service: MasterService, spec: DatasetSpec, client: str = "c0", rank: int = 0, world_size: int = 1,
          job: str = ""):
    t, reply = call(service, "hello", rank=rank, world_size=world_size, spec=spec.to_dict(),
                    fingerprint=spec.fingerprint(), **({"job": job} if job else {}))
    if t == "welcome":
        SESSIONS[id(service), client] = reply["session"]
    return t, reply


def session(service: MasterService, client: str = "c0") -> str:
    """The session the master issued to ``client`` (a name no hello got: itself, unknown to the master)."""
    return SESSIONS.get((id(service), client), client)


def heartbeat(service: MasterService, worker: str, **stats) -> str:
    t, reply = call(service, "heartbeat", worker_id=worker, buffered=0, stats=stats)
    assert t == "heartbeat_ok"
    return reply["state"]


def test_drained_worker_is_told_to_stop_once_its_splits_are_consumed(spec):
    service = make_service(spec, Clock())
    (w,) = register(service)
    hello(service, spec)
    _, epoch = call(service, "start_epoch", session=session(service, "c0"), epoch=0)
    t, reply = call(service, "get_split", worker_id=w)
    assert t == "split"
    split = reply["split"]
    assert call(service, "drain", worker_id=w) == ("ok", {})
    assert heartbeat(service, w) == "drain"                   # still holds a split
    assert call(service, "get_split", worker_id=w)[0] == "no_split"
    pieces = -(-(split["row_hi"] - split["row_lo"]) // 100)
    call(service, "client_heartbeat", session=session(service, "c0"), seq=0, acks=[[split["split_id"], pieces]])
    assert heartbeat(service, w) == "stop"
    assert w not in service.state.workers
    assert heartbeat(service, w) == "unknown"                 # a late heartbeat: register again


def test_stale_reports_of_a_reassigned_split_are_ignored(spec):
    clock = Clock()
    service = make_service(spec, clock, heartbeat_timeout=5.0)
    a, b = register(service, 2)
    hello(service, spec)
    call(service, "start_epoch", session=session(service, "c0"), epoch=0)
    split = call(service, "get_split", worker_id=a)[1]["split"]
    clock.now += 10                                             # a misses its heartbeats
    heartbeat(service, b)
    service.tick()
    assert a not in service.state.workers
    taken = {}
    while (reply := call(service, "get_split", worker_id=b))[0] == "split":
        taken[reply[1]["split"]["split_id"]] = reply[1]["split"]
    assert split["split_id"] in taken                           # re-queued, b has it now
    # a comes back from a pause and reports on the split it no longer holds.
    assert call(service, "split_failed", worker_id=a, epoch=0, split_id=split["split_id"],
                error="late")[1]["code"] == "unknown_worker"
    (a2,) = register(service)
    assert call(service, "split_failed", worker_id=a2, epoch=0, split_id=split["split_id"], error="late") == ("ok", {})
    assert call(service, "split_produced", worker_id=a2, epoch=0, split_id=split["split_id"]) == ("ok", {})
    progress = service.state.ranks[0].splits[split["split_id"]]
    assert progress.worker == b and progress.failed is None and not progress.produced
    assert service.state.errors == []


def test_released_splits_are_handed_out_again_and_full_ranks_avoided(spec):
    service = make_service(spec, Clock())
    (w,) = register(service)
    for rank in (0, 1):
        hello(service, spec, client=f"c{rank}", rank=rank, world_size=2)
        call(service, "start_epoch", session=session(service, f"c{rank}"), epoch=0)
    first = call(service, "get_split", worker_id=w)[1]["split"]
    other = 1 - first["rank"]
    # The worker holds its share for the first rank: it asks only for the other's splits.
    for _ in range(3):
        assert call(service, "get_split", worker_id=w, avoid_ranks=[first["rank"]])[1]["split"]["rank"] == other
    # It hands the first split back (its client went silent): it is pending again, first in line.
    assert call(service, "splits_released", worker_id=w, splits=[[0, first["split_id"]]], reason="silent") == ("ok", {})
    assert (0, first["split_id"]) not in service.state.workers[w].assigned
    assert service.state.ranks[first["rank"]].pending[0] == first["split_id"]
    again = call(service, "get_split", worker_id=w, avoid_ranks=[other])[1]["split"]
    assert (again["rank"], again["split_id"]) == (first["rank"], first["split_id"])
    # A split it does not hold, and malformed lists, change nothing.
    assert call(service, "splits_released", worker_id=w, splits=[[0, 10**6]], reason="x") == ("ok", {})
    assert call(service, "splits_released", worker_id=w, splits=[[0]], reason="x")[0] == "error"
    assert call(service, "get_split", worker_id=w, avoid_ranks=["0"])[0] == "error"


def test_a_silent_client_is_forgotten_and_can_rejoin(spec, tmp_path):
    clock = Clock()
    service = make_service(spec, clock, Journal(str(tmp_path)), client_timeout=600.0)
    register(service)
    for rank in (0, 1):
        hello(service, spec, client=f"c{rank}", rank=rank, world_size=2)
        call(service, "start_epoch", session=session(service, f"c{rank}"), epoch=0)
    clock.now += 400
    call(service, "client_heartbeat", session=session(service, "c0"), seq=0, acks=[])  # c0 is alive, c1 is not
    clock.now += 300
    service.tick()
    service.sync()  # what the server does after each pass
    c0 = session(service, "c0")
    assert set(service.state.clients) == {c0} and set(service.state.client_stats) == {c0}
    assert call(service, "client_heartbeat", session=session(service, "c1"), seq=0, acks=[])[1]["code"] == "unknown_client"
    restarted = MasterService(MasterConfig(), Journal(str(tmp_path)), clock)  # the journal forgets it too
    assert set(restarted.state.clients) == {c0}
    hello(service, spec, client="c1", rank=1, world_size=2)  # what a returning loader does
    assert call(service, "start_epoch", session=session(service, "c1"), epoch=0)[0] == "epoch"


def test_one_peer_cannot_flood_joins():
    from remoteloader.master.server import PeerRateLimit
    clock = Clock()
    limit = PeerRateLimit(limit=3, window_s=10.0, max_peers=2, clock=clock)
    assert [limit.allow(b"a", "hello") for _ in range(4)] == [True, True, True, False]
    assert limit.allow(b"a", "client_heartbeat")              # only joins are limited
    assert limit.allow(b"b", "register")                      # per peer
    clock.now += 10
    assert limit.allow(b"a", "hello")                         # a new window
    limit.allow(b"c", "hello")
    assert len(limit._peers) == 2                             # bounded memory of peers


def test_next_epoch_prefetch_takes_one_split_ahead_per_worker(spec):
    service = make_service(spec, Clock())
    (w,) = register(service)
    hello(service, spec)
    call(service, "start_epoch", session=session(service, "c0"), epoch=0)
    while (reply := call(service, "get_split", worker_id=w))[0] == "split" and reply[1]["split"]["epoch"] == 0:
        pass
    # Nothing left of epoch 0: the worker read one split of epoch 1 ahead, and no more
    # while it holds that one (its pieces wait outside the trainer's credit).
    assert reply[0] == "split" and reply[1]["split"]["epoch"] == 1
    assert service.state.prefetched[0].epoch == 1
    heartbeat(service, w, ahead=0)                              # a stale heartbeat says nothing held
    assert call(service, "get_split", worker_id=w)[0] == "no_split"
    # Once the trainer is in epoch 1 the worker takes the rest.
    call(service, "start_epoch", session=session(service, "c0"), epoch=1)
    t, reply = call(service, "get_split", worker_id=w)
    assert t == "split" and reply["split"]["epoch"] == 1
    # A worker told to drain hands back what it read ahead: a trainer may never start that
    # epoch, and the worker must not wait for it to leave.
    second = make_service(spec, Clock())
    (w2,) = register(second)
    hello(second, spec)
    call(second, "start_epoch", session=session(second, "c0"), epoch=0)
    while (reply := call(second, "get_split", worker_id=w2))[1]["split"]["epoch"] == 0:
        pass
    ahead = (1, reply[1]["split"]["split_id"])
    assert second.state.splits_ahead(w2) == [ahead]
    second.drain(w2)
    assert second.state.splits_ahead(w2) == [] and ahead not in second.state.workers[w2].assigned
    assert ahead[1] in second.state.prefetched[0].pending
    # Without the prefetch option the worker waits for the trainer's start_epoch.
    other = make_service(spec, Clock(), prefetch_next_epoch=False)
    (w,) = register(other)
    hello(other, spec)
    call(other, "start_epoch", session=session(other, "c0"), epoch=0)
    while call(other, "get_split", worker_id=w)[0] == "split":
        pass
    heartbeat(other, w, ahead=0)
    assert call(other, "get_split", worker_id=w)[0] == "no_split"


def test_hello_checks_spec_rank_and_world_size(spec, tables):
    service = MasterService(MasterConfig(), None, Clock())
    bad = spec_dict(tables["orc"])
    bad["features"]["dense"] = ["no_such_column"]
    t, reply = call(service, "hello", rank=0, world_size=2, spec=bad, fingerprint="x")
    assert t == "error" and reply["code"] == "bad_spec" and "no_such_column" in reply["message"]
    assert service.state.job is None                            # nothing was submitted
    assert hello(service, spec, rank=0, world_size=2)[0] == "welcome"
    assert hello(service, spec, client="c1", rank=2, world_size=2)[1]["code"] == "bad_rank"
    t, reply = hello(service, spec, client="c1", rank=1, world_size=3)   # another job while this one is live
    assert reply["code"] == "busy" and "world size 2" in reply["message"] and "--client-timeout" in reply["message"]
    other = DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=7))
    assert hello(service, other, client="c1", rank=1, world_size=2)[1]["code"] == "spec_mismatch"
    t, reply = hello(service, spec, client="c1", rank=1, world_size=2)
    assert t == "welcome" and reply["job"]["world_size"] == 2 and reply["job"]["plan"]
    assert call(service, "start_epoch", session=session(service, "nobody"), epoch=0)[1]["code"] == "unknown_client"


def durable_view(service: MasterService) -> dict:
    """The whole state, minus what a restart re-learns from the next heartbeats."""
    st = service.state
    workers = {k: {f: v for f, v in dataclasses.asdict(w).items()
                   if f not in ("last_seen", "buffered", "stats", "producing", "producing_since")}
               for k, w in st.workers.items()}

    def rank_view(ranks):
        return {r: (e.epoch, list(e.pending), e.finished,
                    {k: (p.split, p.pieces, p.consumed, p.worker, p.assigned_at, p.produced, p.failed)
                     for k, p in e.splits.items()}) for r, e in ranks.items()}

    return {"job": st.job, "workers": workers, "clients": st.clients, "partitions": st.partitions,
            "ranks": rank_view(st.ranks), "prefetched": rank_view(st.prefetched), "errors": st.errors}


@pytest.mark.parametrize("compacted", [False, True])
def test_restart_on_the_journal_rebuilds_the_whole_state(spec, tmp_path, compacted):
    clock = Clock()
    live = make_service(spec, clock, Journal(tmp_path))
    a, b, c = register(live, 3)
    hello(live, spec, client="c0", rank=0, world_size=2)
    hello(live, spec, client="c1", rank=1, world_size=2)
    call(live, "start_epoch", session=session(live, "c0"), epoch=0)
    call(live, "start_epoch", session=session(live, "c1"), epoch=0)
    held = []
    for w in (a, b, c, a):
        clock.now += 0.5
        t, reply = call(live, "get_split", worker_id=w)
        if t == "split":
            held.append((w, reply["split"]))
        heartbeat(live, w, rows=100, ahead=0, split=[0, 0, 1])   # transient: not journaled
    w0, s0 = held[0]
    call(live, "split_produced", worker_id=w0, epoch=0, split_id=s0["split_id"])
    call(live, "client_heartbeat", session=session(live, f"c{s0['rank']}"), seq=0, acks=[[s0["split_id"], 1]],
         stats={"batches": 1, "wait_s": 0.1})
    call(live, "drain", worker_id=c)
    live.sync()
    if compacted:  # the journal as compaction leaves it: one Snapshot record
        live.journal.compact(live.state.snapshot())
    records = [type(u).__name__ for u in Journal(tmp_path).replay()]
    assert (records == ["Snapshot"]) == compacted
    live.journal.close()

    restarted = MasterService(MasterConfig(), Journal(tmp_path), clock)
    # Consumption is not journaled: the client reports it again when it sees a new master.
    # The session is journaled: the client goes on with it.
    t, reply = call(restarted, "client_heartbeat", session=session(live, f"c{s0['rank']}"), seq=0,
                    acks=[[s0["split_id"], 1]])
    assert reply["master"] != live.incarnation
    assert durable_view(restarted) == durable_view(live)
    # Workers get a fresh grace period from the restart, not their pre-restart last_seen.
    assert all(w.last_seen == clock.now for w in restarted.state.workers.values())


def encoded(t: str, **fields) -> list:
    return [msgpack.packb({"v": PROTOCOL_VERSION, "t": t, **fields})]


@pytest.mark.parametrize("parts,match", [
    (encoded("heartbeat", worker_id="w", token="t", buffered=0, stats={"cpu": "x"}), r"at `\$\.stats\.cpu`"),
    (encoded("heartbeat", worker_id="w", token="t", buffered=0, stats={"rows": "x"}), r"at `\$\.stats\.rows`"),
    (encoded("heartbeat", worker_id="w", token="t", buffered=0, stats={"split": [0, 1]}), r"at `\$\.stats\.split`"),
    (encoded("heartbeat", worker_id="w", token="t", buffered=0, stats={"cpu": float("nan")}), r"at `\$\.stats\.cpu`"),
    (encoded("heartbeat", worker_id="w", token="t", buffered=0, stats={"evil": 1}), "unknown field `evil`"),
    (encoded("start_epoch", session="c", epoch=-1), r">= 0 - at `\$\.epoch`"),
    (encoded("register", addr="tcp://" + "a" * 10_000, pid=1), r"length <= 4096 - at `\$\.addr`"),
    (encoded("client_heartbeat", session="c", seq=0, acks=[], stats={"wait_s": -1.0}), r"at `\$\.stats\.wait_s`"),
])
def test_malformed_fields_are_refused_at_the_edge(parts, match):
    with pytest.raises(ProtocolError, match=match):
        decode(parts)


def test_requests_out_of_bounds_are_refused_before_the_journal(spec, tmp_path):
    journal = Journal(tmp_path)
    service = make_service(spec, Clock(), journal, max_world_size=64, max_workers=2)
    size = journal.path.stat().st_size
    t, reply = hello(service, spec, world_size=30_000_000)
    assert t == "error" and "maximum 64" in reply["message"]
    assert hello(service, spec, world_size=2)[0] == "welcome"
    t, reply = call(service, "start_epoch", session=session(service, "c0"), epoch=2**40)
    assert t == "error" and reply["code"] == "bad_epoch"
    call(service, "start_epoch", session=session(service, "c0"), epoch=0)
    assert call(service, "finish_epoch", session=session(service, "c0"), seq=5)[1]["code"] == "bad_epoch"
    register(service, 2)
    assert call(service, "register", addr="tcp://127.0.0.1:9", pid=1,
                fingerprint=spec.fingerprint())[1]["code"] == "full"
    assert call(service, "register", addr="ipc:///x", pid=1)[0] == "error"
    grown = journal.path.stat().st_size - size
    before = grown
    # Acks of splits or epochs the rank does not have are not journaled.
    call(service, "client_heartbeat", session=session(service, "c0"), seq=0, acks=[[10**6, 1]])
    call(service, "client_heartbeat", session=session(service, "c0"), seq=3, acks=[[0, 1]])
    assert journal.path.stat().st_size - size == before


def test_a_record_that_cannot_be_applied_does_not_keep_the_master_down(spec, tmp_path):
    journal = Journal(tmp_path)
    service = make_service(spec, Clock(), journal)
    hello(service, spec)
    journal.append(U.SplitAssigned(0, 999, "w-gone", 0.0))   # damage: a split no epoch has
    journal.close()
    restarted = MasterService(MasterConfig(), Journal(tmp_path), Clock())
    assert restarted.state.job is not None and (tmp_path / "journal.quarantine").exists()


def test_client_specs_read_only_allowed_tables(spec, tables, tmp_path):
    from remoteloader.core.allowlist import TableAllowlist

    root = str(tables["orc"].parent)
    assert TableAllowlist([root]).allows(str(tables["orc"]))
    assert not TableAllowlist([root]).allows(root + "-private/x")
    assert not TableAllowlist([root]).allows(root + "/../etc/shadow")
    assert not TableAllowlist([]).allows(str(tables["orc"]))
    assert TableAllowlist(["s3://bucket/t?endpoint_override=minio:9000"]).allows(
        "s3://bucket/t?endpoint_override=minio:9000")
    assert not TableAllowlist(["s3://bucket/t"]).allows("s3://bucket/t2?endpoint_override=evil:1")
    assert not TableAllowlist(["s3://bucket/"]).allows("/etc/shadow")
    link = tmp_path / "link"
    link.symlink_to("/etc")
    assert not TableAllowlist([str(tmp_path)]).allows(str(link / "shadow"))

    for table in ("/etc/shadow", "/no/such/table"):               # same answer: not an existence oracle
        service = MasterService(MasterConfig(allowed_tables=(root,)), None, Clock())
        other = dict(spec.to_dict(), table={"path": table})
        t, reply = call(service, "hello", rank=0, world_size=1, spec=other, fingerprint="x")
        assert (t, reply["code"]) == ("error", "bad_spec")
        assert reply["message"] == "table.path: this master does not serve that table (see --allow-table)"
    service = MasterService(MasterConfig(allowed_tables=(root,)), None, Clock())
    assert hello(service, spec)[0] == "welcome"


def test_a_slow_bind_does_not_hold_the_loop(spec, monkeypatch):
    import threading as th

    from remoteloader.master import service as service_module

    release = th.Event()
    real = service_module._bind_and_plan
    monkeypatch.setattr(service_module, "_bind_and_plan", lambda s, *budget: (release.wait(30), real(s, *budget))[1])
    service = MasterService(MasterConfig(bind_timeout=60), None, Clock())
    t, reply = hello(service, spec)
    assert (t, reply["code"]) == ("error", "binding")             # answered within BIND_WAIT_S
    assert call(service, "status")[0] == "status_reply"           # the loop serves others meanwhile
    register(service)
    release.set()
    deadline = time.monotonic() + 30
    while (reply := hello(service, spec))[0] == "error" and time.monotonic() < deadline:
        assert reply[1]["code"] == "binding"
        time.sleep(0.05)
    assert reply[0] == "welcome"


def test_a_bind_past_its_deadline_is_refused_naming_the_key(spec, monkeypatch):
    import threading as th

    from remoteloader.master import service as service_module

    never = th.Event()
    monkeypatch.setattr(service_module, "_bind_and_plan", lambda s, *budget: never.wait(30))
    service = MasterService(MasterConfig(bind_timeout=1.0), None, Clock())
    assert hello(service, spec)[1]["code"] == "binding"
    time.sleep(0.6)
    t, reply = hello(service, spec)
    assert t == "error" and reply["code"] == "bad_spec" and reply["message"].startswith("table.path:")
    never.set()


def test_the_journal_compacts_on_what_was_appended_and_never_when_idle(spec, tmp_path, monkeypatch):
    """Consumption is not journaled; the journal is compacted to one snapshot once what was
    appended since the last one outweighs it, so its size follows the current state, not the
    job's age, and an idle master never compacts (a large state used to be compacted on
    every pass once its snapshot alone passed the threshold)."""
    clock = Clock()
    service = make_service(spec, clock, Journal(tmp_path), journal_compact_bytes=2000)
    (w,) = register(service)
    hello(service, spec)
    compactions = []
    real = service.journal.compact
    monkeypatch.setattr(service.journal, "compact", lambda snap: (compactions.append(1), real(snap)))
    for epoch in range(12):
        call(service, "start_epoch", session=session(service, "c0"), epoch=epoch)
        while (reply := call(service, "get_split", worker_id=w))[0] == "split":
            split = reply[1]["split"]
            pieces = -(-(split["row_hi"] - split["row_lo"]) // 100)
            call(service, "split_produced", worker_id=w, epoch=split["epoch"], split_id=split["split_id"])
            for done in range(1, pieces + 1):  # an ack per piece: none of them is journaled
                call(service, "client_heartbeat", session=session(service, "c0"), seq=epoch,
                     acks=[[split["split_id"], done]])
        assert call(service, "finish_epoch", session=session(service, "c0"), seq=epoch) == ("ok", {})
        service.sync()
        snapshot = len(U.encode(service.state.snapshot()))
        assert service.journal.size <= 2 * max(2000, snapshot) + snapshot  # bounded by the state
    assert len(compactions) >= 2
    before = len(compactions)
    for _ in range(50):  # idle passes: nothing appended, nothing compacted
        service.tick()
        service.sync()
    assert len(compactions) == before
    service.journal.close()
    restarted = MasterService(MasterConfig(), Journal(tmp_path), clock)
    assert restarted.state.ranks[0].epoch == 11 and restarted.state.ranks[0].finished


def test_runs_of_a_session_grow_and_acks_of_an_older_run_are_ignored(spec):
    """Epochs 0, 1, 0 in one loader: three runs; a late ack of the first never marks the third."""
    service = make_service(spec, Clock(), prefetch_next_epoch=False)
    register(service)
    hello(service, spec)
    s = session(service)
    seqs = [call(service, "start_epoch", session=s, epoch=e)[1]["seq"] for e in (0, 1, 0)]
    assert seqs == [0, 1, 2]
    run = service.state.ranks[0]
    assert (run.epoch, run.seq) == (0, 2)
    first = sorted(run.splits)[0]
    call(service, "client_heartbeat", session=s, seq=0, acks=[[first, 1]])      # a late ack of run 0
    assert run.splits[first].consumed == 0
    call(service, "client_heartbeat", session=s, seq=2, acks=[[first, 1]])
    assert run.splits[first].consumed == 1
    assert call(service, "finish_epoch", session=s, seq=1)[1]["code"] == "bad_epoch"


def test_a_prefetched_epoch_keeps_its_run_and_split_tasks_name_it(spec):
    service = make_service(spec, Clock())
    (w,) = register(service)
    hello(service, spec)
    s = session(service)
    call(service, "start_epoch", session=s, epoch=0)
    tasks = []
    while (reply := call(service, "get_split", worker_id=w))[0] == "split":
        tasks.append(reply[1]["split"])
        if tasks[-1]["epoch"] == 1:
            break
    assert {(t["session"], t["seq"], t["fingerprint"]) for t in tasks if t["epoch"] == 0} == {(s, 0, spec.fingerprint())}
    assert (tasks[-1]["epoch"], tasks[-1]["seq"]) == (1, 1)               # read ahead: the next run, reserved
    assert call(service, "start_epoch", session=s, epoch=1)[1]["seq"] == 1  # taken over
    assert call(service, "start_epoch", session=s, epoch=0)[1]["seq"] == 2


def test_jobs_follow_one_another_with_another_world_size(spec):
    """A standing master: job A (1 rank) says goodbye, job B (2 ranks) starts; while B is live,
    a job of another world size is refused."""
    service = make_service(spec, Clock())
    (w,) = register(service)
    hello(service, spec, client="a")
    call(service, "start_epoch", session=session(service, "a"), epoch=1)
    assert call(service, "goodbye", session=session(service, "a")) == ("ok", {})
    assert service.state.clients == {} and service.state.ranks == {} and service.state.job.world_size is None
    assert call(service, "goodbye", session=session(service, "a")) == ("ok", {})  # twice is harmless
    for rank in (0, 1):
        assert hello(service, spec, client=f"b{rank}", rank=rank, world_size=2)[0] == "welcome"
        assert call(service, "start_epoch", session=session(service, f"b{rank}"), epoch=0)[0] == "epoch"
    assert hello(service, spec, client="c", rank=0, world_size=1)[1]["code"] == "busy"
    task = call(service, "get_split", worker_id=w)[1]["split"]
    assert task["session"] == session(service, f"b{task['rank']}") and task["seq"] == 0


def test_a_new_session_of_a_rank_replaces_the_old_and_its_runs(spec):
    service = make_service(spec, Clock())
    (w,) = register(service)
    hello(service, spec, client="old")
    call(service, "start_epoch", session=session(service, "old"), epoch=0)
    call(service, "get_split", worker_id=w)
    assert service.state.workers[w].assigned
    hello(service, spec, client="new")  # a new process of rank 0
    assert set(service.state.clients) == {session(service, "new")}
    assert not service.state.workers[w].assigned and 0 not in service.state.ranks
    # Told it was replaced, not invited to rejoin (which would take the rank back, and back again).
    t, reply = call(service, "start_epoch", session=session(service, "old"), epoch=0)
    assert reply["code"] == "replaced" and "took this rank over" in reply["message"]
    assert call(service, "start_epoch", session=session(service, "new"), epoch=0)[1]["seq"] == 0


def test_a_worker_of_another_job_is_told_so(spec):
    service = make_service(spec, Clock())
    t, reply = call(service, "register", addr="tcp://127.0.0.1:9", pid=1, fingerprint="another-job")
    assert (t, reply["code"]) == ("error", "wrong_job") and spec.fingerprint() in reply["message"]
    assert service.state.workers == {}


def test_replay_keeps_the_partitions_whatever_the_cap(spec, tmp_path):
    """Defect 8: partitions were decided inside apply from --max-workers-per-client, so a master
    restarted with another value replayed to other partitions."""
    live = make_service(spec, Clock(), Journal(tmp_path), max_workers_per_client=1)
    register(live, 3)
    for rank in (0, 1, 2):
        hello(live, spec, client=f"c{rank}", rank=rank, world_size=3)
    live.sync()
    assert all(len(m) == 1 for m in live.state.partitions.values())
    live.journal.close()
    restarted = MasterService(MasterConfig(max_workers_per_client=32), Journal(tmp_path), Clock())
    assert restarted.state.partitions == live.state.partitions


def test_a_snapshot_of_another_version_is_refused_before_the_state_changes(spec):
    service = make_service(spec, Clock())
    register(service)
    before = durable_view(service)
    snapshot = msgspec.structs.replace(service.state.snapshot(), version=1)
    with pytest.raises(ValueError, match="snapshot version 1"):
        service.state.apply(snapshot)
    assert durable_view(service) == before


def test_resumes_are_bounded_whatever_a_client_sends(spec):
    """Finding 4 of the red team: done lists for any epoch, 2**20 ranges each, all kept (50
    messages grew a master by 322 MB). Now: coalesced, a few ranges per base split, never for a
    far-off epoch, and a bounded number of epochs kept."""
    from remoteloader.master.service import MAX_DONE_RANGES
    from remoteloader.master.state import MAX_RESUMED_EPOCHS

    service = make_service(spec, Clock())
    register(service)
    hello(service, spec)
    s = session(service)
    rows = service.state.job.splits[0].rows
    fragmented = [[0, i, i + 1] for i in range(0, min(rows, 2 * MAX_DONE_RANGES + 2), 2)]
    t, reply = call(service, "start_epoch", session=s, epoch=0, done=fragmented)
    assert t == "error" and "row ranges in base split 0" in reply["message"]
    adjacent = [[0, i, i + 1] for i in range(min(rows, 100))]  # coalesces to one range
    assert call(service, "start_epoch", session=s, epoch=0, done=adjacent)[0] == "epoch"
    assert service.state.resumed[0] == {0: [(0, min(rows, 100))]}
    t, reply = call(service, "start_epoch", session=s, epoch=2**30, done=[[0, 0, 1]])
    assert (t, reply["code"]) == ("error", "bad_epoch")
    for epoch in range(1, 60):  # each the next epoch: allowed, but only a few are kept
        assert call(service, "start_epoch", session=s, epoch=epoch, done=[[1, 0, 1]])[0] == "epoch"
    assert len(service.state.resumed) <= MAX_RESUMED_EPOCHS and 59 in service.state.resumed


def test_status_reports_pending_workers_apart_from_workers(service):
    """Launched workers that have not started (a Ray actor waiting for room) show as pending,
    never among the workers."""
    assert service.status()["pending_workers"] == 0
    service.pending_workers = lambda: 2
    status = service.status()
    assert status["pending_workers"] == 2 and status["workers"] == []
