"""A worker process: stateless, it pulls work from the master and serves pieces to clients.

Three units, each on its own thread with its own sockets (ZeroMQ sockets are not
thread-safe):

* the **control** thread (``control.py``) registers (``session.py``: spec, pipeline,
  register), heartbeats, drains, and hands back splits whose pieces were discarded; it
  alone replaces the worker's session;
* the **producer** (``producer.py``) asks the master for splits, processes them, and puts
  their pieces into the ``PieceBuffer`` (blocking while it is full);
* the **pusher** (``pusher.py``, on the thread that calls ``run``) pushes pieces to clients while
  they hold credit for their run.

Every thread runs under ``Lifecycle.guarded``: one that fails stops the worker, and
``run`` raises.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

import zmq

from ..core.allowlist import TableAllowlist
from ..core.cache.memo import DEFAULT_MEMO_BYTES, BlockMemo
from ..core.cache.store import BlockStore
from ..core.cache.writer import BlockWriter
from ..core.sizing import DEFAULT_ARENA_BYTES, DEFAULT_BUFFER_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from ..formats import DEFAULT_COALESCE_GAP
from ..protocol import messages as M
from ..protocol.auth import AuthenticatorHandle, Credentials, secure_server, server_authenticator
from ..protocol.address import AddressError, restrict_ipc_socket
from ..protocol.capability import SessionTokens
from ..protocol.rpc import MasterUnavailable, RemoteError, RpcClient
from ..protocol.seal import KeyPair, data_curve
from .arena import ArenaServer
from .buffer import PieceBuffer
from .control import Control
from .credit import CreditBook
from .faults import Faults
from .lifecycle import Lifecycle
from .pipelines import Pipelines
from .producer import Producer
from .pusher import Pusher, WorkerSeals
from .session import CurrentSession, Registrar

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, master: str, bind_host: str = "127.0.0.1", buffer_batches: int = 16,
                 rpc_timeout_s: float = 10.0, drain_timeout_s: float = 60.0, faults: Optional[Faults] = None,
                 coalesce_gap: int = DEFAULT_COALESCE_GAP, auth: Optional[Credentials] = None,
                 client_timeout_s: float = 30.0, allowed_tables: Optional[tuple[str, ...]] = None,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, bind: Optional[str] = None,
                 cache: Optional[BlockStore] = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 arena_bytes: int = DEFAULT_ARENA_BYTES, node: str = "",
                 shared_block_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        """``bind``: the data endpoint (an ``ipc://`` path in the cluster's private directory);
        without it, an any-port tcp endpoint on ``bind_host``. ``cache``: the block cache
        (``--cache``), which splits use as the master's cache plan says. ``max_message_bytes``:
        the largest data message (``--max-message-bytes``; a larger piece goes alone).
        ``arena_bytes``: the shared-memory arena (``--arena-bytes``; 0: none) of each
        client on this host (``protocol/arena.py``). ``node``: the node it runs
        on, registered so that the ranks of that node get it first. ``shared_block_bytes``:
        the memo of blocks shared between the jobs of a shared fleet (``--shared-block-bytes``;
        0: none, each job computes its own)."""
        self.master = master
        # Cluster keys: the master calls are CURVE clients; the data socket is a plain socket
        # whose messages are sealed (protocol/seal.py) with keys of this process's key pair.
        self.auth = auth
        self.rpc_timeout_s = rpc_timeout_s
        self.ctx = zmq.Context.instance()
        self.lifecycle = Lifecycle()
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.setsockopt(zmq.MAXMSGSIZE, 64 << 10)  # clients only send small requests
        self.data.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable send raises rather than vanishing
        self._authenticator: Optional[AuthenticatorHandle] = None
        self.pair = KeyPair()  # new with every process: no key, so no nonce, outlives it
        self.seals = WorkerSeals(self.pair) if auth is not None else None
        if auth is not None and data_curve():  # benchmarks: the data socket of protocol 9
            self.seals = None
            self._authenticator = server_authenticator(self.ctx, auth)
            secure_server(self.data, auth)
        try:
            self.data.bind(bind or f"tcp://{bind_host}:0")
            if bind is not None:
                restrict_ipc_socket(bind)  # 0600: the directory is the lock, this a second one
        except (zmq.ZMQError, OSError):
            self._close_data()
            raise
        self.addr = self.data.getsockopt(zmq.LAST_ENDPOINT).decode()
        # Arenas for clients on this host: beside an ipc data socket, else in a private
        # directory of its own (a tcp worker serves ranks of its host too). Not with the
        # benchmarks' CURVE data sockets, whose clients never map one.
        self.arenas: Optional[ArenaServer] = None
        if arena_bytes > 0 and not (auth is not None and self.seals is None):
            try:
                self.arenas = ArenaServer.beside(self.addr, arena_bytes)
            except (OSError, AddressError):
                self._close_data()
                raise
        # A second line of defence behind the master's: a spec or split naming a table
        # outside these prefixes is refused (None: whatever the master names).
        allowlist = TableAllowlist(allowed_tables)
        self.current = CurrentSession()
        # A client silent this long loses what the worker holds for it (handed back to the master).
        # The transformed splits it holds stay within buffer_bytes (buffer.py).
        self.buffer = PieceBuffer(buffer_batches, silent_after_s=client_timeout_s, budget_bytes=buffer_bytes)
        self.faults = faults or Faults()
        # Which client connections proved (by the master's signature) the session they credit.
        tokens = SessionTokens()
        self.pusher = Pusher(self.data, self.ctx, self.buffer, CreditBook(client_timeout_s), self.lifecycle, tokens,
                             self.seals, self.current, self.faults, max_message_bytes=max_message_bytes,
                             arenas=self.arenas)
        self.cache = None if cache is None else (cache, BlockWriter(cache))
        self.memo = BlockMemo(shared_block_bytes) if shared_block_bytes > 0 else None
        registrar = Registrar(self.addr, allowlist, coalesce_gap, self.lifecycle, key=self.pair.public_hex,
                              arena=self.arenas.path if self.arenas is not None else "",
                              cache=self.cache, node=node, pipelines=Pipelines(memo=self.memo))
        self.producer = Producer(self.lifecycle, self.current, self.buffer, self.ctx, self._connect, allowlist,
                                 self.faults, compile=registrar.compile)
        self.control = Control(self.lifecycle, self.current, registrar, self.buffer, _StatsWithSeals(self),
                               self._connect(), drain_timeout_s, tokens)

    def request(self, what: str) -> None:
        """For signal handlers: ``drain`` (finish what is held, then leave) or ``stop``."""
        self.lifecycle.request(what)

    def run(self) -> None:
        """Serve until drained, stopped or failed. Raises TableRefused for a job outside
        --allow-table, WorkerFailed when a thread failed."""
        guarded = self.lifecycle.guarded
        threads = [threading.Thread(target=guarded(name, body), name=name, daemon=True)
                   for name, body in (("control", self.control.run), ("producer", self.producer.run))]
        for t in threads:
            t.start()
        try:
            guarded("pusher", self.pusher.run)()  # on this thread, which owns the data socket
        finally:
            self.lifecycle.stop.set()
            for t in threads:
                t.join(timeout=5)
            self._say_bye()
            self.control.rpc.close()
            self._close_data()
            if self.cache is not None:
                store, writer = self.cache
                writer.close(timeout=5.0)  # what is queued is written, within reason: it only saves later work
                store.close()
        self.lifecycle.raise_failure()

    def _say_bye(self) -> None:
        """Leaving on purpose: tell the master now rather than after a heartbeat timeout, so
        whatever this worker still held is re-queued at once."""
        session = self.current.get()
        if session is None or self.control.master_gone:
            return
        try:
            self.control.rpc.call(M.Bye(worker_id=session.worker_id, token=session.token), timeout_s=1.0)
        except (MasterUnavailable, RemoteError):
            pass

    def _connect(self) -> RpcClient:
        return RpcClient(self.ctx, self.master, self.rpc_timeout_s, auth=self.auth)

    def _close_data(self) -> None:
        self.data.close(linger=0)
        if getattr(self, "arenas", None) is not None:
            self.arenas.close()
            self.arenas = None
        if self._authenticator is not None:
            self._authenticator.close()


class _StatsWithSeals:
    """The producer's statistics with the pusher's count of refused sealed credit, as the
    heartbeat's ``stats`` (the control thread asks ``to_dict``)."""

    def __init__(self, worker: Worker) -> None:
        self._stats, self._seals, self._cache = worker.producer.stats, worker.seals, worker.cache
        self._memo = worker.memo

    def to_dict(self) -> dict:
        out = self._stats.to_dict()
        if self._seals is not None:
            out["refused"] = self._seals.refused
        if self._cache is not None:
            out["cache"] = self._cache[0].counters.to_dict()
        if self._memo is not None:
            out["shared"] = self._memo.counters.to_dict()
        return out

    def __getattr__(self, name: str):
        return getattr(self._stats, name)
