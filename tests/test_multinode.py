"""A multi-node torchrun job's embedded set-up, piece by piece and in process (runs anywhere):
which node a rank is on, the address a node is reached at, the per-job key set through a real
TCPStore on 127.0.0.1, and what each rank starts, publishes and stops, in which order, on one
node and on two. The whole job across network namespaces is tests/test_multinode_torchrun.py."""
from __future__ import annotations

import os
import stat
import threading
from datetime import timedelta

import pytest
import zmq
from torch.distributed import FileStore, PrefixStore, TCPStore

from remoteloader.client import nodes, placement
from remoteloader.client.jobkeys import JobKeys
from remoteloader.client.nodes import ONE_NODE, NodeLayout
from remoteloader.client.placement import MasterPlacement
from remoteloader.client.ranks import RankStore
from remoteloader.protocol import auth
from remoteloader.spec import load_spec

SPEC = load_spec({"table": {"path": "/data/t"}, "batch_size": 2, "features": {"label": "label", "dense": ["x"]}})


def torchrun_env(rank: int, nodes_: int, per_node: int) -> dict[str, str]:
    """What torchrun sets in a rank's environment (``--nnodes``, ``--nproc-per-node``)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(nodes_ * per_node), "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "GROUP_WORLD_SIZE": str(nodes_)}


@pytest.fixture
def tcp_store():
    """A real TCPStore server on 127.0.0.1 (any port), as torchrun's agent runs one; each rank
    connects its own client."""
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    port = server.port
    yield lambda: TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    del server


# -- which node a rank is on -------------------------------------------------------------------
def test_torchrun_variables_say_one_node_or_which_node_and_whether_first():
    assert nodes.torchrun_layout(2, torchrun_env(1, 1, 2)) == ONE_NODE
    assert nodes.torchrun_layout(4, torchrun_env(0, 2, 2)) == NodeLayout("node-0", 2, True)
    assert nodes.torchrun_layout(4, torchrun_env(2, 2, 2)) == NodeLayout("node-1", 2, True)
    assert nodes.torchrun_layout(4, torchrun_env(3, 2, 2)) == NodeLayout("node-1", 2, False)
    assert nodes.torchrun_layout(2, torchrun_env(3, 2, 2)) is None  # a loader given another world: not torchrun's
    assert nodes.torchrun_layout(2, {"RANK": "1", "WORLD_SIZE": "2"}) is None  # started by hand


def test_without_torchrun_the_ranks_tell_nodes_apart_by_host_name_through_the_store(tcp_store):
    def layouts(hosts: list[str], fingerprint: str) -> list[NodeLayout]:
        got: dict[int, NodeLayout] = {}
        threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, nodes.gathered_layout(
            tcp_store(), fingerprint, r, len(hosts), 10, host=hosts[r]))) for r in range(len(hosts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        return [got[r] for r in range(len(hosts))]

    assert layouts(["a", "a", "b", "b"], "f1") == [NodeLayout("a", 2, True), NodeLayout("a", 2, False),
                                                   NodeLayout("b", 2, True), NodeLayout("b", 2, False)]
    assert layouts(["a", "a"], "f2") == [ONE_NODE, ONE_NODE]
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not create their RemoteDataLoader within 0.3 s"):
        nodes.gathered_layout(tcp_store(), "f3", 0, 2, 0.3, host="a")


# -- the address a node is reached at ---------------------------------------------------------
def test_the_rendezvous_is_master_addr_else_the_tcp_store_under_the_prefixes(tcp_store, tmp_path):
    store = PrefixStore("default_pg", tcp_store())
    assert nodes.rendezvous_host(store, {"MASTER_ADDR": "10.1.2.3"}) == "10.1.2.3"
    assert nodes.rendezvous_host(store, {}) == "127.0.0.1"
    assert nodes.rendezvous_host(FileStore(str(tmp_path / "fs"), 1), {}) is None


def test_a_nodes_address_is_the_setting_else_the_interface_toward_the_rendezvous_never_loopback():
    assert nodes.reachable_address("127.0.0.1") == "127.0.0.1"  # the route's source address, nothing sent
    assert nodes.node_address("127.0.0.1", {nodes.ENV_BIND_ADDRESS: "10.9.8.7"}) == "10.9.8.7"
    for setting in ("0.0.0.0", "10.0.0.1:5555", "host name"):  # others connect to it: one concrete host
        with pytest.raises(RuntimeError, match=nodes.ENV_BIND_ADDRESS):
            nodes.node_address("10.0.0.1", {nodes.ENV_BIND_ADDRESS: setting})
    for toward, why in (("127.0.0.1", "a loopback address"), (None, "neither MASTER_ADDR nor a TCP store")):
        with pytest.raises(RuntimeError, match=why) as err:
            nodes.node_address(toward, {})
        assert nodes.ENV_BIND_ADDRESS in str(err.value) and "\n" not in str(err.value)
    assert nodes.tcp_endpoint("10.0.0.1") == "tcp://10.0.0.1:0"
    assert nodes.tcp_endpoint("fd00::1", 5) == "tcp://[fd00::1]:5"
    assert nodes.endpoint_host("tcp://[fd00::1]:5") == "fd00::1"
    assert nodes.endpoint_host("tcp://10.0.0.1:7") == "10.0.0.1"


# -- the per-job key set ------------------------------------------------------------------------
def test_a_job_key_set_is_a_private_key_directory_removed_at_close():
    keys = JobKeys.create()
    directory = keys.directory
    creds = auth.load(directory)  # held to the --auth rules: 0700 directory, 0600 files
    assert creds.public_key == keys.public and creds.secret_key == keys.secret
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    for name in ("cluster.key", "cluster.key_secret", os.path.join(auth.PUBLIC_KEYS, "cluster.key")):
        assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o600
    keys.close()
    assert not os.path.exists(directory)
    keys.close()  # idempotent


@pytest.mark.parametrize("published", [
    None, {"public": "x"}, {"public": "a" * 40, "secret": "b" * 39},
    {"public": "a" * 40, "secret": 'b" injected = "' + "c" * 25},  # 40 characters, not all Z85
])
def test_a_received_key_set_that_is_not_two_z85_keys_is_refused(published):
    with pytest.raises(auth.AuthError):
        JobKeys.received(published)


def test_the_key_set_reaches_another_rank_through_the_store_and_only_it_passes_the_handshake(tcp_store):
    """Rank 0's key set, published in a TCPStore and written by rank 1 into its own directory,
    passes the CURVE handshake of a server keyed by rank 0's; a key set of another job does not."""
    owner = JobKeys.create()
    RankStore(tcp_store()).publish_master("tcp://127.0.0.1:1", "fp", None, owner.published(), "node-0", 1)
    published = RankStore(tcp_store()).discover_master("fp", timeout=5)
    assert (published.node, published.worker_nodes, published.auth) == ("node-0", 1, None)
    mine, stranger = JobKeys.received(published.keys), JobKeys.create()
    assert mine.directory != owner.directory and auth.load(mine.directory).secret_key == owner.secret
    ctx = zmq.Context()
    server_creds = auth.load(owner.directory)
    handle = auth.server_authenticator(ctx, server_creds)
    server = ctx.socket(zmq.ROUTER)
    auth.secure_server(server, server_creds)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    try:
        answered = {}
        for name, keys in (("same job", mine), ("another job", stranger)):
            client = ctx.socket(zmq.DEALER)
            client.linger = 0
            auth.secure_client(client, auth.load(keys.directory), server_public=server_creds.public_key)
            client.connect(f"tcp://127.0.0.1:{port}")
            client.send(name.encode())
            answered[name] = server.poll(1500) and server.recv_multipart()[1].decode()
            client.close()
        assert answered == {"same job": "same job", "another job": 0}
    finally:
        server.close(0)
        handle.close()
        ctx.term()
        for keys in (owner, mine, stranger):
            keys.close()


# -- what each rank starts, publishes and stops ---------------------------------------------------
class Recorder:
    """Fakes of the embedded cluster and of a node's workers, recording what was started and when
    each stopped (no process starts)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[str] = []
        self.clusters: list[dict] = []
        self.workers: list[dict] = []
        recorder = self

        class FakeCluster:
            def __init__(self, auth_dir, bind) -> None:
                self.auth_dir, self.addr = auth_dir, bind.replace(":0", ":5555") if bind else "ipc:///tmp/rl-x/master"

            def close(self) -> None:
                recorder.events.append("master stopped")

        class FakeWorkers:
            def __init__(self, master, count, bind_host, node, auth_dir, tables, cache, log_file) -> None:
                self.node = node
                recorder.workers.append(dict(master=master, bind_host=bind_host, node=node,
                                             key=auth.load(auth_dir).secret_key))

            def close(self) -> None:
                if f"workers of {self.node} stopped" not in recorder.events:
                    recorder.events.append(f"workers of {self.node} stopped")

        def start_embedded(spec, num_workers, auth_dir, bind=None, extra=()):
            self.clusters.append(dict(auth_dir=auth_dir, bind=bind, extra=extra,
                                      key=auth.load(auth_dir).secret_key if auth_dir else None))
            return FakeCluster(auth_dir, bind)

        monkeypatch.setattr(placement, "_start_embedded", start_embedded)
        monkeypatch.setattr(placement, "NodeWorkers", FakeWorkers)
        monkeypatch.setattr(placement, "new_log_file", lambda: None)
        monkeypatch.setenv("REMOTELOADER_QUIET", "1")


class Owner:
    """Stands in for the loader that owns what its placement starts."""


def resolve_ranks(monkeypatch, tcp_store, n_nodes: int, per_node: int, env: dict = {},
                  auth_dir: str | None = None) -> list[MasterPlacement]:
    monkeypatch.delenv("REMOTELOADER_MASTER", raising=False)
    placements, owners = [], []
    for rank in range(n_nodes * per_node):  # rank 0 first: torchrun's variables need no meeting
        for name, value in {**torchrun_env(rank, n_nodes, per_node), **env}.items():
            monkeypatch.setenv(name, value)
        store = tcp_store()
        monkeypatch.setattr(placement, "default_store", lambda store=store: store)
        owners.append(Owner())
        placements.append(MasterPlacement.resolve(owners[-1], SPEC, rank, n_nodes * per_node, None, 2, auth_dir, 5))
    for p, owner in zip(placements, owners):
        p.owner = owner  # kept alive as long as the placement, as a loader is
    return placements


def close_all(placements: list[MasterPlacement], recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank closes at once, each on a thread named after it; each counting itself out is recorded."""
    count_closed = RankStore.count_closed

    def counted(self: RankStore, token: str) -> None:
        recorder.events.append(f"{threading.current_thread().name} counted out")
        count_closed(self, token)

    monkeypatch.setattr(RankStore, "count_closed", counted)
    threads = [threading.Thread(target=placements[r].close, args=(len(placements),), name=f"rank {r}")
               for r in range(len(placements))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_one_node_keeps_the_ipc_master_with_no_keys_no_tcp_and_no_node(monkeypatch, tcp_store):
    recorder = Recorder(monkeypatch)
    placements = resolve_ranks(monkeypatch, tcp_store, n_nodes=1, per_node=2, env={"MASTER_ADDR": "10.0.0.1"})
    assert recorder.clusters == [dict(auth_dir=None, bind=None, extra=(), key=None)]  # today's ipc master
    assert recorder.workers == []
    for p in placements:
        assert (p.addr, p.auth_dir, p.node, p.keys) == ("ipc:///tmp/rl-x/master", None, "", None)
        assert (p.published.keys, p.published.node, p.published.worker_nodes) == (None, None, 0)
    close_all(placements, recorder, monkeypatch)
    assert sorted(recorder.events) == ["master stopped", "rank 0 counted out", "rank 1 counted out"]
    assert recorder.events[-1] == "master stopped"


def test_two_nodes_key_the_master_on_the_nodes_address_start_each_nodes_workers_and_stop_in_order(
        monkeypatch, tcp_store):
    recorder = Recorder(monkeypatch)
    placements = resolve_ranks(monkeypatch, tcp_store, n_nodes=2, per_node=2,
                               env={"MASTER_ADDR": "127.0.0.1", nodes.ENV_BIND_ADDRESS: "10.0.0.1"})
    [cluster] = recorder.clusters
    assert cluster["bind"] == "tcp://10.0.0.1:0" and cluster["auth_dir"] == placements[0].keys.directory
    # node 0's workers are the master's own, bound where the other nodes reach them, named node-0
    assert cluster["extra"] == ("--worker-args", "--bind-host 10.0.0.1 --node node-0")
    # node 1's first rank (rank 2) starts node 1's workers, keyed with the job's key set; nobody else does
    assert recorder.workers == [dict(master="tcp://10.0.0.1:5555", bind_host="10.0.0.1", node="node-1",
                                     key=cluster["key"])]
    assert [p.workers is not None for p in placements] == [False, False, True, False]
    assert [p.node for p in placements] == ["node-0", "node-0", "node-1", "node-1"]
    directories = {p.keys.directory for p in placements}
    assert len(directories) == 4 and {auth.load(d).secret_key for d in directories} == {cluster["key"]}
    assert all(p.auth_dir == p.keys.directory and p.addr == "tcp://10.0.0.1:5555" for p in placements)
    close_all(placements, recorder, monkeypatch)
    events = recorder.events
    # node 1's workers outlive every rank's loader; the master outlives node 1's workers
    assert events.index("workers of node-1 stopped") > max(events.index(f"rank {r} counted out") for r in range(4))
    assert events.index("master stopped") > events.index("workers of node-1 stopped")
    assert not any(os.path.exists(d) for d in directories)  # every rank's copy of the keys is gone


def test_a_key_directory_of_the_users_takes_precedence_over_a_per_job_key_set(monkeypatch, tcp_store, tmp_path):
    recorder = Recorder(monkeypatch)
    keys = auth.keygen(tmp_path / "keys")
    placements = resolve_ranks(monkeypatch, tcp_store, n_nodes=2, per_node=2, auth_dir=keys,
                               env={"MASTER_ADDR": "127.0.0.1", nodes.ENV_BIND_ADDRESS: "10.0.0.1"})
    assert [c["auth_dir"] for c in recorder.clusters] == [keys]
    assert [(p.auth_dir, p.keys, p.published.keys) for p in placements] == [(keys, None, None)] * 4
    assert [w["key"] for w in recorder.workers] == [auth.load(keys).secret_key]
    close_all(placements, recorder, monkeypatch)
    assert os.path.exists(keys)  # the user's own, never removed


def test_a_multi_node_job_meeting_on_loopback_says_what_to_set(monkeypatch, tcp_store):
    Recorder(monkeypatch)
    monkeypatch.delenv(nodes.ENV_BIND_ADDRESS, raising=False)
    with pytest.raises(RuntimeError, match=f"loopback.*{nodes.ENV_BIND_ADDRESS}"):
        resolve_ranks(monkeypatch, tcp_store, n_nodes=2, per_node=1, env={"MASTER_ADDR": "127.0.0.1"})
