"""Capabilities between members (issue 23, findings 3 and 5): a key holder acts only as what
the master admitted it as. Credit without the session's token takes nothing and moves
nobody's run; drain, bye and split reports need the worker's token; registration refuses
addresses clients cannot connect to; a fixed pool refills whatever the exit code."""
from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
from collections import Counter

import pytest
import zmq

from remoteloader import RemoteDataLoader
from remoteloader.client.credit import CreditWindow
from remoteloader.client.fetch import WorkerFetcher
from remoteloader.client.session import RunId
from remoteloader.protocol import auth
from remoteloader.protocol.capability import SEED_FILE, MasterKeys, SessionTokens
from remoteloader.protocol.rpc import RemoteError, RpcClient
from remoteloader.spec import DatasetSpec
from remoteloader.worker import runs
from tests.wire_helpers import decode, encode
from remoteloader.protocol import messages as M

from .conftest import ROWS, master_status, spec_dict
from .test_master_service import Clock, call, make_service, register, spec  # noqa: F401 (spec: a fixture)
from .test_worker_fakes import FakeMaster, Job, RunningWorker, Client


@pytest.fixture(autouse=True)
def _no_ambient_keys(monkeypatch):
    monkeypatch.delenv(auth.ENV_AUTH, raising=False)


# -- the tokens ---------------------------------------------------------------------------------------
def test_a_session_token_verifies_for_its_session_only_and_only_proofs_are_kept():
    keys, tokens = MasterKeys.ephemeral(), SessionTokens()
    token = keys.session_token("s-a")
    assert not tokens.allows(b"c", "s-a", token)  # no master key yet: nothing verifies
    tokens.set_master(keys.verify_key)
    for made_up in ("", "00" * 64, "zz", keys.session_token("s-b"), MasterKeys.ephemeral().session_token("s-a")):
        assert not tokens.allows(b"c", "s-a", made_up)
    assert not tokens._proven  # refused tokens leave nothing behind
    assert tokens.allows(b"c", "s-a", token)
    assert tokens.allows(b"c", "s-a", "")  # the connection proved it: later credit is a dict lookup
    assert not tokens.allows(b"other", "s-a", "")  # another connection proves it again


def test_worker_tokens_and_the_stored_seed(tmp_path):
    keys = MasterKeys.stored(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / SEED_FILE).st_mode) == 0o600
    again = MasterKeys.stored(tmp_path)  # a restart on the same journal: the same keys
    assert again.verify_key == keys.verify_key and again.session_token("s-1") == keys.session_token("s-1")
    assert keys.worker_token_ok("w-1", again.worker_token("w-1"))
    assert not keys.worker_token_ok("w-2", keys.worker_token("w-1")) and not keys.worker_token_ok("w-1", "")
    assert MasterKeys.ephemeral().verify_key != keys.verify_key
    (tmp_path / SEED_FILE).write_bytes(b"short")
    with pytest.raises(ValueError, match="not a capability seed"):
        MasterKeys.stored(tmp_path)


# -- the master: what a member can no longer do with an id it read in status ---------------------------
def test_drain_bye_and_split_requests_need_the_workers_token(spec):
    service = make_service(spec, Clock())
    (w,) = register(service)
    for token in ("", "0" * 64, service.keys.worker_token("w-other")):
        t, reply = call(service, "drain", worker_id=w, token=token)
        assert t == "error" and reply["code"] == "unknown_worker"
        assert call(service, "get_split", worker_id=w, token=token)[1]["code"] == "unknown_worker"
        assert call(service, "splits_released", worker_id=w, token=token, splits=[], reason="silent")[0] == "error"
        assert call(service, "heartbeat", worker_id=w, token=token, buffered=0)[1]["state"] == "unknown"
        call(service, "bye", worker_id=w, token=token)
    assert w in service.state.workers and not service.state.workers[w].draining
    assert call(service, "drain", worker_id=w)[0] == "ok"  # the worker itself (its token)
    assert service.state.workers[w].draining


@pytest.mark.parametrize("addr", ["tcp://*:1", "tcp://0.0.0.0:7000", "tcp://[::]:7000", "tcp://127.0.0.1:0",
                                  "tcp://127.0.0.1:65536", "tcp://127.0.0.1", "ipc:///tmp/x", "tcp://h st:1"])
def test_register_refuses_an_address_clients_cannot_connect_to(spec, addr):
    service = make_service(spec, Clock())
    t, reply = call(service, "register", addr=addr, pid=1, fingerprint=service.state.job.fingerprint)
    assert t == "error" and "register" in reply["message"]
    assert not service.state.workers


def test_welcome_carries_the_session_token(spec):
    service = make_service(spec, Clock())
    t, reply = call(service, "hello", rank=0, world_size=1, spec=spec.to_dict(), fingerprint=spec.fingerprint())
    tokens = SessionTokens()
    tokens.set_master(service.keys.verify_key)
    assert t == "welcome" and tokens.allows(b"c", reply["session"], reply["token"])


# -- the client: an address it cannot use ------------------------------------------------------------------
def test_a_client_skips_a_worker_it_cannot_connect_to_with_one_warning(caplog):
    ctx = zmq.Context.instance()
    fetcher = WorkerFetcher(ctx, 0, RunId("s-1", 0, 0, "t"), CreditWindow(2, 1 << 20), ["s0"])
    try:
        members = [["w-bad", "tcp://*:1"], ["w-good", "tcp://127.0.0.1:9"]]
        with caplog.at_level(logging.WARNING, logger="remoteloader.client.fetch"):
            fetcher.set_workers(members)
            fetcher.set_workers(members)  # every heartbeat lists it again: warned about once
        assert list(fetcher.sockets) == ["w-good"]
        warnings = [r.getMessage() for r in caplog.records if "w-bad" in r.getMessage()]
        assert len(warnings) == 1 and "tcp://*:1" in warnings[0]
    finally:
        fetcher.close()


# -- a worker: credit from sessions the master never admitted ------------------------------------------
def test_made_up_sessions_cannot_fill_the_workers_tables(tables, monkeypatch):
    """More made-up sessions than a worker remembers: the real session is still served.
    (The worker remembers 256 here, not 16,384: each made-up token costs a signature check.)"""
    monkeypatch.setattr(runs, "MAX_SESSIONS", 256)
    job = Job(tables["orc"])
    master = FakeMaster(job)
    worker = RunningWorker(master.addr)
    flood, client = Client(worker.worker.addr), Client(worker.worker.addr)
    try:
        master.wait_for(lambda m: m["t"] == "heartbeat")  # registered: it knows the master's key
        for i in range(runs.MAX_SESSIONS + 100):
            flood.credit(f"s-{i:012x}", 0, token="00" * 64)
        master.splits.put(job.task(0, "s-real"))
        client.credit("s-real", 0)
        header, arrays = client.batch()
        assert header["session"] == "s-real" and len(arrays["labels"]) > 0
        assert not flood.sock.poll(200)
    finally:
        flood.close()
        client.close()
        worker.stop()
        master.close()


# -- real processes with keys: the red team's attacks ---------------------------------------------------
class Thief:
    """A key holder that read the victim's session in status and credits it at every worker,
    with no token, a made-up one, and the valid token of a session of its own."""

    def __init__(self, creds: auth.Credentials, workers: list[dict], session: str, tokens: list[str]) -> None:
        self.session, self.tokens = session, tokens
        self.ctx = zmq.Context()
        self.socks = []
        for w in workers:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 64)
            # A worker's data socket is plain since protocol 10 (its messages are sealed), so the
            # thief connects plainly: its keys buy it nothing there but what it can seal.
            sock.connect(w["addr"])
            self.socks.append(sock)
        self.rows = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def credit_once(self) -> None:
        for sock in self.socks:
            for seq in (0, 1, 2):  # the victim's run, and later ones that would retire it
                for token in self.tokens:
                    try:  # never block the thief's thread on a full queue
                        sock.send_multipart(encode("credit", session=self.session, token=token, seq=seq,
                                                   pieces=1 << 20, bytes=1 << 40), zmq.NOBLOCK)
                    except zmq.Again:
                        pass

    def _run(self) -> None:
        while not self.stop.is_set():
            self.credit_once()
            for sock in self.socks:
                for _ in range(1000):  # bounded: the stop flag is checked even under a flood
                    if not sock.poll(0):
                        break
                    header, _ = decode(sock.recv_multipart())
                    self.rows += sum(header.get("rows", []))
            self.stop.wait(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.ctx.destroy(linger=0)


@pytest.mark.slow
def test_a_key_holder_without_the_token_takes_no_row_of_another_rank(tables, cluster, tmp_path):
    keys = auth.keygen(tmp_path / "keys")
    creds = auth.load(keys)
    master = cluster.master("--auth", keys, workers=2)
    spec = spec_dict(tables["orc"], batch_size=128)
    # The thief is a member: it said hello first, so it holds a valid token of a session of its own.
    parsed = DatasetSpec.from_dict(spec)
    rpc = RpcClient(zmq.Context.instance(), master.addr, 10, auth=creds)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                own = rpc.call(M.Hello(rank=0, world_size=1, spec=parsed.to_dict(), fingerprint=parsed.fingerprint()))
                break
            except RemoteError as e:  # "binding": the master reads the table's metadata; ask again, as loaders do
                if e.code != "binding" or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        rpc.close()
    with RemoteDataLoader(spec, master=master.addr, auth=keys, timeout=60) as victim:
        len(victim)  # says hello (replacing the thief's session): the victim's session exists now
        deadline = time.monotonic() + 60
        while len((status := master_status(master.addr, auth=keys))["workers"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        (session,) = [c["id"] for c in status["clients"]]  # what status shows every member
        thief = Thief(creds, status["workers"], session, ["", "00" * 64, own.token])
        thief.credit_once()  # before the victim starts its epoch
        thief.thread.start()  # and all through it
        try:
            seen = Counter(r for b in victim for r in b.passthrough["row_id"].tolist())
            again = Counter(r for b in victim for r in b.passthrough["row_id"].tolist())  # the next epoch too
        finally:
            thief.close()
    assert thief.rows == 0
    assert len(seen) == ROWS and set(seen.values()) == {1}
    assert len(again) == ROWS and set(again.values()) == {1}


@pytest.mark.slow
def test_only_the_worker_drains_itself_and_a_fixed_pool_refills_after_exits_with_code_0(tables, cluster, tmp_path):
    keys = auth.keygen(tmp_path / "keys")
    master = cluster.master("--auth", keys, workers=2)
    spec = spec_dict(tables["parquet"])
    with RemoteDataLoader(spec, master=master.addr, auth=keys, timeout=60) as loader:
        len(loader)  # the first hello makes the job: workers register once there is one
    deadline = time.monotonic() + 60
    while len(workers := master_status(master.addr, auth=keys)["workers"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(workers) == 2
    rpc = RpcClient(zmq.Context.instance(), master.addr, 10, auth=auth.load(keys))
    try:
        for w in workers:  # a member that read the ids in status
            with pytest.raises(RemoteError, match="unknown worker"):
                rpc.call(M.Drain(worker_id=w["id"], token=""))
    finally:
        rpc.close()
    assert not any(w["draining"] for w in master_status(master.addr, auth=keys)["workers"])
    # Workers that leave on their own, in order (SIGTERM: drain, then exit 0): the pool tops up.
    first = set(master.worker_pids())
    for pid in first:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while (set(master.worker_pids()) & first or len(master.worker_pids()) < 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(master.worker_pids()) == 2 and not set(master.worker_pids()) & first
    with RemoteDataLoader(spec, master=master.addr, auth=keys, timeout=60) as loader:
        seen = Counter(r for b in loader for r in b.passthrough["row_id"].tolist())
    assert len(seen) == ROWS and set(seen.values()) == {1}
