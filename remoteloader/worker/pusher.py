"""The pusher: the worker's data socket. Takes clients' credit and pushes them pieces of
the run they credited while the credit lasts (docs/protocol.md, flow control).

With cluster keys the data socket is not CURVE: credit is opened and batch frames are
sealed (protocol/seal.py) with keys derived from the worker's X25519 key pair and the
session's key, which the session token binds to the session."""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import zmq

from ..core.sizing import DEFAULT_MAX_MESSAGE_BYTES
from ..protocol import messages as M
from ..protocol import wire
from ..protocol.capability import SessionTokens
from ..protocol.rpc import has_message
from ..protocol.seal import TO_CLIENT, TO_WORKER, KeyPair, Peer, PeerBook, SealError
from .arena import ArenaServer
from .buffer import PieceBuffer
from .credit import Credit, CreditBook
from .faults import Faults
from .lifecycle import Lifecycle
from .producer import NOTIFY
from .runs import MAX_SESSIONS, RunId
from .session import CurrentSession

log = logging.getLogger(__name__)
EXPIRE_EVERY_S = 1.0  # how often credit entries are checked for silence


class WorkerSeals:
    """The worker's side of sealing: its key pair, one ``Peer`` per (session, worker id,
    session key) whose credit proved its key, and the peer that batches of a session go
    sealed for (the one its last accepted credit came under)."""

    def __init__(self, pair: KeyPair, rotate_frames: Optional[int] = None) -> None:
        self.book = PeerBook(pair, TO_CLIENT, TO_WORKER, max_peers=MAX_SESSIONS, rotate_frames=rotate_frames)
        self._by_session: dict[str, Peer] = {}

    @property
    def refused(self) -> int:
        return self.book.refusals.total

    def open_credit(self, identity: bytes, grant: M.Credit, header: bytes, frames: list, worker_id: str) -> bool:
        """Whether ``grant`` (its token checked already) is sealed under its session's key and
        new; a refusal is counted and logged (at most once per ``Refusals.every``)."""
        try:
            if grant.gen is None or grant.nonce is None or not grant.key:
                raise SealError("bounds", "credit is not sealed")
            peer = self.book.peer(grant.session, worker_id, grant.key)
            peer.opener.open(header, grant.gen, grant.nonce, frames, [0])
        except SealError as e:
            self.book.refusals.refuse(f"client {identity.hex()[:16]} (session {grant.session[:40]})", e, "credit")
            return False
        self._by_session[grant.session] = peer
        if len(self._by_session) > MAX_SESSIONS:
            self._by_session.pop(next(iter(self._by_session)))
        return True

    def for_session(self, session: str) -> Optional[Peer]:
        return self._by_session.get(session)


class Pusher:
    def __init__(self, data: zmq.Socket, ctx: zmq.Context, buffer: PieceBuffer, credit: CreditBook,
                 lifecycle: Lifecycle, tokens: SessionTokens, seals: Optional[WorkerSeals] = None,
                 current: Optional[CurrentSession] = None, faults: Optional[Faults] = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, arenas: Optional[ArenaServer] = None) -> None:
        """``max_message_bytes``: the most bytes of pieces one data message carries (a single
        piece larger than that still goes, alone); never above ``wire.MAX_FRAME_BYTES``.
        ``arenas``: the arena socket (clients on this host): batches for a client that maps
        one of its arenas are written there, and only their headers sent."""
        self.data = data
        self.arenas = arenas
        self._arena_of: dict[bytes, str] = {}  # client connection -> the arena its last credit named
        self.max_message_bytes = min(max(1, int(max_message_bytes)), wire.MAX_FRAME_BYTES)
        self.tokens = tokens
        self.seals = seals  # None: no cluster keys, nothing sealed
        self.current = current
        self.faults = faults or Faults()
        self.ctx = ctx
        self.buffer = buffer
        self.credit = credit
        self.lifecycle = lifecycle

    def run(self) -> None:
        wake = self.ctx.socket(zmq.PULL)
        wake.bind(NOTIFY)
        poller = zmq.Poller()
        poller.register(self.data, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        if self.arenas is not None:
            self.arenas.attach(poller)
        next_expiry = time.monotonic() + EXPIRE_EVERY_S
        try:
            while not self.lifecycle.stop.is_set():
                events = dict(poller.poll(100))
                if wake in events:
                    while has_message(wake):
                        wake.recv()
                if self.data in events:
                    while has_message(self.data):
                        self.on_request(self.data.recv_multipart(copy=False))
                if self.arenas is not None:
                    for fd in [e for e in events if isinstance(e, int)]:
                        self.arenas.on_ready(fd)
                if time.monotonic() >= next_expiry:
                    self.credit.expire()
                    next_expiry = time.monotonic() + EXPIRE_EVERY_S
                self.push()
        finally:
            wake.close(linger=0)

    def on_request(self, parts: list) -> None:
        identity, body = parts[0].bytes, parts[1:]
        msg = wire.safe_decode(body, "client")
        if msg is None:
            return
        grant, _ = msg
        if not isinstance(grant, M.Credit):
            log.warning("dropped %r from a client: workers only take credit", M.tag(grant))
            return
        run = (grant.session, grant.seq)
        # Only the connection of the client the master admitted for that session may take its
        # pieces or move it to another run: a session id alone (status shows them) does not.
        # Refused credit leaves nothing behind, so made-up sessions cannot fill any table.
        if not self.tokens.allows(identity, run[0], grant.token, grant.key):
            log.debug("dropped credit for session %.80s: its token does not verify", run[0])
            return
        if self.seals is not None:
            session = self.current.get() if self.current is not None else None
            if session is None or not self.seals.open_credit(identity, grant, _bytes(body[0]),
                                                             [_buffer(f) for f in body[1:]], session.worker_id):
                return
        # Credit for a run that is not wanted (its client moved on, or its session is gone)
        # is ignored; credit for a run with no task here yet is kept: the task may come.
        if self.buffer.credited(run):
            self.credit.grant(run, identity, grant.pieces, grant.bytes)
        if self.arenas is not None:
            if grant.arena is None:  # the client no longer names one: frames from now on
                self._arena_of.pop(identity, None)
            else:
                self._arena_of[identity] = grant.arena
                if len(self._arena_of) > 4 * MAX_SESSIONS:  # connections of clients long gone
                    self._arena_of.pop(next(iter(self._arena_of)))

    def push(self) -> None:
        """Push pieces to clients holding credit for their run: as many as the credit
        allows and the buffer holds, a run of consecutive pieces of one split to a message.
        A message is one range of the split's arrays, so it goes as one frame per tensor,
        however many pieces it holds (``wire.MAX_PIECES`` bounds them, and
        ``max_message_bytes`` their bytes: a client receives each message into memory of
        that size, which it can reuse, where a message of a whole split would land in pages
        mapped afresh every time)."""
        hungry: set[RunId] = set()
        for run, creditors in self.credit.runs():
            if self.buffer.stale(run):
                self.credit.drop(run)
                continue
            for identity, credit in list(creditors.items()):
                if self._push_to(run, identity, credit):
                    hungry.add(run)
        # Runs with credit and nothing buffered: a producer stuck on another run's full
        # share hands its split back rather than keep them waiting.
        self.buffer.set_hungry(hungry)

    def _push_to(self, run: RunId, identity: bytes, credit: Credit) -> bool:
        """Send ``identity`` what its credit allows; whether it was left wanting data."""
        while credit.open:
            pieces, nbytes = [], 0
            while credit.open_after(len(pieces), nbytes) and len(pieces) < wire.MAX_PIECES:
                piece = self.buffer.pop(run)
                if piece is None:
                    break
                # A message is one frame per tensor: it stays under the client's frame limit, and
                # within max_message_bytes (a piece larger than that goes alone).
                if pieces and (not piece.follows(pieces[-1]) or nbytes + piece.nbytes > self.max_message_bytes):
                    self.buffer.put_back(run, [piece])
                    break
                pieces.append(piece)
                nbytes += piece.nbytes
            if not pieces:
                return True
            first = pieces[0]
            descs, frames = wire.pack_arrays(first.source.arrays(first.lo, pieces[-1].hi))
            # `held`: what is left here for this run, so its client can tell that it waits
            # for want of credit rather than for want of data.
            header = M.Batch(session=run[0], seq=run[1], split_id=first.split_id, piece=first.index,
                             rows=[p.rows for p in pieces], held=self.buffer.held(run), tensors=descs)
            placed = self._place(identity, frames)
            if placed is not None:  # the tensors are in the client's arena: the header alone goes
                header.arena, frames = placed[1], []
            if self.seals is None:
                msg = wire.encode(header, frames)
            else:  # sealed: an arena batch's header still goes authenticated (one tag, no data)
                peer = self.seals.for_session(run[0])
                if peer is None:  # no key for it (forgotten): its next credit brings one
                    self._unplace(placed)
                    self.buffer.put_back(run, pieces)
                    self.credit.remove(run, identity)
                    return False
                msg = peer.sealer.seal_frames(lambda gen, nonce: wire.encode(_sealed(header, gen, nonce))[0], frames)
            try:
                # Never block: a client that does not read fills its pipe, and a blocked
                # send would stop serving everybody else.
                self.faults.send([identity, *msg], self._send)
            except zmq.Again:
                self._unplace(placed)
                self.buffer.put_back(run, pieces)  # its pipe is full: try again on a later pass
                return False
            except zmq.ZMQError:
                # That client is gone (ROUTER_MANDATORY tells us instead of dropping the
                # message): keep the pieces for whoever holds credit next.
                self._unplace(placed)
                self.buffer.put_back(run, pieces)
                self.credit.remove(run, identity)
                return False
            credit.spend(len(pieces), nbytes)
        return False

    def _place(self, identity: bytes, frames: list):
        """(arena, slice) where the frames were written, if the client maps an arena with room
        for them; else None (they go as frames)."""
        if self.arenas is None:
            return None
        arena = self.arenas.arena(self._arena_of.get(identity))
        if arena is None:
            return None
        where = arena.place([np.frombuffer(f, np.uint8) for f in frames])
        return None if where is None else (arena, where)

    @staticmethod
    def _unplace(placed) -> None:
        if placed is not None:
            arena, where = placed
            arena.release([where.offset])

    def _send(self, parts: list) -> None:
        self.data.send_multipart(parts, copy=False, flags=zmq.NOBLOCK)


def _sealed(header: M.Batch, gen: int, nonce: int) -> M.Batch:
    header.gen, header.nonce = gen, nonce
    return header


def _bytes(frame) -> bytes:
    return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)


def _buffer(frame) -> memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
