"""The master's socket loop: a ROUTER that hands each message to ``MasterService``.

Single-threaded by design: every request and every periodic duty runs on this one
loop, so the state needs no locks and updates are applied in one total order.

Each pass handles at most ``MAX_PER_PASS`` waiting requests, makes what they committed
durable with one fsync (group commit), then sends their replies: nobody hears of an
update before it is on disk. Periodic duties (liveness, autoscaling) run between
passes, so a flood of requests delays them by one pass at most.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

import zmq

from ..protocol import messages as M
from ..protocol import wire
from ..protocol.auth import AuthenticatorHandle, Credentials, secure_server, server_authenticator
from ..protocol.rpc import has_message
from .service import MasterService

log = logging.getLogger(__name__)
TICK_S = 0.25  # liveness is judged on seconds-long timeouts; a finer tick costs O(workers) each time
MAX_PER_PASS = 256
COALESCE_S = 0.001  # at most this much latency added, and only while requests arrive back to back


class PeerRateLimit:
    """At most ``limit`` joins (``register``, ``hello``) per peer (ZeroMQ routing identity)
    in each ``window_s``; past it the peer is answered ``error`` code ``flood`` and the
    service never sees the request. The service's totals (``max_workers``, world size)
    bound what many peers together can add; this keeps one peer in a retry loop from
    monopolizing the loop. A legitimate client retries ``hello`` about 5 times a second
    while a spec binds, well under the default."""

    LIMITED = frozenset({"register", "hello"})

    def __init__(self, limit: int = 100, window_s: float = 10.0, max_peers: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self.max_peers, self.clock = limit, window_s, max_peers, clock
        self._peers: OrderedDict[bytes, tuple[float, int]] = OrderedDict()  # peer -> (window start, joins)

    def allow(self, peer: bytes, t: str) -> bool:
        if t not in self.LIMITED:
            return True
        now = self.clock()
        start, count = self._peers.get(peer, (now, 0))
        if now - start >= self.window_s:
            start, count = now, 0
        if count >= self.limit:
            return False
        self._peers[peer] = (start, count + 1)
        self._peers.move_to_end(peer)
        while len(self._peers) > self.max_peers:  # forget the peers heard from longest ago
            self._peers.popitem(last=False)
        return True


def bind_endpoint(sock: zmq.Socket, addr: str) -> str:
    """Bind, accepting port 0 for "any free port"; returns the endpoint actually bound."""
    if addr.startswith("tcp://") and addr.rsplit(":", 1)[1] == "0":
        addr = addr.rsplit(":", 1)[0] + ":*"
    sock.bind(addr)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


class MasterServer:
    def __init__(self, service: MasterService, bind: str, auth: Optional[Credentials] = None) -> None:
        self.service = service
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES + 1024)
        self._auth: Optional[AuthenticatorHandle] = None
        if auth is not None:  # CURVE: only peers holding the cluster key get through the handshake
            self._auth = server_authenticator(self.ctx, auth)
            secure_server(self.sock, auth)
        try:
            self.addr = bind_endpoint(self.sock, bind)
        except zmq.ZMQError:
            self.close()
            raise
        self.stop_event = threading.Event()
        self._stop_requested = False  # set by signal handlers: a plain flag is safe there, Event.set is not
        self.periodic: list[Callable[[], None]] = [service.tick]
        self._poller = zmq.Poller()  # one for the loop's life: Socket.poll would build one per pass
        self._poller.register(self.sock, zmq.POLLIN)
        self.joins = PeerRateLimit()

    def serve_forever(self) -> None:
        next_tick = last_pass = 0.0
        try:
            while not (self.stop_event.is_set() or self._stop_requested):
                if self._poller.poll(max(0, int((next_tick - time.monotonic()) * 1000))):
                    if time.monotonic() - last_pass < COALESCE_S:
                        # Under load, let a few more requests arrive and handle them in one pass:
                        # a pass (wake-up, poll, fsync) costs more than a request (benchmarks/control_plane).
                        time.sleep(COALESCE_S)
                    replies = []
                    while len(replies) < MAX_PER_PASS and has_message(self.sock):
                        replies.append(self._handle(self.sock.recv_multipart()))  # small: copying is cheaper
                    self.service.sync()
                    for reply in replies:
                        if reply is not None:
                            self.sock.send_multipart(reply)
                    last_pass = time.monotonic()
                now = time.monotonic()
                if now >= next_tick:
                    for duty in self.periodic:
                        try:
                            duty()
                        except Exception:  # a failing duty is logged and retried next tick; the loop lives on
                            log.exception("periodic duty %s failed", getattr(duty, "__qualname__", duty))
                    self.service.sync()
                    next_tick = now + TICK_S
        finally:
            self.close()

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._auth is not None:
            self._auth.close()

    def request_stop(self) -> None:
        """Async-signal-safe: Event.set takes a lock that a second signal could deadlock on."""
        self._stop_requested = True

    def _handle(self, parts: list) -> Optional[list]:
        """The reply to one request (sent once the pass's updates are durable)."""
        if len(parts) < 2:
            return None
        identity = parts[0]
        try:
            msg = wire.decode(parts[1:])
        except wire.ProtocolError as e:
            # Dropped, but the sender hears why rather than waiting out its deadline.
            log.warning("dropped malformed message from peer %s: %s", identity.hex(), e)
            return [identity, *wire.encode(M.Error(message=f"malformed message: {e}"[:M.MAX_TEXT],
                                                   code=M.ErrorCode.PROTOCOL))]
        request, _ = msg
        t = M.tag(request)
        if not self.joins.allow(identity, t):
            log.warning("refused %r from peer %s: too many joins", t, identity.hex())
            return [identity, *wire.encode(M.Error(message=f"too many {t} requests from this peer; slow down",
                                                   code=M.ErrorCode.FLOOD))]
        try:
            reply = wire.encode(self.service.handle(request))
        except Exception as e:  # a handler bug answers this request with an error, the master lives on
            log.exception("handling %r failed", t)
            reply = wire.encode(M.Error(message=f"master error while handling {t!r}: {e}"[:M.MAX_TEXT]))
        return [identity, *reply]
