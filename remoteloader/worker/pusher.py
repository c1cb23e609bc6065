"""The pusher: the worker's data socket. Takes clients' credit and pushes them pieces of
the run they credited while the credit lasts (docs/protocol.md, flow control)."""
from __future__ import annotations

import logging
import time

import zmq

from ..protocol import messages as M
from ..protocol import wire
from ..protocol.capability import SessionTokens
from ..protocol.rpc import has_message
from .buffer import PieceBuffer
from .credit import Credit, CreditBook
from .lifecycle import Lifecycle
from .producer import NOTIFY
from .runs import RunId

log = logging.getLogger(__name__)
EXPIRE_EVERY_S = 1.0  # how often credit entries are checked for silence


class Pusher:
    def __init__(self, data: zmq.Socket, ctx: zmq.Context, buffer: PieceBuffer, credit: CreditBook,
                 lifecycle: Lifecycle, tokens: SessionTokens) -> None:
        self.data = data
        self.tokens = tokens
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
        if not self.tokens.allows(identity, run[0], grant.token):
            log.debug("dropped credit for session %.80s: its token does not verify", run[0])
            return
        # Credit for a run that is not wanted (its client moved on, or its session is gone)
        # is ignored; credit for a run with no task here yet is kept: the task may come.
        if self.buffer.credited(run):
            self.credit.grant(run, identity, grant.pieces, grant.bytes)

    def push(self) -> None:
        """Push pieces to clients holding credit for their run: as many as the credit
        allows and the buffer holds, a run of consecutive pieces of one split to a message.
        A message is one range of the split's arrays, so it goes as one frame per tensor,
        however many pieces it holds (``wire.MAX_PIECES`` bounds them)."""
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
                # A message is one frame per tensor: it must stay under the client's frame limit.
                if pieces and (not piece.follows(pieces[-1]) or nbytes + piece.nbytes > wire.MAX_FRAME_BYTES):
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
            msg = wire.encode(M.Batch(session=run[0], seq=run[1], split_id=first.split_id, piece=first.index,
                                    rows=[p.rows for p in pieces], held=self.buffer.held(run), tensors=descs), frames)
            try:
                # Never block: a client that does not read fills its pipe, and a blocked
                # send would stop serving everybody else.
                self.data.send_multipart([identity, *msg], copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                self.buffer.put_back(run, pieces)  # its pipe is full: try again on a later pass
                return False
            except zmq.ZMQError:
                # That client is gone (ROUTER_MANDATORY tells us instead of dropping the
                # message): keep the pieces for whoever holds credit next.
                self.buffer.put_back(run, pieces)
                self.credit.remove(run, identity)
                return False
            credit.spend(len(pieces), nbytes)
        return False
