"""Locality (protocol 13): a rank reads from the workers of its own node first, and from other
nodes' workers only while its node has none. Partitions are decided by ``JobState`` and
journaled as ``PartitionsChanged``; the nodes come from ``register.node`` and ``hello.node``."""
from __future__ import annotations

from remoteloader.master import updates as U
from remoteloader.master.journal import Journal
from remoteloader.master.state import JobState
from remoteloader.protocol import messages as M
from remoteloader.protocol import wire
from remoteloader.spec import DatasetSpec
from tests.conftest import spec_dict
from tests.test_master_service import Clock, call, make_service
from tests.test_master_state import _MEMBERSHIP, FILES, SPEC, apply, splits

MANY = [[0, i, i + 1, 20, 20, 20 * i] for i in range(16)]


def job() -> JobState:
    st = JobState()
    st.apply(U.JobSubmitted(SPEC, "fp", {"x": "float"}, FILES, splits(MANY), []))
    return st


def worker(st: JobState, wid: str, node: str) -> None:
    apply(st, U.WorkerRegistered(wid, f"tcp://{node}:1", 1, 0.0, node=node))


def rank(st: JobState, r: int, node: str, world: int = 4) -> None:
    apply(st, U.ClientJoined(f"c{r}", r, world, 0.0, node=node))


def test_each_rank_reads_from_its_own_nodes_workers():
    st = job()
    for wid, node in (("a1", "n0"), ("a2", "n0"), ("b1", "n1"), ("b2", "n1")):
        worker(st, wid, node)
    for r, node in enumerate(("n0", "n0", "n1", "n1")):
        rank(st, r, node)
    assert st.partitions == {0: ["a1", "a2"], 1: ["a1", "a2"], 2: ["b1", "b2"], 3: ["b1", "b2"]}


def test_a_rank_whose_node_has_no_worker_yet_falls_back_and_then_gains_its_own():
    st = job()
    worker(st, "a1", "n0")
    worker(st, "a2", "n0")
    rank(st, 0, "n0", world=2)
    rank(st, 1, "n1", world=2)       # node n1's workers are still starting: n0's serve it meanwhile
    assert st.partitions == {0: ["a1", "a2"], 1: ["a1", "a2"]}
    worker(st, "b1", "n1")
    worker(st, "b2", "n1")            # they join its partition; the members it had stay (they may hold its data)
    assert st.partitions == {0: ["a1", "a2"], 1: ["a1", "a2", "b1", "b2"]}
    for r in range(2):
        st.apply(U.EpochStarted(r, 0, f"c{r}", 0))
    # A worker serving another node's rank hands out its own node's splits first ...
    run, _ = st.choose_split("a1")
    assert run is st.ranks[0]
    for _ in range(len(st.ranks[0].pending) - 1):
        run, progress = st.choose_split("a1")
        st.apply(U.SplitAssigned(0, progress.split.id, "a1", 0.0))
    run, progress = st.choose_split("a2")
    st.apply(U.SplitAssigned(0, progress.split.id, "a2", 0.0))
    assert not st.ranks[0].pending
    # ... and the other node's once its own have none left: the fallback.
    assert st.choose_split("a1")[0] is st.ranks[1]
    assert st.choose_split("b1")[0] is st.ranks[1]


def test_a_node_that_loses_every_worker_falls_back_to_the_others():
    st = job()
    for wid, node in (("a1", "n0"), ("b1", "n1")):
        worker(st, wid, node)
    rank(st, 0, "n0", world=2)
    rank(st, 1, "n1", world=2)
    assert st.partitions == {0: ["a1"], 1: ["b1"]}
    apply(st, U.WorkerLost("b1", "its host went away"))
    assert st.partitions == {0: ["a1"], 1: ["a1"]}


def test_the_per_client_cap_holds_among_a_nodes_workers():
    st = job()
    for i in range(3):
        worker(st, f"a{i}", "n0")
        worker(st, f"b{i}", "n1")
    for r in range(4):
        apply(st, U.ClientJoined(f"c{r}", r, 4, 0.0, node="n0" if r < 2 else "n1"), cap=2)
    for r, members in st.partitions.items():
        assert len(members) == 2 and {m[0] for m in members} == {"a" if r < 2 else "b"}


def test_without_node_names_partitions_are_as_before():
    """"" is a node too: a cluster that names none is one node, every worker local."""
    st = job()
    for i in range(3):
        worker(st, f"w{i}", "")
    for r in range(2):
        rank(st, r, "", world=2)
    assert st.partitions == {0: ["w0", "w1", "w2"], 1: ["w0", "w1", "w2"]}


def test_nodes_are_journaled_and_a_replayed_or_restored_state_decides_the_same(tmp_path):
    journal = Journal(tmp_path)
    st = JobState()

    def commit(u: U.Update) -> None:  # as MasterService._commit: a membership change, then its partitions
        for record in (u, *([] if not isinstance(u, _MEMBERSHIP) else [None])):
            record = record or U.PartitionsChanged(sorted(st.balanced_partitions(32).items()))
            st.apply(record)
            journal.append(record)

    commit(U.JobSubmitted(SPEC, "fp", {"x": "float"}, FILES, splits(MANY), []))
    commit(U.WorkerRegistered("a1", "tcp://a:1", 1, 0.0, node="n0"))
    commit(U.ClientJoined("c0", 0, 2, 0.0, node="n0"))
    commit(U.ClientJoined("c1", 1, 2, 0.0, node="n1"))   # falls back to n0's worker
    commit(U.WorkerRegistered("b1", "tcp://b:1", 1, 0.0, node="n1"))
    journal.close()
    replayed = JobState()
    for u in Journal(tmp_path).replay():
        replayed.apply(u)
    restored = JobState()
    restored.apply(U.decode(U.encode(st.snapshot())))
    for other in (replayed, restored):
        assert other.partitions == st.partitions == {0: ["a1"], 1: ["a1", "b1"]}
        assert other.balanced_partitions(32) == st.balanced_partitions(32)
        assert {w.worker_id: w.node for w in other.workers.values()} == {"a1": "n0", "b1": "n1"}
        assert other.rank_node == {0: "n0", 1: "n1"}


def test_register_and_hello_carry_the_node_on_the_wire():
    for message in (M.Register(addr="tcp://10.0.0.2:4000", pid=1, fingerprint="fp", node="node-1"),
                    M.Hello(rank=0, world_size=2, spec={}, fingerprint="fp", node="node-1")):
        assert wire.decode(wire.encode(message))[0] == message


def test_the_master_partitions_by_the_nodes_named_in_register_and_hello_and_keeps_them_over_a_restart(
        tables, tmp_path):
    spec = DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=100))
    service = make_service(spec, Clock(), Journal(tmp_path))
    workers = {}
    for i, node in enumerate(("node-0", "node-1", "node-1")):
        t, reply = call(service, "register", addr=f"tcp://10.0.0.{i}:7000", pid=i, fingerprint=spec.fingerprint(),
                        node=node)
        workers[reply["worker_id"]] = node
    for r, node in enumerate(("node-0", "node-1")):
        t, _ = call(service, "hello", rank=r, world_size=2, spec=spec.to_dict(), fingerprint=spec.fingerprint(),
                    node=node)
        assert t == "welcome"
    expected = {r: [w for w, node in workers.items() if node == f"node-{r}"] for r in range(2)}
    assert service.state.partitions == expected
    assert {w["node"] for w in service.status()["workers"]} == {"node-0", "node-1"}
    service.sync()
    service.journal.close()
    again = make_service(spec, Clock(), Journal(tmp_path))  # a restarted master replays its journal
    assert again.state.partitions == expected and again.state.rank_node == {0: "node-0", 1: "node-1"}
