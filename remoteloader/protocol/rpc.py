"""Request/reply to the master over a DEALER socket, with a deadline.

The ZeroMQ guide's "Lazy Pirate": one request in flight; when the deadline passes, the
socket is closed and a fresh one made, so a late reply to an abandoned request can never
be taken for the answer to the next one.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from typing import Optional, Protocol

import zmq

from . import wire
from .messages import Error, Message, tag
from .auth import Credentials, secure_client
from .address import validate_address
from .handshake import HandshakeMonitor


log = logging.getLogger(__name__)
BACKOFF_MAX_S = 5.0
RETRY_BASE_S = 0.2  # first retry delay of call_with_retry
RETRY_LOG_S = 10.0  # a retrying caller says what it waits for this often, not on every try
_POLLIN = int(zmq.POLLIN)  # a plain int: IntFlag arithmetic runs in Python


def has_message(sock: zmq.Socket) -> bool:
    """Whether a message waits on ``sock``, for loops that drain a socket message by
    message: ``sock.poll(0)`` would build a pyzmq Poller on every call."""
    return bool(sock.get(zmq.EVENTS) & _POLLIN)


def backoff_delay(failures: int, base_s: float, rng: random.Random) -> float:
    """Retry delay after ``failures`` failed calls: exponential, capped, with jitter in
    [0.5, 1.5) of the step so that clients of a restarting master do not retry in step."""
    return min(BACKOFF_MAX_S, base_s * 2 ** min(failures, 16)) * (0.5 + rng.random())


class StopFlag(Protocol):
    """What ends a call's wait early: a ``threading.Event``, or anything else that says ``is_set``."""

    def is_set(self) -> bool: ...


class MasterUnavailable(ConnectionError):
    """The master did not answer within the deadline."""


class HandshakeRefused(MasterUnavailable):
    """The master refused our handshake (keys differ, or one side has none): said within a
    call's first poll, not after its deadline, and not retried by ``call_with_retry``."""


class RemoteError(RuntimeError):
    """The master answered with an error message; ``code`` says which kind (see protocol.md)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class RpcClient:
    def __init__(self, ctx: zmq.Context, addr: str, timeout_s: float, auth: Optional[Credentials] = None) -> None:
        validate_address(addr, "master address")  # AddressError (a ValueError): one line, not a ZMQError later
        self.ctx, self.addr, self.timeout_s = ctx, addr, timeout_s
        self.auth = auth  # CURVE client keys (protocol/auth.py); None: a plain socket
        self._sock: Optional[zmq.Socket] = None
        self._handshake: Optional[HandshakeMonitor] = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self.ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES + 1024)
            if self.auth is not None:
                secure_client(self._sock, self.auth)
            self._handshake = HandshakeMonitor(self._sock, self.auth, f"the master at {self.addr}")
            self._sock.connect(self.addr)
        return self._sock

    def call(self, request: Message, timeout_s: Optional[float] = None,
             stop: Optional[StopFlag] = None) -> Message:
        """Send one request; return the reply. Raises MasterUnavailable or RemoteError.

        With ``stop``, the wait ends early (as unavailable) once the event is set, so a
        thread blocked on a dead master can still shut down promptly.
        """
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        sock = self._socket()
        t = tag(request)
        sock.send_multipart(wire.encode(request))
        deadline = time.monotonic() + timeout
        while not sock.poll(int(1000 * min(0.1, max(0.0, deadline - time.monotonic())))):
            refused = self._handshake.refused() if self._handshake is not None else None
            if refused is not None:
                self.reset()
                raise HandshakeRefused(refused)
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                self.reset()
                raise MasterUnavailable(f"master at {self.addr} did not answer {t!r} within {timeout:g} s")
        reply, _ = wire.decode(sock.recv_multipart(copy=False))
        if isinstance(reply, Error):
            raise RemoteError(reply.message, reply.code or "")
        return reply

    def call_with_retry(self, request: Message, deadline: float, stop: Optional[threading.Event] = None,
                        timeout_s: Optional[float] = None) -> Message:
        """``call``, retried while the master does not answer, until ``deadline`` (monotonic).

        The one retry policy of the master's callers: exponential backoff with jitter (clients
        of a restarting master do not retry in step), a warning every ``RETRY_LOG_S`` saying
        what is awaited, and at the end one ``MasterUnavailable`` naming how long it tried.
        ``stop`` ends the retries early (as unavailable). Errors the master answers with
        (``RemoteError``) are not retried: they are answers.
        """
        rng = random.Random()
        started = last_log = time.monotonic()
        failures = 0
        while True:
            left = deadline - time.monotonic()
            try:
                return self.call(request, timeout_s=max(0.05, min(left, timeout_s or self.timeout_s)), stop=stop)
            except HandshakeRefused:
                raise  # keys: waiting will not change them
            except MasterUnavailable as e:
                now = time.monotonic()
                if now >= deadline or (stop is not None and stop.is_set()):
                    raise MasterUnavailable(f"{e}; gave up after {now - started:.0f} s") from None
                if now - last_log >= RETRY_LOG_S:
                    last_log = now
                    log.warning("waiting for the master at %s (%r unanswered for %.0f s); retrying",
                                self.addr, tag(request), now - started)
                failures += 1
                pause = min(backoff_delay(failures, RETRY_BASE_S, rng), max(0.0, deadline - now))
                if stop is not None:
                    stop.wait(pause)
                else:
                    time.sleep(pause)

    def reset(self) -> None:
        if self._handshake is not None:
            self._handshake.close()
            self._handshake = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    close = reset
