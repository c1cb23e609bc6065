"""The client's side of the data plane: credit to its partition of workers, pieces back.

One DEALER socket per worker (so a dead worker's socket can be dropped alone). The
client grants each worker credit, in pieces and bytes (``credit``), and the worker
pushes pieces while it holds some: no request per batch, and memory bounded by the
credit window (``credit.py``). While the training step runs, ZeroMQ's I/O thread is
already receiving the next pieces. Received frames become tensors without a copy.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import zmq

from ..protocol import wire
from ..protocol.messages import Batch as BatchHeader, Credit
from ..protocol.address import AddressError, validate_address
from ..protocol.auth import Credentials, secure_client
from ..protocol.rpc import has_message
from .batch import Batch
from .credit import CreditWindow
from .session import RunId

log = logging.getLogger(__name__)
# A worker releases what it holds for a rank silent for its --client-timeout (30 s by
# default): a client with a wide window may not need to grant credit that often.
KEEPALIVE_S = 5.0


class WorkerFetcher:
    """The partition's sockets for one epoch run of one rank: credit names the run
    (session, seq), and only pieces of that run are taken (a newer run's first credit
    retires older runs of the session at the worker)."""

    def __init__(self, ctx: zmq.Context, rank: int, run: RunId, window: CreditWindow, sparse_keys: list[str],
                 sparse_scored: Optional[list[bool]] = None, auth: Optional[Credentials] = None) -> None:
        self.ctx, self.rank, self.run, self.window, self.sparse_keys = ctx, rank, run, window, sparse_keys
        self.sparse_scored = sparse_scored  # which sparse keys carry scores (id-score features)
        self.auth = auth  # CURVE client keys for the workers' data sockets; None: plain sockets
        self.sockets: dict[str, zmq.Socket] = {}
        self._worker_of: dict[zmq.Socket, str] = {}
        self.streams: dict[str, Stream] = {}
        self.poller = zmq.Poller()
        self._unreachable: set[tuple[str, str]] = set()  # (worker, address) already warned about

    def retarget(self, run: RunId) -> None:
        """Follow a rejoin: credit totals count anew for the new run (the worker knows nothing of it)."""
        self.run = run
        for wid in self.streams:
            self.streams[wid] = Stream()

    def set_workers(self, members: list[list[str]]) -> None:
        """Follow the master's view of this client's partition."""
        wanted = {wid: addr for wid, addr in members}
        for wid in [w for w in self.sockets if w not in wanted]:
            log.info("rank %d: worker %s left the partition", self.rank, wid)
            sock = self.sockets.pop(wid)
            self.poller.unregister(sock)
            del self._worker_of[sock]
            sock.close(linger=0)
            del self.streams[wid]
        for wid, addr in wanted.items():
            if wid not in self.sockets:
                self._connect(wid, addr)
        self.window.fit(len(self.sockets))

    def _connect(self, wid: str, addr: str) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        if self.auth is not None:
            secure_client(sock, self.auth)
        try:
            validate_address(addr)
            sock.connect(addr)
        except (AddressError, zmq.ZMQError) as e:
            # One address this client cannot use must not end its epoch (a bind-only address
            # once crashed every client): the partition's other workers still serve it.
            sock.close(linger=0)
            if (wid, addr) not in self._unreachable:
                self._unreachable.add((wid, addr))
                log.warning("rank %d: skipping worker %s: cannot connect to %.80r (%s)", self.rank, wid, addr, e)
            return
        self.sockets[wid], self._worker_of[sock] = sock, wid
        self.streams[wid] = Stream()
        self.poller.register(sock, zmq.POLLIN)

    def top_up(self, queued: int) -> None:
        """Grant each worker credit up to its even share of the window, less what the loop
        has queued; in chunks, not piece by piece. Shares are independent: credit held by a
        worker with nothing left to send must not starve the others."""
        self.window.queued(queued)  # a queue that never empties shrinks the window
        if not self.sockets:
            return
        n = len(self.sockets)
        share, byte_share = max(1, self.window.pieces // n), max(1, self.window.max_bytes // n)
        free = self.window.pieces - queued
        now = time.monotonic()
        for wid, sock in self.sockets.items():
            stream = self.streams[wid]
            pieces = max(0, min(share - stream.in_flight, free))
            low_bytes = stream.in_flight_bytes <= byte_share // 2
            if pieces < max(1, share // 4) and not (low_bytes and stream.in_flight) \
                    and now - stream.last_grant < KEEPALIVE_S:
                continue
            stream.granted += pieces
            stream.granted_bytes = stream.received_bytes + byte_share
            stream.last_grant = now
            sock.send_multipart(wire.encode(Credit(session=self.run.session, token=self.run.token, seq=self.run.seq,
                                                   pieces=stream.granted, bytes=stream.granted_bytes)))

    def credit_limited(self) -> bool:
        """Some worker held more pieces for us, when it sent its last one, than the credit
        we still have out there covers: it has data and no credit to send it."""
        return any(s.held > s.in_flight for s in self.streams.values())

    def holding(self) -> bool:
        """Some worker held pieces for us when it sent its last message."""
        return any(s.held for s in self.streams.values())

    def poll(self, timeout_ms: int) -> list[tuple[int, int, Batch]]:
        """Pieces that arrived within ``timeout_ms``: (split id, piece, batch) of the current run."""
        out = []
        for sock, _ in self.poller.poll(timeout_ms):
            wid = self._worker_of[sock]
            while has_message(sock):
                msg = wire.safe_decode(sock.recv_multipart(copy=False), f"worker {wid}")
                if msg is None:
                    continue
                header, frames = msg
                if not isinstance(header, BatchHeader) or header.session != self.run.session \
                        or header.seq != self.run.seq:
                    continue
                # Counted as received before it is checked: the worker has charged it to our credit.
                self.streams[wid].arrived(len(header.rows), sum(len(f) for f in frames), header.held, self.window)
                try:
                    pieces = wire.unpack_pieces(header, frames, len(self.sparse_keys))
                    batches = [(split_id, piece, Batch.from_numpy(arrays, self.sparse_keys, self.sparse_scored))
                               for split_id, piece, arrays in pieces]
                except (wire.ProtocolError, KeyError, ValueError, TypeError, IndexError) as e:
                    log.warning("dropped a malformed batch message from worker %s: %s", wid, e)
                    continue
                out.extend(batches)
        return out

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets.clear()


class Stream:
    """Credit to one worker for this run: cumulative totals, as the protocol sends them."""

    __slots__ = ("granted", "granted_bytes", "received", "received_bytes", "held", "last_grant")

    def __init__(self) -> None:
        self.granted = self.granted_bytes = self.received = self.received_bytes = self.held = 0
        self.last_grant = 0.0

    @property
    def in_flight(self) -> int:
        return max(0, self.granted - self.received)

    @property
    def in_flight_bytes(self) -> int:
        return max(0, self.granted_bytes - self.received_bytes)

    def arrived(self, pieces: int, nbytes: int, held: int, window: CreditWindow) -> None:
        window.arrived(pieces, nbytes)
        self.received += pieces
        self.received_bytes += nbytes
        self.held = held
