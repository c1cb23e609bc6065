"""The client's side of the data plane: requests to its partition of workers.

One DEALER socket per worker (so a dead worker's socket can be dropped alone), each
kept ``inflight`` requests ahead: while the training step runs, ZeroMQ's I/O thread
is already receiving the next batches. Received frames become tensors without a copy.
"""
from __future__ import annotations

import logging
from typing import Optional

import zmq

from ..protocol import wire
from ..protocol.auth import Credentials, secure_client
from .batch import Batch

log = logging.getLogger(__name__)


class WorkerFetcher:
    def __init__(self, ctx: zmq.Context, rank: int, inflight: int, sparse_keys: list[str],
                 sparse_scored: Optional[list[bool]] = None, auth: Optional[Credentials] = None) -> None:
        self.ctx, self.rank, self.inflight, self.sparse_keys = ctx, rank, inflight, sparse_keys
        self.sparse_scored = sparse_scored  # which sparse keys carry scores (id-score features)
        self.auth = auth  # CURVE client keys for the workers' data sockets; None: plain sockets
        self.sockets: dict[str, zmq.Socket] = {}
        self.addrs: dict[str, str] = {}
        self.outstanding: dict[str, int] = {}
        self.poller = zmq.Poller()
        self.epoch: Optional[int] = None

    def set_workers(self, members: list[list[str]]) -> None:
        """Follow the master's view of this client's partition."""
        wanted = {wid: addr for wid, addr in members}
        for wid in [w for w in self.sockets if w not in wanted]:
            log.info("rank %d: worker %s left the partition", self.rank, wid)
            self.poller.unregister(self.sockets[wid])
            self.sockets.pop(wid).close(linger=0)
            self.addrs.pop(wid)
            self.outstanding.pop(wid)
        for wid, addr in wanted.items():
            if wid not in self.sockets:
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
                if self.auth is not None:
                    secure_client(sock, self.auth)
                sock.connect(addr)
                self.sockets[wid], self.addrs[wid], self.outstanding[wid] = sock, addr, 0
                self.poller.register(sock, zmq.POLLIN)

    def start_epoch(self, epoch: int) -> None:
        # Requests of the previous epoch die at the worker when it sees this epoch's first.
        self.epoch = epoch
        for wid in self.outstanding:
            self.outstanding[wid] = 0

    def top_up(self) -> None:
        for wid, sock in self.sockets.items():
            while self.outstanding[wid] < self.inflight:
                sock.send_multipart(wire.encode("get_batch", rank=self.rank, epoch=self.epoch))
                self.outstanding[wid] += 1

    def poll(self, timeout_ms: int) -> list[tuple[dict, Batch]]:
        """Pieces that arrived within ``timeout_ms``: (header, batch) pairs of the current epoch."""
        out = []
        for sock, _ in self.poller.poll(timeout_ms):
            wid = next(w for w, s in self.sockets.items() if s is sock)
            while sock.poll(0):
                msg = wire.safe_decode(sock.recv_multipart(copy=False), f"worker {wid}")
                self.outstanding[wid] = max(0, self.outstanding[wid] - 1)
                if msg is None:
                    continue
                header, frames = msg
                if header["t"] != "batch" or header["rank"] != self.rank or header["epoch"] != self.epoch:
                    continue
                try:
                    arrays = wire.unpack_arrays(header["tensors"], frames)
                    batch = Batch.from_numpy(arrays, self.sparse_keys, self.sparse_scored)
                except (wire.ProtocolError, KeyError) as e:
                    log.warning("dropped a malformed batch from worker %s: %s", wid, e)
                    continue
                out.append((header, batch))
        return out

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets.clear()
