"""Update records: the only way the master's state changes.

Each record is a small frozen dataclass. ``JobState.apply`` is the one function that
interprets them; the journal stores them with ``to_record`` and replays them with
``from_record``, so recovery after a crash runs the same code as live operation.
Records marked ``TRANSIENT`` (liveness and metrics) are applied but not journaled:
after a restart the master learns them afresh from the next heartbeats.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar


@dataclass(frozen=True)
class Update:
    TRANSIENT: ClassVar[bool] = False

    def to_record(self) -> dict:
        return {"u": type(self).__name__, **asdict(self)}


@dataclass(frozen=True)
class MasterStarted(Update):
    """A (re)start: live workers get a fresh heartbeat grace period from ``time``."""
    time: float


@dataclass(frozen=True)
class Snapshot(Update):
    """The whole durable state (``JobState.snapshot()``): the first and only record of a
    compacted journal."""
    state: dict


@dataclass(frozen=True)
class JobSubmitted(Update):
    spec: dict
    fingerprint: str
    schema: dict  # column -> kind, as the table's files agree on it
    files: list  # DataFile.to_wire() of each file
    splits: list  # BaseSplit.to_wire() of each base split
    skipped: list  # files left out (on_error: skip), with the reason


@dataclass(frozen=True)
class WorkerRegistered(Update):
    worker_id: str
    addr: str
    pid: int
    time: float


@dataclass(frozen=True)
class WorkerHeartbeat(Update):
    TRANSIENT: ClassVar[bool] = True
    worker_id: str
    time: float
    buffered: int
    stats: dict


@dataclass(frozen=True)
class WorkerLost(Update):
    worker_id: str
    reason: str


@dataclass(frozen=True)
class WorkerDraining(Update):
    """No new splits for this worker; it leaves once clients consumed what it holds."""
    worker_id: str


@dataclass(frozen=True)
class SplitRevoked(Update):
    """A split whose worker made no progress for too long goes back to the queue."""
    epoch: int
    split_id: int
    worker_id: str
    reason: str


@dataclass(frozen=True)
class ClientJoined(Update):
    """A client session (issued by the master at ``hello``) joins for ``rank``; a session
    that held the rank before is replaced (a new process of that rank)."""
    session: str
    rank: int
    world_size: int
    time: float


@dataclass(frozen=True)
class ClientHeartbeat(Update):
    TRANSIENT: ClassVar[bool] = True
    session: str
    time: float
    stats: dict


@dataclass(frozen=True)
class ClientLeft(Update):
    """A client said goodbye, or was silent past the client timeout. Its rank's epoch runs
    are released (a client of that rank that comes back is a new session: it reports what
    it consumed). When the last session leaves, the job's ranks are reset, so the next job
    may have another world size."""
    session: str
    reason: str


@dataclass(frozen=True)
class PartitionsChanged(Update):
    """Which workers each rank reads from, as the service decided it: journaled, so that
    replay does not depend on ``--max-workers-per-client``."""
    partitions: list  # [[rank, [worker id, ...]], ...]


@dataclass(frozen=True)
class EpochStarted(Update):
    """Run ``seq`` of ``session``: the rank starts (or restarts) ``epoch``."""
    rank: int
    epoch: int
    session: str
    seq: int


@dataclass(frozen=True)
class EpochResumed(Update):
    """The epoch continues a checkpoint of a job with another world size: its plan leaves
    out the rows consumed before (``[[base split, lo, hi], ...]``) and spreads the rest
    over this job's ranks."""
    epoch: int
    done: list


@dataclass(frozen=True)
class EpochPrefetched(Update):
    """Workers with nothing left of a rank's epoch may start its next one, so the trainer
    does not wait at the epoch boundary; the rank takes it over at its next start_epoch
    (same session and epoch), which reserves ``seq`` for it."""
    rank: int
    epoch: int
    session: str
    seq: int


@dataclass(frozen=True)
class SplitAssigned(Update):
    epoch: int
    split_id: int
    worker_id: str
    time: float


@dataclass(frozen=True)
class SplitProduced(Update):
    epoch: int
    split_id: int
    worker_id: str


@dataclass(frozen=True)
class SplitsConsumed(Update):
    """Consumption progress. Not journaled: it is most of the traffic, and every client
    reports all it has consumed again when it sees a new master (``membership.master``)."""
    TRANSIENT: ClassVar[bool] = True
    rank: int
    seq: int  # the rank's run the acks are for; acks of another run are stale
    acks: list  # [[split_id, pieces consumed so far], ...]


@dataclass(frozen=True)
class SplitFailed(Update):
    epoch: int
    split_id: int
    worker_id: str
    error: str
    skipped: bool  # on_error: skip quarantines the split; fail stops the job


@dataclass(frozen=True)
class EpochFinished(Update):
    rank: int
    seq: int


UPDATE_TYPES: dict[str, type] = {cls.__name__: cls for cls in Update.__subclasses__()}


def from_record(record: Any) -> Update:
    if not isinstance(record, dict) or record.get("u") not in UPDATE_TYPES:
        raise ValueError(f"not an update record: {str(record)[:200]}")
    cls = UPDATE_TYPES[record["u"]]
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in record.items() if k in names})

