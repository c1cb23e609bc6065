"""Which epoch runs a worker still produces and holds pieces for (docs/protocol.md, "Worker rules").

A run is one epoch of one client session, both issued by the master: ``(session, seq)``.
Staleness is decided per session and never across sessions by number, so epochs 0, 1, 0
of one loader, a second job after a first one, or the resume of an older checkpoint never
look "older" than anything still wanted. A run (S, q) is stale when

* its client credited a newer run (S, q') with q' > q: it moved on (``stale_run``);
* session S is gone (``session_gone``): a task of its rank arrived for another session
  (the master gives a rank's splits to its live session only), or S was missing from the
  live sessions of a heartbeat reply to a request sent after the worker first saw S.

``Sessions`` holds no lock: the piece buffer calls it under its own.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Collection, ItemsView, Optional

from ..core.plan import SplitTask

RunId = tuple[str, int]  # (session, seq): what credit and batch messages name
STALE_RUN, SESSION_GONE = "stale_run", "session_gone"
# Sessions a worker remembers: live ones, and gone ones so that their late tasks are dropped.
# Credit from made-up sessions cannot grow either past this.
MAX_SESSIONS = 1 << 14


@dataclass(frozen=True)
class Run:
    """The run a split's pieces are for, and the rank and epoch they belong to."""

    session: str
    seq: int
    rank: int
    epoch: int
    job: str = ""  # its job's spec fingerprint: what the worker names when it hands the split back

    @property
    def id(self) -> RunId:
        return self.session, self.seq

    @classmethod
    def of(cls, task: SplitTask) -> "Run":
        return cls(task.session, task.seq, task.rank, task.epoch, task.fingerprint)


class SessionState:
    """What the worker knows of one client session."""

    __slots__ = ("rank", "job", "credited", "seen", "heard", "silent")

    def __init__(self, seen: int, now: float) -> None:
        self.rank: Optional[int] = None  # known once a task of it arrives
        self.job = ""  # its job's spec fingerprint, known with its rank
        self.credited = -1  # the newest seq its client granted credit for
        self.seen = seen  # generation (``Sessions.mark``) at which the worker first saw it
        self.heard = now  # its last credit (or its first piece): silence is measured from here
        self.silent = False  # released for silence: nothing is kept for it until it credits again


class Sessions:
    def __init__(self) -> None:
        self._live: dict[str, SessionState] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()
        # (job, rank) -> the session its newest task came for: a shared fleet's jobs have ranks of the same numbers
        self._rank_session: dict[tuple[str, int], str] = {}
        self._generation = 0

    def get(self, session: str) -> Optional[SessionState]:
        return self._live.get(session)

    def items(self) -> ItemsView[str, SessionState]:
        return self._live.items()

    def stale(self, run: RunId) -> Optional[str]:
        """Why pieces of ``run`` are no longer wanted, or None while they are."""
        if run[0] in self._gone:
            return SESSION_GONE
        state = self._live.get(run[0])
        return STALE_RUN if state is not None and run[1] < state.credited else None

    def is_ahead(self, run: RunId) -> bool:
        """A run its client has not started reading (a prefetched next epoch)."""
        state = self._live.get(run[0])
        return state is not None and 0 <= state.credited < run[1]

    def admit(self, run: Run, now: float) -> list[str]:
        """A task of ``run`` arrived: the sessions it retires (another session of its rank in its job)."""
        state = self._state(run.session, now)
        if state is None:
            return []
        state.rank, state.job = run.rank, run.job
        retired = []
        previous = self._rank_session.get((run.job, run.rank))
        if previous is not None and previous != run.session:
            self.forget(previous)
            retired.append(previous)
        self._rank_session[run.job, run.rank] = run.session
        return retired

    def credit(self, run: RunId, now: float) -> bool:
        """A client granted credit for ``run``; False if that run is not wanted (or no
        room is left for another session)."""
        if self.stale(run) is not None:
            return False
        state = self._state(run[0], now)
        if state is None:
            return False
        state.credited = max(state.credited, run[1])
        state.heard = now
        state.silent = False
        return True

    def mark(self) -> int:
        """Call before sending a heartbeat; give the result to ``keep``."""
        self._generation += 1
        return self._generation

    def keep(self, live: Collection[str], mark: int) -> list[str]:
        """The master's live sessions, as of a request made at ``mark``: sessions seen
        before that and absent from ``live`` are gone (returned)."""
        live = set(live)
        gone = [s for s, state in self._live.items() if state.seen < mark and s not in live]
        for session in gone:
            self.forget(session)
        return gone

    def forget(self, session: str) -> None:
        state = self._live.pop(session, None)
        self._unindex(session, state)
        self._gone[session] = None
        if len(self._gone) > MAX_SESSIONS:
            self._gone.popitem(last=False)  # sessions are never reused: the oldest matter least

    def expire(self, idle: Collection[str]) -> None:
        """Drop what is known of sessions long silent with nothing held (bounds the table)."""
        for session in idle:
            self._unindex(session, self._live.pop(session, None))

    def _unindex(self, session: str, state: Optional[SessionState]) -> None:
        if state is not None and state.rank is not None and self._rank_session.get((state.job, state.rank)) == session:
            del self._rank_session[state.job, state.rank]

    def _state(self, session: str, now: float) -> Optional[SessionState]:
        state = self._live.get(session)
        if state is None and session not in self._gone and len(self._live) < MAX_SESSIONS:
            state = self._live[session] = SessionState(self._generation, now)
        return state
