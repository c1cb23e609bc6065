"""Helpers for the in-process worker tests (no tests here): a scripted fake master, a
client socket that grants credit, and split tasks of a real table."""
from __future__ import annotations

import itertools
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import pytest
import zmq

from remoteloader.core.binding import bind
from remoteloader.core.plan import SplitTask, plan_base_splits
from remoteloader.protocol import wire
from remoteloader.protocol.capability import MasterKeys
from remoteloader.protocol.messages import SplitTaskRecord
from remoteloader.spec import DatasetSpec
from remoteloader.worker.server import Worker
from tests.wire_helpers import as_map, decode, encode

from .conftest import spec_dict

Reply = Optional[tuple[str, dict]]  # None: no answer (the master is slow, or gone)
# The fake masters' keys: what they sign sessions with, and what Client credit is signed with by default.
MASTER_KEYS = MasterKeys.ephemeral()


class Job:
    """A job a fake master can run: its spec as the master sends it, and its split tasks."""

    def __init__(self, table: Path, **overrides) -> None:
        spec = DatasetSpec.from_dict(spec_dict(table, **overrides))
        bound = bind(spec)
        self.fingerprint = spec.fingerprint()
        self.spec_reply = {"spec": spec.to_dict(), "schema": bound.schema, "fingerprint": self.fingerprint}
        self.splits = plan_base_splits(bound.files, spec.split_rows)
        self.files = bound.files
        self.batch_size = spec.batch_size

    def task(self, index: int, session: str, seq: int = 0, epoch: int = 0, rank: int = 0,
             fingerprint: Optional[str] = None) -> SplitTaskRecord:
        b = self.splits[index]
        return SplitTask(epoch=epoch, split_id=index, rank=rank, base=b.id, file=self.files[b.file],
                         first_unit=b.first_unit, stop_unit=b.stop_unit, raw_rows=b.raw_rows, position=b.position,
                         base_rows=b.rows, row_lo=0, row_hi=b.rows, skip=0, session=session, seq=seq,
                         fingerprint=self.fingerprint if fingerprint is None else fingerprint).to_wire()


class FakeMaster:
    """A master ROUTER socket on a thread. Every request is recorded; ``respond`` answers
    it (the default answers below follow protocol 7; a test overrides ``respond`` or
    scripts ``splits`` and ``heartbeat_state`` to open the window it needs)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.requests: "queue.Queue[dict]" = queue.Queue()
        self.seen: list[dict] = []
        self.splits: "queue.Queue[dict]" = queue.Queue()
        self.heartbeat_state = "run"
        self.sessions: Optional[list[str]] = None
        self.hold_register = threading.Event()  # set: register gets no answer
        self.hold_get_split = threading.Event()  # set: get_split gets no answer (lost in a master crash)
        self.incarnation = "m-first"  # the master process heartbeats name (a restart changes it)
        self.held: "queue.Queue[dict]" = queue.Queue()  # requests left unanswered
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.addr = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def respond(self, m: dict) -> Reply:
        t = m["t"]
        if t == "get_spec":
            return "spec", self.job.spec_reply
        if t == "register":
            if self.hold_register.is_set():
                return None
            if m["fingerprint"] != self.job.fingerprint:
                return "error", {"message": "another job", "code": "wrong_job"}
            worker_id = f"w-{next(self._ids)}"
            return "registered", {"worker_id": worker_id, "heartbeat_interval": 0.05,
                                  "fingerprint": self.job.fingerprint, "token": MASTER_KEYS.worker_token(worker_id),
                                  "verify_key": MASTER_KEYS.verify_key}
        if t == "heartbeat":
            fields = {"state": self.heartbeat_state, "master": self.incarnation}
            if self.sessions is not None:
                fields["sessions"] = list(self.sessions)
            return "heartbeat_ok", fields
        if t == "get_split":
            if self.hold_get_split.is_set():
                self.held.put(m)
                return None
            try:
                return "split", {"split": self.splits.get_nowait()}
            except queue.Empty:
                return "no_split", {"retry_ms": 20, "reason": "none"}
        return "ok", {}

    def wait_for(self, pred: Callable[[dict], bool], timeout: float = 60.0) -> dict:
        """The next request (recorded since the last wait) for which ``pred`` holds; queue.Empty
        if none comes within ``timeout`` (heartbeats keep arriving meanwhile)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.requests.get(timeout=max(0.0, deadline - time.monotonic()))
            if pred(m):
                return m

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *body = self.sock.recv_multipart()
            m, _ = decode(body)
            self.seen.append(m)
            self.requests.put(m)
            reply = self.respond(m)
            if reply is not None:
                self.sock.send_multipart([identity, *encode(reply[0], **reply[1])])


class RunningWorker:
    """A real ``Worker`` on a thread; ``stop`` asks it to stop and joins it."""

    def __init__(self, master: str, **kwargs) -> None:
        kwargs.setdefault("rpc_timeout_s", 1.0)
        self.worker = Worker(master, **kwargs)
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as e:  # the test asserts on it
            self.error = e

    def join(self, timeout: float = 60.0) -> bool:
        """Whether the worker's run returned (a guard against hanging the suite, not a timing)."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def stop(self) -> None:
        self.worker.request("stop")
        assert self.join()


class Client:
    """A client's DEALER to a worker's data socket: grants credit, takes batch messages."""

    def __init__(self, addr: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def credit(self, session: str, seq: int, batches: int = 1000, nbytes: int = 1 << 30,
               token: Optional[str] = None) -> None:
        """Credit as the session's client (``token``: by default the fake master's signature of it)."""
        token = MASTER_KEYS.session_token(session) if token is None else token
        self.sock.send_multipart(encode("credit", session=session, token=token, seq=seq, pieces=batches,
                                        bytes=nbytes))

    def batch(self, timeout_s: float = 60.0) -> tuple[dict, dict]:
        assert self.sock.poll(int(timeout_s * 1000)), "no batch from the worker"
        message, frames = wire.decode(self.sock.recv_multipart(copy=False))
        return as_map(message), wire.unpack_arrays(message.tensors, frames)

    def close(self) -> None:
        self.sock.close(linger=0)


# The fixtures of the worker tests (they import them): a job on the ORC table, and a fake master serving it.
@pytest.fixture()
def job(tables) -> Job:
    return Job(tables["orc"])


@pytest.fixture()
def master(job):
    m = FakeMaster(job)
    yield m
    m.close()
