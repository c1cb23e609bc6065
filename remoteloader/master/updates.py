"""Update records: the only way the master's state changes.

Each record is a frozen msgspec Struct, tagged by its class name (``u``). ``JobState.apply``
is the one function that interprets them; the journal stores them with ``encode`` and
replays them with ``decode``, which validates a record whole (every field, nested records
included) against these types, so recovery after a crash runs the same code as live
operation on the same types. Records marked ``TRANSIENT`` (liveness and metrics) are
applied but not journaled: after a restart the master learns them afresh from the next
heartbeats.

``Snapshot`` is the whole durable state of one job as one versioned tree; ``FleetSnapshot``
the whole master's (its workers and every job's ``Snapshot``): the first and only record of
a compacted journal (the one meaning of "snapshot" in the master). A master serves several
jobs (issue 39): an update of one job travels as ``ForJob(job, update)``; workers' updates
are the fleet's and reach every job. A journal written before (bare job updates, one
``Snapshot``) replays as a master of that one job.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional, Union

import msgspec

from ..core.plan import BaseSplit
from ..formats import DataFile, Unit
from ..protocol.messages import FileRecord, SplitError, UnitRecord
from ..spec import DatasetSpec

# 3: typed records (msgspec), the snapshot a tree of named records; 2: client sessions and
# epoch runs (session, seq), partitions journaled.
SNAPSHOT_VERSION = 3


class Update(msgspec.Struct, frozen=True, tag_field="u", tag=True):
    TRANSIENT: ClassVar[bool] = False


# -- records nested in updates and in the snapshot (the wire's, where they coincide) --------
def file_record(f: DataFile) -> FileRecord:
    return FileRecord(f.path, f.format, f.partition, f.num_rows, f.nbytes,
                      [UnitRecord(u.index, u.first_row, u.num_rows, u.nbytes) for u in f.units], f.tail_digest,
                      f.identity)


def data_file(r: FileRecord) -> DataFile:
    return DataFile(r.path, r.format, r.partition, r.num_rows, r.nbytes,
                    tuple(Unit(u.index, u.first_row, u.num_rows, u.nbytes) for u in r.units), r.tail_digest,
                    r.identity)


# A job has up to ~100,000 base splits and an epoch as many progress entries: those two
# records are arrays (no field names repeated per row); decoding still checks each whole.
class SplitRecord(msgspec.Struct, frozen=True, array_like=True):
    """A ``BaseSplit`` but its id, which is its index in the job's list."""
    file: int
    first_unit: int
    stop_unit: int
    rows: int
    raw_rows: int
    position: int

    @classmethod
    def of(cls, s: BaseSplit) -> "SplitRecord":
        return cls(s.file, s.first_unit, s.stop_unit, s.rows, s.raw_rows, s.position)

    def base_split(self, split_id: int) -> BaseSplit:
        return BaseSplit(split_id, self.file, self.first_unit, self.stop_unit, self.rows, self.raw_rows, self.position)


class ProgressRecord(msgspec.Struct, frozen=True, array_like=True):
    """A split of an epoch run that has progress (consumed pieces, a worker, or a failure)."""
    split_id: int
    consumed: int
    worker: Optional[str]
    assigned_at: float
    produced: bool
    failed: Optional[str]


class JobRecord(msgspec.Struct, frozen=True):
    spec: DatasetSpec
    fingerprint: str
    schema: dict[str, str]
    files: list[FileRecord]
    splits: list[SplitRecord]
    world_size: Optional[int]
    # Following a table: splits of the first listing (what the plan fingerprint covers), each
    # window's base split range by epoch, and whether the stream has ended.
    listed: Optional[int] = None
    windows: dict[int, tuple[int, int]] = {}
    ended: bool = False
    tables: list[int] = []  # tables mixed by weight: each file's table (JobSubmitted.tables)
    split_rows: Optional[int] = None  # JobSubmitted.split_rows
    name: str = ""  # JobSubmitted.name


class WorkerRecord(msgspec.Struct, frozen=True):
    worker_id: str
    addr: str
    pid: int
    seq: int
    last_seen: float
    draining: bool
    assigned: list[tuple[int, int]]  # (epoch, split id), sorted
    key: str = ""  # its X25519 public key (register.key)
    node: str = ""  # register.node: where it runs, for locality
    arena: str = ""  # register.arena: its arena socket, for clients on its host


class SessionRecord(msgspec.Struct, frozen=True):
    session: str
    rank: int
    seen: float
    next_seq: int
    node: str = ""  # hello.node: where the rank runs, for locality


class CacheChoiceRecord(msgspec.Struct, frozen=True, array_like=True):
    """A feature group's cache mode (compute | transformed | source) and why."""
    group: str
    mode: str
    reason: str


class RunRecord(msgspec.Struct, frozen=True):
    """An epoch run of a rank (current or prefetched): the splits come from the epoch's plan."""
    rank: int
    epoch: int
    session: str
    seq: int
    finished: bool
    pending: list[int]
    progress: list[ProgressRecord]


# -- updates ------------------------------------------------------------------------------------
class MasterStarted(Update):
    """A (re)start: live workers get a fresh heartbeat grace period from ``time``."""
    time: float


class Snapshot(Update):
    """The whole durable state (``JobState.snapshot()``) but what heartbeats bring back:
    the first and only record of a compacted journal. Decoded whole, and refused whole
    when of another version, before the state it replaces is touched."""
    version: int
    job: Optional[JobRecord]
    worker_seq: int
    workers: list[WorkerRecord]
    sessions: list[SessionRecord]
    replaced: list[str]
    partitions: dict[int, list[str]]
    resumed: dict[int, dict[int, list[tuple[int, int]]]]  # epoch -> base split -> row ranges consumed before
    runs: list[RunRecord]
    prefetched: list[RunRecord]
    errors: list[SplitError]  # failed splits, and files left out
    error_counts: dict[str, int]
    cache_plan: list[CacheChoiceRecord] = []  # the cache policy's last decision (mode auto)
    cache_reverted: list[str] = []


class JobSubmitted(Update):
    spec: DatasetSpec
    fingerprint: str
    schema: dict[str, str]  # column -> kind, as the table's files agree on it
    files: list[FileRecord]
    splits: list[SplitRecord]
    skipped: list[str]  # files left out (on_error: skip), with the reason
    tables: list[int] = []  # tables mixed by weight (spec tables): each file's table; empty: one table
    # The rows a base split was planned at (split_rows, or fewer to fit the workers' buffer):
    # a following job's growths are planned at it, by this master or a restarted one.
    split_rows: Optional[int] = None
    # The job's name (hello.job, on a shared fleet): its key is (fingerprint, name); "", in a
    # journal written before names too, the fingerprint alone.
    name: str = ""


class WorkerRegistered(Update):
    worker_id: str
    addr: str
    pid: int
    time: float
    key: str = ""  # its X25519 public key: clients get it in membership, also after a replay
    node: str = ""  # register.node: the ranks of this node get it first (partitions)
    arena: str = ""  # register.arena: its arena socket, for clients on its host (membership)


class WorkerHeartbeat(Update):
    TRANSIENT: ClassVar[bool] = True
    worker_id: str
    time: float
    buffered: int
    stats: dict[str, Any]


class WorkerLost(Update):
    worker_id: str
    reason: str


class WorkerDraining(Update):
    """No new splits for this worker; it leaves once clients consumed what it holds."""
    worker_id: str


class SplitRevoked(Update):
    """A split whose worker made no progress for too long goes back to the queue."""
    epoch: int
    split_id: int
    worker_id: str
    reason: str


class ClientJoined(Update):
    """A client session (issued by the master at ``hello``) joins for ``rank``; a session
    that held the rank before is replaced (a new process of that rank)."""
    session: str
    rank: int
    world_size: int
    time: float
    node: str = ""  # hello.node: the partition of the rank prefers this node's workers


class ClientHeartbeat(Update):
    TRANSIENT: ClassVar[bool] = True
    session: str
    time: float
    stats: dict[str, Any]


class ClientLeft(Update):
    """A client said goodbye, or was silent past the client timeout. Its rank's epoch runs
    are released (a client of that rank that comes back is a new session: it reports what
    it consumed). When the last session leaves, the job's ranks are reset, so the next job
    may have another world size."""
    session: str
    reason: str


class PartitionsChanged(Update):
    """Which workers each rank reads from, as the service decided it (workers of the rank's
    own node first): journaled, so that replay does not depend on ``--max-workers-per-client``."""
    partitions: list[tuple[int, list[str]]]  # (rank, worker ids), by rank


class EpochStarted(Update):
    """Run ``seq`` of ``session``: the rank starts (or restarts) ``epoch``."""
    rank: int
    epoch: int
    session: str
    seq: int


class EpochResumed(Update):
    """The epoch continues a checkpoint of a job with another world size: its plan leaves
    out the rows consumed before (``(base split, lo, hi)``; a mix of tables names a base
    split's rows in a pass by ``core.mix.rows_key``) and spreads the rest over this job's ranks."""
    epoch: int
    done: list[tuple[int, int, int]]


class EpochPrefetched(Update):
    """Workers with nothing left of a rank's epoch may start its next one, so the trainer
    does not wait at the epoch boundary; the rank takes it over at its next start_epoch
    (same session and epoch), which reserves ``seq`` for it."""
    rank: int
    epoch: int
    session: str
    seq: int


class SplitAssigned(Update):
    epoch: int
    split_id: int
    worker_id: str
    time: float


class SplitProduced(Update):
    epoch: int
    split_id: int
    worker_id: str


class SplitsConsumed(Update):
    """Consumption progress. Not journaled: it is most of the traffic, and every client
    reports all it has consumed again when it sees a new master (``membership.master``)."""
    TRANSIENT: ClassVar[bool] = True
    rank: int
    seq: int  # the rank's run the acks are for; acks of another run are stale
    acks: list[tuple[int, int]]  # (split id, pieces consumed so far)


class SplitFailed(Update):
    epoch: int
    split_id: int
    worker_id: str
    error: str
    skipped: bool  # on_error: skip quarantines the split; fail stops the job


class CachePlanChanged(Update):
    """The cache policy's decision for the job (``cache.mode: auto``): a mode per feature
    group, and the groups reverted to compute for good because caching made the job slower."""
    fingerprint: str
    choices: list[CacheChoiceRecord]
    reverted: list[str]


class EpochFinished(Update):
    rank: int
    seq: int


class TableGrew(Update):
    """A re-listing of a following job's table found new files (``core/follow.py``): they
    and their base splits continue the job's lists, which must end at ``first_file`` and
    ``first_split`` (a growth is never applied twice, nor out of order). ``problems``: files
    changed, removed or unreadable since, told once; ``ended``: ``follow.until`` was reached."""
    first_file: int
    first_split: int
    files: list[FileRecord]
    splits: list[SplitRecord]
    problems: list[str]
    ended: bool


class WindowOpened(Update):
    """Epoch ``epoch`` of a following job reads base splits ``[lo, hi)``: those added since
    the window before (the first: the first listing's and what landed until it started)."""
    epoch: int
    lo: int
    hi: int


# -- many jobs on one master (issue 39) ------------------------------------------------------
# The updates of one job. Everything else (a start, workers' updates) concerns the whole fleet.
JOB_UPDATES: tuple[type[Update], ...] = (
    JobSubmitted, ClientJoined, ClientHeartbeat, ClientLeft, PartitionsChanged, EpochStarted, EpochResumed,
    EpochPrefetched, SplitAssigned, SplitProduced, SplitsConsumed, SplitFailed, CachePlanChanged, EpochFinished,
    SplitRevoked, Snapshot, TableGrew, WindowOpened)
JobUpdate = Union[JOB_UPDATES]  # type: ignore[valid-type]


class ForJob(Update):
    """``update`` of the job whose key is ``job`` (``messages.job_key``: its spec fingerprint,
    and ``/name`` for a named job). A ``JobSubmitted`` of a key the master does not hold
    starts that job (from the fleet's workers)."""
    job: str
    update: JobUpdate


class JobEnded(Update):
    """The job's last session left (goodbye or client timeout) and another job needed its
    place: the job, its plan and its books go (its next loader binds the spec again)."""
    job: str
    reason: str


# 1: the fleet's workers (a Snapshot without a job) and every job's Snapshot.
FLEET_SNAPSHOT_VERSION = 1


class FleetSnapshot(Update):
    """The whole durable state of a master of several jobs: the first and only record of a
    compacted journal. Refused whole (nothing applied) when of another version or not of one piece."""
    version: int
    workers: Snapshot  # the workers as the fleet knows them: what a new job starts from
    jobs: list[Snapshot]


def transient(update: Update) -> bool:
    """Whether ``update`` is applied but not journaled (``TRANSIENT``, or a job's transient update)."""
    return update.update.TRANSIENT if isinstance(update, ForJob) else update.TRANSIENT


# Updates only the fleet interprets (a job's state never sees them).
FLEET_ONLY: tuple[type[Update], ...] = (ForJob, JobEnded, FleetSnapshot)
UPDATE_TYPES: dict[str, type[Update]] = {cls.__name__: cls for cls in Update.__subclasses__()}
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Union[tuple(UPDATE_TYPES.values())])  # type: ignore[misc]


def encode(update: Update) -> bytes:
    return _ENCODER.encode(update)


def decode(record: bytes) -> Update:
    """The update ``record`` holds, validated whole; ValueError (msgspec's errors are
    ValueErrors) for a record of another version or shape, or damaged."""
    return _DECODER.decode(record)
