"""The client's side of the data plane: credit to its partition of workers, pieces back.

One DEALER socket per worker (so a dead worker's socket can be dropped alone). The
client grants each worker credit, in pieces and bytes (``credit``), and the worker
pushes pieces while it holds some: no request per batch, and memory bounded by the
credit window (``credit.py``). While the training step runs, ZeroMQ's I/O thread is
already receiving the next pieces. Received frames become tensors without a copy.

With cluster keys the data sockets are plain sockets and every message is sealed
(protocol/seal.py): credit under the session's key for that worker, batch frames opened
into fresh buffers (which become the tensors). A refused batch is counted, never
delivered; one that claimed the current run marks the stream ``lost`` (see stream.py).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import zmq

from .. import jagged
from ..protocol import wire
from ..protocol.arena import ArenaError, arenas_wanted
from ..protocol.messages import Batch as BatchHeader, Credit
from ..protocol.address import AddressError, validate_address
from ..protocol.auth import Credentials, secure_client
from ..protocol.rpc import has_message
from ..protocol.seal import Peer, SealError, data_curve
from .arena import ArenaLink, ArenaLinks
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
                 sparse_scored: Optional[list[bool]] = None, auth: Optional[Credentials] = None,
                 arenas: Optional[ArenaLinks] = None) -> None:
        """``arenas``: the loader's links to workers' shared-memory arenas (kept across runs);
        None: every batch comes as frames."""
        self.ctx, self.rank, self.run, self.window, self.sparse_keys = ctx, rank, run, window, sparse_keys
        self.sparse_scored = sparse_scored  # which sparse keys carry scores (id-score features)
        self.auth = auth  # cluster keys: messages on the workers' data sockets are sealed; None: plain
        self._curve = auth is not None and data_curve()  # benchmarks only: CURVE data sockets, unsealed
        self._curve_keys = auth
        if self._curve:
            self.auth = None
        self.sockets: dict[str, zmq.Socket] = {}
        self._worker_of: dict[zmq.Socket, str] = {}
        self.streams: dict[str, Stream] = {}
        self.poller = zmq.Poller()
        self._unreachable: set[tuple[str, str]] = set()  # (worker, address) already warned about
        self._peers: dict[str, Peer] = {}  # worker id -> its sealing state (sealed mode)
        self._keys: dict[str, str] = {}  # worker id -> its public key (membership)
        self.refused = 0  # sealed batches refused (counted in the client's stats)
        self.lost = False  # a refused batch claimed the current run: a genuine one may be lost
        self.sender_of: dict[int, str] = {}  # split id -> the worker whose pieces of it came last
        # Workers on this host: their shared-memory arenas (protocol/arena.py).
        self._arenas: dict[str, ArenaLink] = {}  # worker id -> its arena's link
        self._arena_path: dict[str, str] = {}  # worker id -> its arena socket (of those with a link)
        self._links = arenas if arenas_wanted() and not self._curve else None
        self.arena_messages = self.frame_messages = 0  # batch messages by how they came (benchmarks)

    def retarget(self, run: RunId) -> None:
        """Follow a rejoin: credit totals count anew for the new run (the worker knows nothing of it)."""
        self.run = run
        for wid in self.streams:
            self.streams[wid] = Stream()
        if self.auth is not None:  # a new session: new keys with every worker
            self._peers = {}
            for wid, key in self._keys.items():
                try:
                    self._peers[wid] = run.seals.peer(run.session, wid, key)
                except (SealError, AttributeError):
                    pass  # its credit goes unsealed and is refused: the worker is skipped

    def set_workers(self, members: list) -> None:
        """Follow the master's view of this client's partition: (worker id, address[, key[,
        arena socket]])."""
        wanted = {m[0]: m[1] for m in members}
        keys = {m[0]: (m[2] if len(m) > 2 else "") for m in members}
        arenas = {m[0]: (m[3] if len(m) > 3 else "") for m in members}
        for wid in [w for w in self.sockets if w not in wanted]:
            log.info("rank %d: worker %s left the partition", self.rank, wid)
            sock = self.sockets.pop(wid)
            self.poller.unregister(sock)
            del self._worker_of[sock]
            sock.close(linger=0)
            del self.streams[wid]
            self._peers.pop(wid, None)
            self._keys.pop(wid, None)
            if self._arenas.pop(wid, None) is not None:
                self._links.drop(self._arena_path.pop(wid))
        for wid, addr in wanted.items():
            if wid not in self.sockets:
                self._connect(wid, addr, keys[wid], arenas[wid])
        self.window.fit(len(self.sockets))

    def _connect(self, wid: str, addr: str, key: str = "", arena: str = "") -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES + 1024)  # a sealed frame has a tag
        if self._curve:
            secure_client(sock, self._curve_keys)
        try:
            if self.auth is not None:
                if self.run.seals is None:
                    raise SealError("unknown_key", "this session has no key pair")
                # The worker's key came from the master, over CURVE: only that worker can open
                # our credit or seal what we accept.
                self._peers[wid] = self.run.seals.peer(self.run.session, wid, key)
                self._keys[wid] = key
            validate_address(addr)
            sock.connect(addr)
        except (AddressError, zmq.ZMQError, SealError) as e:
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
        # A worker on this host: its arena socket is there (ArenaLinks checks the path and,
        # at the offer, that the worker shares this host's network namespace).
        link = self._links.link(arena) if self._links is not None and arena else None
        if link is not None:
            self._arenas[wid], self._arena_path[wid] = link, arena

    def top_up(self, queued: int, urgent: Optional[str] = None, waiting: int = 0) -> None:
        """Grant each worker credit up to its even share of the window, less what the loop
        has queued; in chunks, not piece by piece. Shares are independent: credit held by a
        worker with nothing left to send must not starve the others. ``urgent``: a worker
        that always keeps at least one piece of credit, however full the window (the one
        producing the head of a deterministic schedule: the window may be full of pieces
        that wait for it). ``waiting``: pieces held back for their turn in that order: they
        take room in the window but are not a queue the loop could take from."""
        self.window.queued(queued)  # a queue that never empties shrinks the window
        if not self.sockets:
            return
        n = len(self.sockets)
        share, byte_share = max(1, self.window.pieces // n), max(1, self.window.max_bytes // n)
        free = self.window.pieces - queued - waiting
        now = time.monotonic()
        for wid, sock in self.sockets.items():
            stream = self.streams[wid]
            arena = self._arena(wid)
            pieces = max(0, min(share - stream.in_flight, free))
            low_bytes = stream.in_flight_bytes <= byte_share // 2
            must = wid == urgent and stream.in_flight == 0
            if must:
                pieces = max(pieces, 1)
            elif pieces < max(1, share // 4) and not (low_bytes and stream.in_flight) \
                    and now - stream.last_grant < KEEPALIVE_S:
                continue
            stream.granted += pieces
            stream.granted_bytes = stream.received_bytes + byte_share
            stream.last_grant = now
            credit = Credit(session=self.run.session, token=self.run.token, seq=self.run.seq, pieces=stream.granted,
                            bytes=stream.granted_bytes, key=self.run.seals.pair.public_hex if self.run.seals else "",
                            arena=arena)
            peer = self._peers.get(wid)
            if peer is None:
                sock.send_multipart(wire.encode(credit))
            else:
                make_header = lambda gen, nonce: wire.encode(_sealed(credit, gen, nonce))[0]  # noqa: E731
                sock.send_multipart(peer.sealer.seal_frames(make_header, []))

    def credit_limited(self, only: Optional[str] = None) -> bool:
        """Some worker (``only`` that one, if given) held more pieces for us, when it sent its
        last one, than the credit we still have out there covers: it has data and no credit
        to send it."""
        if only is not None:
            stream = self.streams.get(only)
            return stream is not None and stream.held > stream.in_flight
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
                parts = sock.recv_multipart(copy=False)
                msg = wire.safe_decode(parts, f"worker {wid}")
                if msg is None:
                    continue
                header, frames = msg
                if not isinstance(header, BatchHeader) or header.session != self.run.session \
                        or header.seq != self.run.seq:
                    continue
                if header.arena is not None:
                    # Sealed: the header came over the network, so its tag is checked before
                    # the region it names is read (one tag, no data).
                    if self.auth is not None and self._open(wid, parts[0].bytes, header, frames, [0]) is None:
                        continue
                    frames = self._arena_frames(wid, header, [] if self.auth is not None else frames)
                    if frames is None:
                        continue
                elif self.auth is not None:
                    frames = self._open(wid, parts[0].bytes, header, frames)
                    if frames is None:
                        continue
                else:
                    self.frame_messages += 1
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
                for split_id, _, _ in batches:
                    self.sender_of[split_id] = wid
        return out

    def _arena(self, wid: str) -> Optional[str]:
        """The id of worker ``wid``'s arena once mapped (credit names it), after sending the
        releases queued for it; None without one."""
        link = self._arenas.get(wid)
        if link is None:
            return None
        try:
            if not link.try_open():
                return None
        except ArenaError as e:
            log.warning("rank %d: not using worker %s's arena: %s", self.rank, wid, e)
            del self._arenas[wid]
            self._links.drop(self._arena_path.pop(wid))
            return None
        link.flush()
        return link.id

    def _arena_frames(self, wid: str, header: BatchHeader, frames: list) -> Optional[list]:
        """A batch's frames in worker ``wid``'s arena; None (logged) if it is not there."""
        link = self._arenas.get(wid)
        try:
            if frames or link is None:
                raise ArenaError("a batch in an arena with data frames, or from a worker with no arena here")
            out = link.frames(header.arena, header.tensors)
        except ArenaError as e:
            log.warning("dropped a batch message from worker %s: %s", wid, e)
            return None
        # The sizes this client checks and cuts by are read from its own copy: the worker
        # could still write the region (values may change under us, where we read may not).
        for i, desc in enumerate(header.tensors):
            if desc.name == jagged.LENGTHS:
                out[i] = bytearray(out[i])
        self.arena_messages += 1
        return out

    def _open(self, wid: str, raw: bytes, header: BatchHeader, frames: list,
              sizes: Optional[list[int]] = None) -> Optional[list]:
        """A batch's frames opened (the raw header is their associated data); None (counted,
        logged at most once per ``Refusals.every``) if refused."""
        peer = self._peers.get(wid)
        try:
            if peer is None or header.gen is None or header.nonce is None:
                raise SealError("bounds", "batch is not sealed")
            sizes = [wire.tensor_bytes(d) for d in header.tensors] if sizes is None else sizes
            return peer.opener.open(raw, header.gen, header.nonce, [_buffer(f) for f in frames], sizes)
        except SealError as e:
            self.refused += 1
            self.lost = True  # it claimed the current run: if it was genuine, a piece is lost
            if self.run.seals is not None:
                self.run.seals.refusals.refuse(f"worker {wid}", e, "batch")
            return None

    def close(self) -> None:
        """Drop every worker's socket; ``set_workers`` connects again (a stream reset to a new run)."""
        self._arenas.clear()  # the links stay open for the next run (the loader closes them)
        self._arena_path.clear()
        for sock in self.sockets.values():
            self.poller.unregister(sock)
            sock.close(linger=0)
        self.sockets.clear()
        self._worker_of.clear()
        self.streams.clear()
        self._peers.clear()
        self._keys.clear()


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


def _sealed(credit: Credit, gen: int, nonce: int) -> Credit:
    credit.gen, credit.nonce = gen, nonce
    return credit


def _buffer(frame) -> memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
