"""The client's session with the master: hello, rejoin, goodbye, and every call it makes.

The master issues the identities (protocol 7): ``welcome`` names the client's session,
and each ``start_epoch`` answers with the seq of a new epoch run. Every later call names
them. When a call finds that the master does not know the session (error code
``unknown_client``: a restart without a journal, a client timeout), the session takes its
one rejoin path: hello again (a new session), start the current run again from what the
training loop consumed, and repeat the call under the new identities.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from ..protocol import messages as M
from ..protocol.rpc import HandshakeRefused, MasterUnavailable, RemoteError, RpcClient
from ..protocol.seal import TO_CLIENT, TO_WORKER, KeyPair, PeerBook
from ..spec import DatasetSpec, SpecError

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 5.0  # one try of a call; the session's retry policy spans ``timeout``
BINDING_RETRY_S = 0.2
WAITING_RETRY_S = (0.05, 1.0)  # a following job's next window waits for data: first and longest pause


@dataclass(frozen=True)
class RunId:
    """One epoch run as the master named it; replaced as a whole on rejoin (threads read it)."""

    session: str
    seq: int
    epoch: int
    token: str  # the master's signature of the session: workers serve its pieces only to credit carrying it
    seals: Optional[PeerBook] = None  # the session's key pair and its sealing state per worker (one per session)


@dataclass
class DataWait:
    """A following job's waits for its next window's data: the master's ``waiting`` answers
    and the seconds paused between retries. Kept apart from the stall the autoscaler reads
    (more workers would not shorten it): a trainer outran its table."""

    answers: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class RunStart:
    """What a run is (re)started from: the epoch, rows done before this job segment, and
    what this rank consumed, ``[[split id, pieces], ...]``."""

    epoch: int
    done: list
    consumed: list


def acks_of(consumed: dict[int, tuple[int, int]]) -> list[list[int]]:
    return [[sid, pieces] for sid, (pieces, _) in sorted(consumed.items())]


def ack_records(acks: Iterable[Sequence[int]]) -> list[M.Ack]:
    """``[[split id, pieces], ...]`` as the wire's acks."""
    return [M.Ack(sid, pieces) for sid, pieces in acks]


class ClientSession:
    """One rank's session: ``job`` after hello, ``run`` while an epoch is iterated.

    ``on_welcome(job)`` runs on every welcome (the plan check); ``resume_point()`` says
    what the current run restarts from on rejoin (set by the epoch being iterated).
    """

    def __init__(self, rpc: RpcClient, spec: DatasetSpec, rank: int, world_size: int, timeout: float,
                 connect_timeout: float, on_welcome: Callable[[M.JobInfo], None], node: str = "",
                 job: str = "") -> None:
        self.rpc, self.spec, self.rank, self.world_size = rpc, spec, rank, world_size
        self.job_name = job  # hello.job: loaders of one spec are one job on a shared fleet only under one name
        self.node = node  # where this rank runs (hello.node): the master gives it that node's workers first
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.on_welcome = on_welcome
        self.id: Optional[str] = None
        self.token = ""  # welcome.token, for this session's credit
        # A new X25519 key pair with each hello, so each session has keys (and nonces) of its own.
        self.seals: Optional[PeerBook] = None
        self.job: Optional[M.JobInfo] = None
        self.run: Optional[RunId] = None
        self.resume_point: Optional[Callable[[], RunStart]] = None
        self.stop = threading.Event()  # set by close(): retries end at once
        self.data_wait = DataWait()

    # -- hello and rejoin ---------------------------------------------------------------------
    def hello(self) -> M.JobInfo:
        """The job, saying hello first if this client has no session."""
        if self.id is None:
            self._say_hello()
        return self.job

    def _say_hello(self) -> None:
        deadline = time.monotonic() + self.timeout
        seals = PeerBook(KeyPair(), TO_WORKER, TO_CLIENT)
        while True:
            try:
                reply = self.rpc.call_with_retry(
                    M.Hello(rank=self.rank, world_size=self.world_size, spec=self.spec.to_dict(),
                            fingerprint=self.spec.fingerprint(), key=seals.pair.public_hex, node=self.node,
                            job=self.job_name),
                    time.monotonic() + self.connect_timeout, stop=self.stop, timeout_s=CALL_TIMEOUT_S)
                break
            except HandshakeRefused:
                raise  # it says why: the keys
            except MasterUnavailable as e:
                raise MasterUnavailable(f"{e}: is a remoteloader-master running there?") from None
            except RemoteError as e:
                if e.code == "binding" and time.monotonic() < deadline:
                    time.sleep(BINDING_RETRY_S)  # the master is reading the table's metadata
                    continue
                if e.code == "bad_spec":  # the message names the spec key or column at fault
                    raise SpecError(str(e)) from None
                raise RuntimeError(f"the master refused this loader: {e}") from None
        self.on_welcome(reply.job)
        self.id, self.token, self.job, self.seals = reply.session, reply.token, reply.job, seals

    def _rejoin(self, restart_run: bool, why: str = "the master does not know this client (restarted?)") -> None:
        # The master does not know this session (a restart without a journal, or it timed the
        # client out): a new session, and the run restarted from what was consumed, which is
        # all the master needs to continue the epoch exactly where it was.
        log.warning("rank %d: %s; rejoining", self.rank, why)
        self.id = None
        self._say_hello()
        if restart_run and self.run is not None and self.resume_point is not None:
            self._start(self.resume_point())

    # -- calls ----------------------------------------------------------------------------------
    def start_epoch(self, start: RunStart) -> M.Epoch:
        """Start a run of ``start.epoch``; returns the master's ``epoch`` reply (splits, seq)."""
        self.hello()
        return self._with_rejoin(lambda: self._start(start), restart_run=False)

    def _start(self, start: RunStart) -> M.Epoch:
        pause = WAITING_RETRY_S[0]
        while True:
            try:
                reply = self._call(M.StartEpoch(session=self.id, epoch=start.epoch,
                                                consumed=ack_records(start.consumed),
                                                done=[M.DoneRange(*d) for d in start.done]))
                break
            except RemoteError as e:
                # A following job's next window: the table has not grown since the last. A stream
                # waits for data as long as it takes (close() stops it); the master says why.
                if e.code != "waiting" or self.stop.is_set():
                    raise
                if pause == WAITING_RETRY_S[0]:
                    log.info("rank %d epoch %d: %s", self.rank, start.epoch, e)
                paused = time.monotonic()
                self.stop.wait(pause)
                self.data_wait.answers += 1
                self.data_wait.seconds += time.monotonic() - paused
                pause = min(2 * pause, WAITING_RETRY_S[1])
        self.run = RunId(self.id, reply.seq, start.epoch, self.token, self.seals)
        return reply

    def restart_run(self, start: RunStart) -> M.Epoch:
        """A new run of the current epoch from ``start`` (what the training loop consumed): the
        master has every piece not consumed produced again."""
        return self._with_rejoin(lambda: self._start(start), restart_run=False)

    def heartbeat(self, acks: list, stats: Optional[M.ClientStats] = None) -> M.Membership:
        """A synchronous heartbeat of the current run, from the training thread."""
        return self._with_rejoin(lambda: self._call(M.ClientHeartbeat(session=self.id, seq=self.run.seq,
                                                                      acks=ack_records(acks), stats=stats)))

    def finish_run(self, acks: list, timeout_s: float) -> None:
        """The end of a run whose every batch was delivered: last acks, then ``finish_epoch``.

        Best effort, within ``timeout_s``, no rejoin: the training loop has all its data, so
        a master gone meanwhile (rank 0 closing, a restart) is logged, never raised; the
        master ends an unfinished run when the session leaves or times out.
        """
        run, self.run = self.run, None
        deadline = time.monotonic() + timeout_s
        try:
            self.rpc.call_with_retry(M.ClientHeartbeat(session=run.session, seq=run.seq, acks=ack_records(acks)),
                                     deadline, stop=self.stop)
            self.rpc.call_with_retry(M.FinishEpoch(session=run.session, seq=run.seq), deadline, stop=self.stop)
        except (MasterUnavailable, RemoteError) as e:
            log.warning("rank %d epoch %d: every batch was delivered, but the master did not take the end of the "
                        "epoch (%s); going on", self.rank, run.epoch, e)

    def rejoin(self, why: str) -> None:
        """A new session, and the current run restarted from what the training loop consumed:
        the master has every piece not consumed produced again (after a master that forgot
        this client, or a sealed batch refused that may have been a genuine one)."""
        self._rejoin(True, why)

    def rejoin_after(self, error: RemoteError) -> None:
        """A call made elsewhere (the control thread) found the session unknown: rejoin, or re-raise."""
        if error.code != "unknown_client":
            raise self._ended(error)
        self._rejoin(True)

    def status(self) -> str:
        try:
            return str(self.rpc.call(M.Status(), timeout_s=2.0).status)
        except (MasterUnavailable, RemoteError) as e:
            return f"unavailable ({e})"

    def goodbye(self, timeout_s: float) -> None:
        """Best effort: the master forgets this client at once instead of timing it out."""
        if self.id is None:
            return
        try:
            self.rpc.call(M.Goodbye(session=self.id), timeout_s=timeout_s)
        except (MasterUnavailable, RemoteError) as e:
            log.info("rank %d: goodbye not acknowledged (%s)", self.rank, e)
        self.id = None

    def _with_rejoin(self, call: Callable[[], M.MasterReply], restart_run: bool = True) -> M.MasterReply:
        try:
            return call()
        except RemoteError as e:
            if e.code != "unknown_client":
                raise self._ended(e) from None
        self._rejoin(restart_run)
        return call()

    def _ended(self, error: RemoteError) -> RemoteError:
        """``replaced``: another loader holds this rank now; taking it back (a rejoin) would only
        make the two take turns, so this loader stops, saying why."""
        if error.code != "replaced":
            return error
        self.id = None
        return RemoteError(f"rank {self.rank}: this loader's session has ended: {error}", error.code)

    def _call(self, request: M.ClientRequest) -> M.MasterReply:
        """The one retry policy: retried while the master is unreachable, up to ``timeout``."""
        return self.rpc.call_with_retry(request, time.monotonic() + self.timeout, stop=self.stop,
                                        timeout_s=min(CALL_TIMEOUT_S, self.timeout))
