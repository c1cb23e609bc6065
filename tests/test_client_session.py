"""The client's session unit against a fake master (in process): one rejoin path, taken by any
call that finds the master does not know the client, starting an epoch included."""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import pytest
import zmq

from remoteloader.client.control import ControlChannel
from remoteloader.client.session import ClientSession, RunStart
from remoteloader.protocol.rpc import MasterUnavailable, RemoteError, RpcClient
from remoteloader.spec import load_spec
from tests.wire_helpers import decode, encode
from remoteloader.protocol import messages as M

JOB = {"fingerprint": "f", "plan": "p", "total_rows": 10, "rank_rows": 10, "dropped_rows": 0, "world_size": 1,
       "sparse_keys": [], "sparse_scored": [], "dense_width": 0}


class FakeMaster:
    """A ROUTER answering each request with ``answer(header)`` (a (type, fields) pair); records requests."""

    def __init__(self, answer: Callable[[dict], tuple[str, dict]]) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"tcp://127.0.0.1:{port}"
        self.answer = answer
        self.requests: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *parts = self.sock.recv_multipart()
            header, _ = decode(parts)
            self.requests.append(header)
            reply = self.answer(header)
            if reply is not None:
                t, fields = reply
                self.sock.send_multipart([ident, *encode(t, **fields)])

    def types(self) -> list[str]:
        return [r["t"] for r in self.requests]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)


class SessionsMaster:
    """Issues sessions; forgets them all on ``forget()`` (a restart without a journal)."""

    def __init__(self) -> None:
        self.known: set[str] = set()
        self.seq = 0

    def forget(self) -> None:
        self.known.clear()

    def __call__(self, h: dict) -> Optional[tuple[str, dict]]:
        if h["t"] == "hello":
            session = f"s-{len(self.known)}-{self.seq}"
            self.seq += 1
            self.known.add(session)
            return "welcome", {"session": session, "token": "t", "job": JOB}
        if h.get("session") not in self.known:
            return "error", {"message": f"unknown client {h.get('session')}; say hello again", "code": "unknown_client"}
        if h["t"] == "start_epoch":
            self.seq += 1
            return "epoch", {"epoch": h["epoch"], "seq": self.seq, "splits": []}
        if h["t"] == "client_heartbeat":
            return "membership", {"workers": [], "errors": []}
        return "ok", {}


@pytest.fixture
def master():
    logic = SessionsMaster()
    fake = FakeMaster(logic)
    fake.logic = logic
    yield fake
    fake.close()


def make_session(addr: str, welcomed: Optional[list] = None, timeout: float = 10.0) -> ClientSession:
    spec = load_spec({"table": {"path": "/nonexistent"}, "batch_size": 2,
                      "features": {"label": "label", "dense": ["x"]}})
    rpc = RpcClient(zmq.Context.instance(), addr, 5.0)
    hook = welcomed.append if welcomed is not None else (lambda job: None)
    return ClientSession(rpc, spec, 0, 1, timeout, 5.0, on_welcome=hook)


def test_start_epoch_rejoins_when_the_master_forgot_the_client(master):
    welcomed: list = []
    session = make_session(master.addr, welcomed)
    session.start_epoch(RunStart(0, [], []))
    session.finish_run([], timeout_s=5.0)
    first = session.id
    master.logic.forget()  # restarted without a journal between two epochs (defect 7)
    reply = session.start_epoch(RunStart(1, [], []))
    assert reply.epoch == 1 and session.id != first and session.run.session == session.id
    assert master.types() == ["hello", "start_epoch", "client_heartbeat", "finish_epoch", "start_epoch", "hello",
                              "start_epoch"]
    assert len(welcomed) == 2  # the plan is checked again on the new welcome


def test_a_heartbeat_that_finds_the_client_unknown_restarts_the_run_from_what_was_consumed(master):
    session = make_session(master.addr)
    session.start_epoch(RunStart(3, [[0, 0, 5]], []))
    session.resume_point = lambda: RunStart(3, [[0, 0, 5]], [[7, 2]])
    old_run = session.run
    master.logic.forget()
    session.heartbeat([[7, 2]])
    assert master.types()[-4:] == ["client_heartbeat", "hello", "start_epoch", "client_heartbeat"]
    restart = master.requests[-2]
    assert restart["epoch"] == 3 and restart["consumed"] == [[7, 2]] and restart["done"] == [[0, 0, 5]]
    last = master.requests[-1]
    assert (last["session"], last["seq"]) == (session.run.session, session.run.seq)
    assert session.run.session != old_run.session and session.run.seq != old_run.seq


def test_a_heartbeat_error_for_a_run_since_rejoined_is_dropped_not_rejoined_again(master):
    """CI flake of test_master_restart_without_journal_still_exactly_once: the control
    thread's beat named the old run while the training thread rejoined; raising its
    ``unknown_client`` rejoined a second time, and that hello ended the first rejoin's
    session (``replaced``) while its beats were in flight, which ended the loader."""
    session = make_session(master.addr)
    session.start_epoch(RunStart(0, [], []))
    session.resume_point = lambda: RunStart(0, [], [])
    control = ControlChannel(zmq.Context.instance(), master.addr, lambda: session.run,
                             lambda: M.ClientStats(), interval_s=600.0)
    try:
        master.logic.forget()
        control.report([], urgent=True)  # a beat of the old run: unknown_client
        control.wait_reply(10.0)
        session.rejoin_after(RemoteError("unknown client", "unknown_client"))  # the training thread's own rejoin
        hellos = master.types().count("hello")
        assert control.take_reply() is None  # the old run's error is not this run's
        control.report([], urgent=True)  # a beat of the new run: answered
        control.wait_reply(10.0)
        assert isinstance(control.take_reply(), M.Membership)
        master.logic.forget()
        control.report([], urgent=True)
        control.wait_reply(10.0)
        with pytest.raises(RemoteError, match="unknown client"):  # the current run's error still raises
            control.take_reply()
        assert master.types().count("hello") == hellos
    finally:
        control.close()


def test_the_end_of_a_delivered_epoch_never_raises_nor_rejoins(master):
    session = make_session(master.addr)
    session.start_epoch(RunStart(0, [], []))
    master.logic.forget()
    session.finish_run([[1, 4]], timeout_s=5.0)  # unknown_client: logged, no hello
    assert master.types()[-1] == "client_heartbeat" and session.run is None
    session.start_epoch(RunStart(1, [], []))  # the next epoch rejoins
    assert master.types()[-3:] == ["start_epoch", "hello", "start_epoch"]


def test_the_end_of_a_delivered_epoch_gives_up_on_a_silent_master():
    fake = FakeMaster(lambda h: {"hello": ("welcome", {"session": "s-1", "token": "t", "job": JOB}),
                                 "start_epoch": ("epoch", {"epoch": 0, "seq": 0, "splits": []})}.get(h["t"]))
    try:
        session = make_session(fake.addr, timeout=600.0)
        session.start_epoch(RunStart(0, [], []))
        session.finish_run([], timeout_s=0.5)  # returns (bounded by its own timeout, not the loader's)
        assert fake.types()[:3] == ["hello", "start_epoch", "client_heartbeat"] and session.run is None
    finally:
        fake.close()


def test_other_errors_are_not_taken_for_a_rejoin():
    fake = FakeMaster(lambda h: ("welcome", {"session": "s-1", "token": "t", "job": JOB}) if h["t"] == "hello"
                      else ("error", {"message": "spec_mismatch here", "code": "spec_mismatch"}))
    try:
        session = make_session(fake.addr)
        with pytest.raises(RemoteError, match="spec_mismatch here"):
            session.start_epoch(RunStart(0, [], []))
        assert fake.types() == ["hello", "start_epoch"]
    finally:
        fake.close()


def test_a_replaced_session_stops_rather_than_rejoins():
    fake = FakeMaster(lambda h: ("welcome", {"session": "s-1", "token": "t", "job": JOB}) if h["t"] == "hello"
                      else ("error", {"message": "another loader took this rank over", "code": "replaced"}))
    try:
        session = make_session(fake.addr)
        with pytest.raises(RemoteError, match="rank 0: this loader's session has ended: another loader took"):
            session.start_epoch(RunStart(0, [], []))
        assert fake.types() == ["hello", "start_epoch"]
    finally:
        fake.close()


def test_goodbye_is_best_effort_and_short():
    fake = FakeMaster(lambda h: ("welcome", {"session": "s-1", "token": "t", "job": JOB})
                      if h["t"] == "hello" else None)
    try:
        session = make_session(fake.addr)
        session.hello()
        session.goodbye(timeout_s=0.2)  # the master never answers: logged, not raised
        assert fake.types() == ["hello", "goodbye"] and session.id is None
    finally:
        fake.close()


def test_the_retry_policy_gives_up_at_the_deadline_in_one_line():
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        rpc = RpcClient(ctx, f"tcp://127.0.0.1:{port}", 0.1)
        with pytest.raises(MasterUnavailable, match="gave up after") as err:
            rpc.call_with_retry(M.Status(), time.monotonic() + 0.5)
        assert "\n" not in str(err.value)
        rpc.close()
    finally:
        silent.close(linger=0)


def test_a_following_jobs_waits_for_data_are_retried_and_counted_apart(master):
    """``waiting`` (the next window has no data yet) is retried, with growing pauses, until the
    window opens; the answers and the pauses are counted (DataWait), not raised."""
    logic, waits = master.logic, [2]

    def answer(h: dict) -> Optional[tuple[str, dict]]:
        if h["t"] == "start_epoch" and waits[0] > 0:
            waits[0] -= 1
            return "error", {"message": "epoch 1: no new data", "code": "waiting"}
        return logic(h)

    master.answer = answer
    session = make_session(master.addr)
    assert session.start_epoch(RunStart(1, [], [])).epoch == 1
    assert master.types() == ["hello", "start_epoch", "start_epoch", "start_epoch"]
    assert session.data_wait.answers == 2 and session.data_wait.seconds >= 0.05 + 0.1  # WAITING_RETRY_S doubles
