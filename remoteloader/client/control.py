"""The client's control channel: acks and heartbeats to the master on their own thread.

The training thread never waits on the master mid-epoch: it hands its acks to the
channel (``report``) and picks up the master's newest answer (``take_reply``) between
batches. The channel's thread owns its own socket and heartbeats every ``interval``;
while the master is down or slow it keeps the acks (merged, so nothing is lost or
re-sent twice as a different value) and retries with exponential backoff and jitter,
so a restarting master is not hit by every client at once. Batches keep flowing from
the workers meanwhile.

Acks are cumulative (pieces of a split consumed so far), so merging keeps the largest
count per split and a retry after a lost reply is harmless.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable, Optional

import zmq

from ..protocol import messages as M
from ..protocol.auth import Credentials
from ..protocol.rpc import MasterUnavailable, RemoteError, RpcClient, backoff_delay
from .session import RunId

log = logging.getLogger(__name__)
URGENT_GAP_S = 0.05  # urgent beats (a partition to learn) are still spaced this far apart


class ControlChannel:
    """Heartbeats with acks for one rank's epoch run, on a background thread.

    ``take_reply`` returns the newest ``membership`` reply not yet taken, or an
    exception the master answered with (``RemoteError``, e.g. ``unknown_client``);
    ``unreachable_s`` says how long the master has not answered.

    An error answers the run its beat named. A beat in flight while the training thread
    rejoined names the old run, and its error (``unknown_client``, or ``replaced`` once the
    rejoin's hello took the rank over) says nothing about the new one: ``take_reply`` drops
    it. Raising it would rejoin again, and the second hello would end the first rejoin's
    session while its heartbeats were in flight.
    """

    def __init__(self, ctx: zmq.Context, master: str, run: Callable[[], RunId],
                 stats: Callable[[], M.ClientStats], interval_s: float, auth: Optional[Credentials] = None,
                 call_timeout_s: float = 2.0) -> None:
        self._rpc = RpcClient(ctx, master, call_timeout_s, auth=auth)
        self.run, self.interval_s = run, interval_s  # run(): read per beat, as a rejoin replaces it
        self._stats = stats
        self._lock = threading.Lock()
        self._acks: dict[int, int] = {}  # split id -> pieces consumed, not yet delivered
        self._reply: Optional[M.Membership] = None
        self._error: Optional[tuple[RunId, RemoteError]] = None  # the error and the run whose beat it answered
        self._last_answer = time.monotonic()
        self._wake = threading.Event()  # report() with urgent=True beats at once (at most every URGENT_GAP_S)
        self._replied = threading.Event()
        self._stop = threading.Event()
        self._rng = random.Random()
        self._last_beat = 0.0
        self._thread = threading.Thread(target=self._run, name=f"remoteloader-control-{run().epoch}", daemon=True)
        self._thread.start()

    # -- training thread -------------------------------------------------------------------
    def report(self, acks: list[list[int]], urgent: bool = False) -> None:
        if acks:
            with self._lock:
                for sid, pieces in acks:
                    if pieces > self._acks.get(sid, -1):
                        self._acks[sid] = pieces
        if urgent:
            self._wake.set()

    def wait_reply(self, timeout_s: float) -> None:
        """Block until the master answers a heartbeat (or ``timeout_s`` passes)."""
        self._replied.wait(timeout_s)

    def take_reply(self) -> Optional[M.Membership]:
        """The newest reply since the last call; raises the master's error, if it sent one."""
        with self._lock:
            error, self._error = self._error, None
            reply, self._reply = self._reply, None
            self._replied.clear()
        if error is not None:
            answered, e = error
            if answered is self.run():  # the training thread owns the run: no race in this check
                raise e
            log.info("dropped the master's answer to a heartbeat of a run since rejoined: %s", e)
        return reply

    @property
    def unreachable_s(self) -> float:
        return time.monotonic() - self._last_answer

    def close(self) -> list[list[int]]:
        """Stop the thread; return the acks it could not deliver (for a final call)."""
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._rpc.close()
        with self._lock:
            return [[sid, pieces] for sid, pieces in sorted(self._acks.items())]

    # -- control thread --------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            delay = self.interval_s if failures == 0 else backoff_delay(failures, self.interval_s, self._rng)
            if self._wake.wait(delay):
                self._stop.wait(max(0.0, self._last_beat + URGENT_GAP_S - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            self._last_beat = time.monotonic()
            if self._beat():
                failures = 0
            else:
                failures += 1

    def _beat(self) -> bool:
        with self._lock:
            sending = dict(self._acks)
        run = self.run()
        try:
            reply = self._rpc.call(M.ClientHeartbeat(session=run.session, seq=run.seq,
                                                     acks=[M.Ack(sid, p) for sid, p in sorted(sending.items())],
                                                     stats=self._stats()), stop=self._stop)
        except MasterUnavailable as e:
            log.warning("%s; heartbeats retry with backoff", e)
            return False
        except RemoteError as e:
            with self._lock:
                self._error = (run, e)
            self._replied.set()
            self._last_answer = time.monotonic()
            return True
        with self._lock:
            for sid, pieces in sending.items():
                if self._acks.get(sid) == pieces:
                    del self._acks[sid]
            self._reply = reply
        self._replied.set()
        self._last_answer = time.monotonic()
        return True
