"""A worker process: stateless, it pulls work from the master and serves batches to clients.

Three threads, each owning its own sockets (ZeroMQ sockets are not thread-safe):

* the **producer** asks the master for a split, processes it, and puts the pieces into
  the ``BatchBuffer`` (blocking while it is full);
* the **server loop** pushes pieces from the buffer to clients while they hold credit
  (``credit`` messages grant pieces and bytes per (rank, epoch); see protocol.md);
* the **control** thread heartbeats to the master, drains, and hands back released splits.

The producer wakes the server loop through an inproc PUSH/PULL pair whenever it adds
a piece, so a waiting client is answered at once rather than at the next poll.
"""
from __future__ import annotations

import logging
import os
import random
import threading
import time
import traceback
from typing import Optional

import psutil
import zmq

from ..protocol import wire
from ..protocol.auth import AuthenticatorHandle, Credentials, secure_server, server_authenticator
from ..core.allowlist import TableAllowlist
from ..core.binding import bind_schema
from ..formats import DEFAULT_COALESCE_GAP
from ..protocol.rpc import MasterUnavailable, RemoteError, RpcClient, backoff_delay, has_message
from ..spec import DatasetSpec
from .buffer import RELEASED, STOPPED, STORED, BatchBuffer
from ..core.processor import SplitError, SplitProcessor, SplitTask

log = logging.getLogger(__name__)
MAX_CREDITORS = 1 << 14  # (rank, epoch, client) entries holding credit, across all clients


class Worker:
    def __init__(self, master: str, bind_host: str = "127.0.0.1", buffer_batches: int = 16,
                 rpc_timeout_s: float = 10.0, drain_timeout_s: float = 60.0, faults: Optional["Faults"] = None,
                 coalesce_gap: int = DEFAULT_COALESCE_GAP, auth: Optional[Credentials] = None,
                 client_timeout_s: float = 30.0, allowed_tables: Optional[tuple[str, ...]] = None) -> None:
        self.master = master
        self.auth = auth  # CURVE keys: the data socket is a CURVE server, the master calls CURVE clients
        self.ctx = zmq.Context.instance()
        self.stop_event = threading.Event()
        self.draining = threading.Event()  # no new splits; leave once the master says so
        self.drain_timeout_s = drain_timeout_s
        self._requested: Optional[str] = None  # "drain" | "stop", from a signal handler
        self._drain_reported = False
        self._master_gone = False
        self._drain_deadline = float("inf")
        self.faults = faults or Faults()
        self.coalesce_gap = coalesce_gap
        # A second line of defence behind the master's: a spec or split naming a table
        # outside these prefixes is refused (None: whatever the master names).
        self.allowlist = TableAllowlist(allowed_tables)
        self._producing: Optional[list] = None  # [epoch, split_id, pieces produced]
        # A rank silent this long loses what the worker holds for it (handed back to the master).
        self.buffer = BatchBuffer(buffer_batches, silent_after_s=client_timeout_s)
        self.rpc_timeout_s = rpc_timeout_s
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.setsockopt(zmq.MAXMSGSIZE, 64 << 10)  # clients only send small requests
        self.data.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises rather than vanishing
        self._authenticator: Optional[AuthenticatorHandle] = None
        if auth is not None:
            self._authenticator = server_authenticator(self.ctx, auth)
            secure_server(self.data, auth)
        try:
            self.data.bind(f"tcp://{bind_host}:0")
        except zmq.ZMQError:
            self._close_data()
            raise
        self.addr = self.data.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.worker_id: Optional[str] = None
        self.heartbeat_interval = 0.5
        self.processor: Optional[SplitProcessor] = None
        self._credit: dict[tuple[int, int], dict[bytes, Credit]] = {}  # (rank, epoch) -> client -> its credit
        self._creditors = 0
        self._unreported: list[list[int]] = []  # released (epoch, split id)s the master has not heard of
        self._epochs: dict[int, int] = {}  # rank -> latest epoch the master gave this worker a split of
        self._stats = {"rows": 0, "batches": 0, "splits": 0, "busy_s": 0.0}
        self._rng = random.Random()  # jitter for heartbeat retries
        self._proc = psutil.Process()
        self._proc.cpu_percent()  # first call primes the counter

    def request(self, what: str) -> None:
        """For signal handlers: only a plain assignment there (Event.set takes a lock a
        second signal could deadlock on); the server loop acts on it within a tick."""
        if self._requested != "stop":
            self._requested = what

    # -- set-up ----------------------------------------------------------------------
    def _join(self, rpc: RpcClient) -> bool:
        """Fetch the job's spec and compile its pipeline, then register.

        In that order so that the master only counts on this worker once it is ready:
        compiling kernels holds the GIL for seconds, long enough to miss heartbeats.
        A master may start before its first client brings a spec, and may restart and
        forget us, so every step retries until it succeeds.
        """
        while not self.stop_event.is_set() and self._requested is None:
            try:
                if self.processor is None:
                    reply = rpc.call("get_spec")
                    spec = DatasetSpec.from_dict(reply["spec"])
                    if not self.allowlist.allows(spec.table.path):
                        raise TableRefused(f"the master's job reads table {spec.table.path!r}, outside this "
                                           "worker's --allow-table prefixes; refusing to serve it")
                    processor = SplitProcessor(bind_schema(spec, reply["schema"]), self.coalesce_gap)
                    processor.warm_up()
                    self.processor = processor
                if self.worker_id is None:
                    reply = rpc.call("register", addr=self.addr, pid=os.getpid())
                    self.worker_id = reply["worker_id"]
                    self.heartbeat_interval = float(reply["heartbeat_interval"])
                    log.info("worker %s serving on %s", self.worker_id, self.addr)
                return True
            except MasterUnavailable as e:
                log.warning("%s; retrying", e)
            except RemoteError:
                self.stop_event.wait(0.2)  # no job yet
        return False

    def run(self) -> None:
        control = RpcClient(self.ctx, self.master, self.rpc_timeout_s, auth=self.auth)
        joined = False
        try:
            joined = self._join(control)  # raises TableRefused for a job outside --allow-table
        finally:
            if not joined:
                control.close()
                self._close_data()
        if not joined:
            return
        producer = threading.Thread(target=self._produce, name="producer", daemon=True)
        heartbeats = threading.Thread(target=self._control, args=(control,), name="control", daemon=True)
        producer.start()
        heartbeats.start()
        try:
            self._serve()
        finally:
            self.stop_event.set()
            producer.join(timeout=5)
            heartbeats.join(timeout=5)
            # Leaving on purpose: tell the master now rather than after a heartbeat timeout,
            # so whatever this worker still held is re-queued at once.
            if self.worker_id is not None and not self._master_gone:
                try:
                    control.call("bye", worker_id=self.worker_id, timeout_s=1.0)
                except (MasterUnavailable, RemoteError):
                    pass
            control.close()
            self._close_data()

    def _close_data(self) -> None:
        self.data.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.close()

    # -- producer thread ---------------------------------------------------------------
    def _produce(self) -> None:
        rpc = RpcClient(self.ctx, self.master, self.rpc_timeout_s, auth=self.auth)
        notify = self.ctx.socket(zmq.PUSH)
        notify.connect("inproc://worker-notify")
        try:
            while self.buffer.wait_for_room(self.stop_event):
                if self.draining.is_set():
                    self.stop_event.wait(0.1)
                    continue
                try:
                    reply = rpc.call("get_split", worker_id=self.worker_id, avoid_ranks=self.buffer.blocked_ranks(),
                                     stop=self.stop_event)
                except (MasterUnavailable, RemoteError) as e:
                    log.warning("get_split: %s", e)
                    time.sleep(0.5)
                    continue
                if reply["t"] == "no_split":
                    self.stop_event.wait(reply["retry_ms"] / 1000)
                    continue
                try:
                    task = SplitTask.from_wire(reply["split"])
                except ValueError as e:  # the master re-queues it when the split times out
                    log.error("dropped a malformed split from the master: %s", e)
                    self.stop_event.wait(0.5)
                    continue
                if not self.allowlist.allows(task.file.path):
                    self._report_failure(rpc, task, f"{task.describe()}: file {task.file.path!r} is outside this "
                                                    "worker's --allow-table prefixes")
                    continue
                self._process(task, rpc, notify)
        finally:
            rpc.close()
            notify.close(linger=0)

    def _process(self, task: SplitTask, rpc: RpcClient, notify: zmq.Socket) -> None:
        self._epochs[task.rank] = max(task.epoch, self._epochs.get(task.rank, task.epoch))
        start = time.perf_counter()
        self._producing = [task.epoch, task.split_id, 0]
        try:
            for piece in self.processor.pieces(task):
                self.faults.before_piece(self.stop_event)
                outcome = self.buffer.put((task.rank, task.epoch), piece, self.stop_event)
                if outcome == STOPPED:
                    return
                if outcome != STORED:  # the rank is silent, or its share is full while others starve
                    reason = ("its client went silent" if outcome == RELEASED
                              else "its rank's share of the buffer is full while another rank waits")
                    self._call_quietly(rpc, "splits_released", worker_id=self.worker_id,
                                       splits=[[task.epoch, task.split_id]], reason=reason)
                    return
                self._producing[2] += 1
                self._stats["rows"] += piece.rows
                self._stats["batches"] += 1
                # Wake the server loop only when it may have found this queue empty: with
                # pieces already queued it is sending them (or waits for credit, whose
                # arrival wakes it), and a wake-up per piece costs both threads the GIL.
                if self.buffer.held((task.rank, task.epoch)) == 1:
                    notify.send(b"")
            self._stats["splits"] += 1
            # Still reported as producing until the master knows it is produced, so a
            # heartbeat in between never makes the split look abandoned.
            self._call_quietly(rpc, "split_produced", worker_id=self.worker_id, epoch=task.epoch,
                               split_id=task.split_id)
        except SplitError as e:
            self._report_failure(rpc, task, str(e))
        except Exception:  # a bug must surface in the client, not hang the job
            self._report_failure(rpc, task, f"{task.describe()}: worker error:\n{traceback.format_exc()}")
        finally:
            self._producing = None
            self._stats["busy_s"] += time.perf_counter() - start

    def _report_failure(self, rpc: RpcClient, task: SplitTask, message: str) -> None:
        log.error("%s", message)
        self._call_quietly(rpc, "split_failed", worker_id=self.worker_id, epoch=task.epoch, split_id=task.split_id,
                           error=message[:8000])

    def _call_quietly(self, rpc: RpcClient, t: str, **fields) -> None:
        try:
            rpc.call(t, stop=self.stop_event, **fields)
        except (MasterUnavailable, RemoteError) as e:
            log.warning("%s: %s", t, e)

    # -- control thread ------------------------------------------------------------------
    def _control(self, control: RpcClient) -> None:
        """Heartbeats, drain and released splits, off the serving loop: a slow or restarting
        master never delays a batch. Also where signal requests take effect."""
        next_heartbeat = 0.0
        failures = 0
        while not self.stop_event.is_set():
            now = time.monotonic()
            if self._requested == "stop":
                self.stop_event.set()
                break
            if self._requested == "drain":
                self.draining.set()
            if self.draining.is_set() and not self._drain_reported:
                self._drain_reported = True
                self._drain_deadline = now + self.drain_timeout_s
                try:
                    control.call("drain", worker_id=self.worker_id, timeout_s=2.0, stop=self.stop_event)
                except (MasterUnavailable, RemoteError) as e:
                    # No master to hand splits to (e.g. the whole service is shutting
                    # down): nothing to wait for.
                    log.warning("drain: %s; exiting", e)
                    self._master_gone = True
                    self.stop_event.set()
                    break
            if now >= self._drain_deadline:
                log.warning("drain timed out after %.0f s; handing splits back", self.drain_timeout_s)
                self.stop_event.set()
                break
            if now >= next_heartbeat:
                if self._heartbeat(control):
                    failures = 0
                    self._release_silent(control)
                    next_heartbeat = now + self.heartbeat_interval
                else:
                    failures += 1
                    next_heartbeat = now + backoff_delay(failures, self.heartbeat_interval, self._rng)
            self.stop_event.wait(min(0.05, max(0.0, next_heartbeat - time.monotonic())))

    # -- server loop -----------------------------------------------------------------
    def _serve(self) -> None:
        wake = self.ctx.socket(zmq.PULL)
        wake.bind("inproc://worker-notify")
        poller = zmq.Poller()
        poller.register(self.data, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while not self.stop_event.is_set():
                events = dict(poller.poll(100))
                if wake in events:
                    while has_message(wake):
                        wake.recv()
                if self.data in events:
                    while has_message(self.data):
                        self._on_request(self.data.recv_multipart(copy=False))
                self._push_credited()
        finally:
            wake.close(linger=0)

    def _on_request(self, parts: list) -> None:
        identity, body = parts[0].bytes, parts[1:]
        msg = wire.safe_decode(body, "client")
        if msg is None:
            return
        header, _ = msg
        if header["t"] != "credit":
            log.warning("dropped %r from a client: workers only take credit", header["t"])
            return
        rank, epoch = header["rank"], header["epoch"]
        # Only an epoch the master has opened for this rank (or the next one) retires older
        # pieces: credit for a far-off epoch waits without discarding anybody's data.
        if epoch <= self._epochs.get(rank, -1) + 1:
            self.buffer.drop_before(rank, epoch)
            for key in [k for k in self._credit if k[0] == rank and k[1] < epoch]:
                self._creditors -= len(self._credit.pop(key))
        self.buffer.heard_from(rank)
        creditors = self._credit.setdefault((rank, epoch), {})
        credit = creditors.get(identity)
        if credit is None:
            if self._creditors >= MAX_CREDITORS:
                log.warning("dropped credit from %s: too many clients hold credit", identity.hex())
                if not creditors:
                    del self._credit[(rank, epoch)]
                return
            credit = creditors[identity] = Credit()
            self._creditors += 1
        credit.grant(header["batches"], header["bytes"])

    def _push_credited(self) -> None:
        """Push pieces to clients holding credit for their (rank, epoch): as many as the
        credit allows and the buffer holds, a run of consecutive pieces of one split to a
        message. A run is one range of the split's arrays, so it goes as one frame per
        tensor, however many pieces it holds (``wire.MAX_PIECES`` bounds them)."""
        hungry = set()
        for key, creditors in list(self._credit.items()):
            for identity, credit in list(creditors.items()):
                while credit.open:
                    pieces, nbytes = [], 0
                    while credit.open_after(len(pieces), nbytes) and len(pieces) < wire.MAX_PIECES:
                        piece = self.buffer.pop(key)
                        if piece is None:
                            break
                        # A run is one frame per tensor: it must stay under the client's frame limit.
                        if pieces and (not piece.follows(pieces[-1]) or nbytes + piece.nbytes > wire.MAX_FRAME_BYTES):
                            self.buffer.put_back(key, [piece])
                            break
                        pieces.append(piece)
                        nbytes += piece.nbytes
                    if not pieces:
                        hungry.add(key[0])
                        break
                    first = pieces[0]
                    descs, frames = wire.pack_arrays(first.source.arrays(first.lo, pieces[-1].hi))
                    # `held`: what is left here for this rank, so its client can tell that
                    # it waits for want of credit rather than for want of data.
                    msg = wire.encode("batch", frames, rank=key[0], epoch=key[1], split_id=first.split_id,
                                      piece=first.index, rows=[p.rows for p in pieces],
                                      held=self.buffer.held(key), tensors=descs)
                    try:
                        # Never block: a client that does not read fills its pipe, and a
                        # blocked send would stop serving everybody else.
                        self.data.send_multipart([identity, *msg], copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        self.buffer.put_back(key, pieces)  # its pipe is full: try again on a later pass
                        break
                    except zmq.ZMQError:
                        # That client is gone (ROUTER_MANDATORY tells us instead of dropping
                        # the message): keep the pieces for whoever holds credit next.
                        self.buffer.put_back(key, pieces)
                        del creditors[identity]
                        self._creditors -= 1
                        break
                    credit.spend(len(pieces), nbytes)
            if not creditors:
                del self._credit[key]
        # Ranks with credit and nothing buffered: a producer stuck on another rank's full
        # share hands its split back rather than keep them waiting.
        self.buffer.set_hungry(frozenset(hungry))

    def _release_silent(self, control: RpcClient) -> None:
        """Hand back the splits of ranks silent past the client timeout (their pieces are
        dropped); kept and retried until the master has them, or that rank would wait for
        pieces nobody holds."""
        released = self.buffer.release_silent()
        if released:
            log.warning("released %d splits held for silent clients", len(released))
        self._unreported.extend(list(s) for s in released)
        while self._unreported:
            chunk = self._unreported[:1024]
            try:
                control.call("splits_released", worker_id=self.worker_id, splits=chunk,
                             reason="its client went silent", timeout_s=min(self.rpc_timeout_s, 2.0))
            except (MasterUnavailable, RemoteError) as e:
                log.warning("splits_released: %s; retrying", e)
                return
            del self._unreported[:len(chunk)]

    def _heartbeat(self, control: RpcClient) -> bool:
        stats = dict(self._stats, cpu=self._proc.cpu_percent() / 100.0, capacity=self.buffer.capacity,
                     ahead=self.buffer.ahead_count(),
                     mem=float(self._proc.memory_info().rss), time=time.time())
        producing = self._producing
        if producing is not None:
            stats["split"] = list(producing)
        if self.processor is not None:
            stats["io"] = self.processor.io.to_dict()
        try:
            reply = control.call("heartbeat", worker_id=self.worker_id, buffered=len(self.buffer), stats=stats,
                                 timeout_s=min(self.rpc_timeout_s, 2.0))
        except (MasterUnavailable, RemoteError) as e:
            log.warning("heartbeat: %s", e)
            if self.draining.is_set():
                self.stop_event.set()  # draining with no master to hand splits to: nothing to wait for
            return False
        state = reply.get("state")
        if state == "drain":
            self.draining.set()
            self._drain_reported = True
            self._drain_deadline = min(self._drain_deadline, time.monotonic() + self.drain_timeout_s)
        elif state == "stop":
            log.info("worker %s drained; exiting", self.worker_id)
            self.stop_event.set()
        elif state == "unknown":
            # The master lost us (restart without journal, or we were presumed dead): rejoin.
            log.warning("master does not know worker %s; registering again", self.worker_id)
            self.worker_id = None
            self._join(control)
        return True


class Credit:
    """What one client granted for one (rank, epoch), and what it has been sent.

    Grants are cumulative totals (pieces and bytes since the client started the epoch),
    so a repeated or reordered grant changes nothing: the largest total wins. A piece
    goes while both totals exceed what was sent (a piece bigger than the byte credit
    left still goes, so a large piece cannot wedge the stream)."""

    __slots__ = ("pieces", "bytes", "sent_pieces", "sent_bytes")

    def __init__(self) -> None:
        self.pieces = self.bytes = self.sent_pieces = self.sent_bytes = 0

    def grant(self, pieces: int, nbytes: int) -> None:
        self.pieces, self.bytes = max(self.pieces, pieces), max(self.bytes, nbytes)

    @property
    def open(self) -> bool:
        return self.open_after(0, 0)

    def open_after(self, pieces: int, nbytes: int) -> bool:
        """Whether one more piece may go once ``pieces`` / ``nbytes`` more have been sent."""
        return self.sent_pieces + pieces < self.pieces and self.sent_bytes + nbytes < self.bytes

    def spend(self, pieces: int, nbytes: int) -> None:
        self.sent_pieces += pieces
        self.sent_bytes += nbytes


class TableRefused(Exception):
    """The master's job names a table this worker may not read (``--allow-table``)."""


class Faults:
    """Test hooks for fault injection (chaos and autoscaling tests); inert by default."""

    def __init__(self, batch_delay_s: float = 0.0, hang_after_pieces: int = -1) -> None:
        self.batch_delay_s = batch_delay_s
        self.hang_after_pieces = hang_after_pieces
        self._pieces = 0

    def before_piece(self, stop: threading.Event) -> None:
        if self.batch_delay_s:
            stop.wait(self.batch_delay_s)  # an expensive transform, for autoscaling tests
        self._pieces += 1
        if self.hang_after_pieces >= 0 and self._pieces > self.hang_after_pieces:
            stop.wait()  # a hung worker: heartbeats go on, the split makes no progress
