"""Every message and every nested record of the protocol, as types.

One ``msgspec`` Struct per message, tagged by ``t``; nested records (acks, done ranges,
split tasks, job info, stats) are Structs too, and every bound lives in the types
(``Meta``), so the one decoder in ``wire`` checks a message completely while it parses
it: nothing downstream checks shapes again. docs/protocol.md's tables are generated from
this module (``protocol/docs.py``).

Records that travel as rows in long lists (acks, units, splits) are ``array_like``: a
list on the wire, named fields in code.
"""
from __future__ import annotations

import enum
import re
import sys
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

import msgspec
from msgspec import Meta, Struct

PROTOCOL_VERSION = 16  # 16: a job has a name beside its spec (issue 39): hello names it (job), a shared fleet keys its jobs by spec fingerprint and name, and every field naming a job to workers (split tasks, get_spec, split_produced, split_failed, splits_released, a heartbeat's job and costs) carries that key, ``<fingerprint>/<name>`` (the fingerprint alone for an unnamed job); 15: following a growing table: error code waiting (the next window of a following job has no data yet: retry); tables mixed by weight (spec tables): split tasks carry their (table, pass), start_epoch's splits their lane key and (table, pass) (core/mix.py); a worker's heartbeat counts the blocks it shared between jobs (stats.shared); 14: batches that mix splits: split tasks carry their lane (spec mix_splits); one master serves several jobs (issue 39): registered says how many, get_split avoids sessions (ranks of jobs share numbers), get_spec names the job whose spec a worker compiles, split_produced, split_failed and splits_released name their job, a worker's heartbeat the job of the split it produces; 13: shared-memory arenas on one host: credit names the arena the client maps, a batch may lie in it (arena_offer, arena_release on the arena socket); locality: register and hello name the node (host) a worker and a client run on; 12: files carry identity (what the filesystem says of the file's version: block cache keys); 11: deterministic order: split tasks carry their schedule order, membership the holders of the run's splits; block cache: files carry tail_digest, split tasks a cache directive, heartbeats cache counters and job costs; 10: sealed data socket: X25519 keys in hello, register and membership, the session token signs the key, credit and batch carry gen and nonce (protocol/seal.py); 9: typed messages (credit.pieces, split tasks carry only their units, error codes an enum); 8: capabilities: welcome/credit token, registered token and verify_key, the worker token on every request naming a worker id; 7: master-issued client sessions and epoch runs (session, seq), goodbye, job fingerprint on register and split; 6: a batch message is a run of consecutive pieces, one frame per tensor; 5: several pieces per batch message; 4: credit replaces get_batch; 3: splits_released, get_split avoid_ranks; 2: files as maps, start_epoch done, ...
MAX_STRING = 4096  # ids, addresses, reasons
MAX_TEXT = 1 << 16  # error texts name files and causes
MAX_LIST = 1 << 20  # items of any list (a rank's splits, acks)
MAX_INT = (1 << 63) - 1
MAX_PIECES = 64  # pieces in one batch message
MAX_FRAME_BYTES = 1 << 30  # ZeroMQ handles up to ~2 GB; a batch this big is a misconfiguration
MAX_BUCKETS = 32  # buckets of a client's wait histogram
MAX_RELEASED = 1024  # splits handed back in one splits_released
MAX_ARENA_RELEASES = 4096  # regions handed back in one arena_release
ARENA_ALIGN = 64  # each tensor of a batch in an arena starts at a multiple of this

Id = Annotated[str, Meta(max_length=MAX_STRING)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Count = Annotated[int, Meta(ge=0, le=MAX_INT)]
Amount = Annotated[float, Meta(ge=0, le=sys.float_info.max)]  # finite: NaN and inf are refused
Dim = Annotated[int, Meta(ge=0, le=MAX_FRAME_BYTES)]
OrUnset = Annotated[int, Meta(ge=-1, le=MAX_INT)]  # -1: not about one epoch, rank or split
# A node (host) label, "" for none: the master gives each rank the workers of its own node first.
Node = Annotated[str, Meta(max_length=255)]
Key = Annotated[str, Meta(max_length=64, pattern="^([0-9a-f]{64})?$")]  # an X25519 public key, hex ("": none)
# A job's name (hello.job): two loaders of one spec are one job only under the same name, so a
# sweep's trials of one spec run side by side on a shared fleet. "": the spec fingerprint alone.
JOB_NAME_MAX = 40
JOB_NAME_PATTERN = "^([A-Za-z0-9][A-Za-z0-9._-]{0,%d})?$" % (JOB_NAME_MAX - 1)
JobName = Annotated[str, Meta(max_length=JOB_NAME_MAX, pattern=JOB_NAME_PATTERN)]


def check_job_name(name: str) -> str:
    """``name`` if it is a job name (``JobName``); else a ValueError naming the rule."""
    if not isinstance(name, str) or len(name) > JOB_NAME_MAX or re.fullmatch(JOB_NAME_PATTERN, name) is None:
        raise ValueError(f"job {str(name)[:60]!r}: a job name is 1 to {JOB_NAME_MAX} letters, digits, '.', '_' or "
                         "'-', starting with a letter or digit")
    return name


def job_key(fingerprint: str, name: str) -> str:
    """What names a job to workers and in status and metrics: its spec fingerprint, and its name."""
    return f"{fingerprint}/{name}" if name else fingerprint
Gen = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]  # a sealing key's generation
Nonce = Annotated[int, Meta(ge=1, le=MAX_INT)]  # the first counter of a sealed message (a 64-bit field)
DType = Literal["float32", "float64", "int32", "int64", "uint8"]


class ErrorCode(str, enum.Enum):
    """What an ``error`` reply's ``code`` may say (a str, so it compares with plain strings)."""

    NO_JOB = "no_job"
    WRONG_JOB = "wrong_job"
    UNKNOWN_WORKER = "unknown_worker"
    FULL = "full"
    BAD_SPEC = "bad_spec"
    BINDING = "binding"
    SPEC_MISMATCH = "spec_mismatch"
    BAD_RANK = "bad_rank"
    BUSY = "busy"
    BAD_EPOCH = "bad_epoch"
    RESUME_MISMATCH = "resume_mismatch"
    UNKNOWN_CLIENT = "unknown_client"
    REPLACED = "replaced"
    FLOOD = "flood"
    PROTOCOL = "protocol"
    WAITING = "waiting"


ERROR_MEANINGS = {
    ErrorCode.NO_JOB: "no job yet: the master waits for the first client's spec",
    ErrorCode.WRONG_JOB: "the master serves another job: the worker fetches the spec again",
    ErrorCode.UNKNOWN_WORKER: "no such worker, or `token` is not its `registered.token`: register again",
    ErrorCode.FULL: "the master already has `max_workers` workers",
    ErrorCode.BAD_SPEC: "the first client's spec does not bind (the message names the key or column)",
    ErrorCode.BINDING: "the master is still reading the table's metadata: retry",
    ErrorCode.SPEC_MISMATCH: "the spec's fingerprint differs from the running job's",
    ErrorCode.BAD_RANK: "rank outside the world size, or a world size above the master's maximum",
    ErrorCode.BUSY: "live clients of another world size: another job runs",
    ErrorCode.BAD_EPOCH: "an epoch out of range, or a run that is not the rank's current one",
    ErrorCode.RESUME_MISMATCH: "the epoch started with other rows consumed before a resume",
    ErrorCode.UNKNOWN_CLIENT: "unknown session: say hello again and restart the epoch with what was consumed",
    ErrorCode.REPLACED: "another session of the rank replaced this one: the loader stops",
    ErrorCode.FLOOD: "more than 100 `register` or `hello` in 10 s from one peer",
    ErrorCode.PROTOCOL: "the request does not follow the protocol (the message says how)",
    ErrorCode.WAITING: "a following job's next window has no data yet (the table has not grown): retry",
}


class WorkerState(str, enum.Enum):
    """``heartbeat_ok.state``: what the master wants the worker to do."""

    RUN = "run"
    DRAIN = "drain"  # finish what you hold, take nothing new
    STOP = "stop"  # drained: exit
    UNKNOWN = "unknown"  # register again


# -- nested records -------------------------------------------------------------------
class Record(Struct, forbid_unknown_fields=True):
    """A nested record: unknown fields are refused, like a message's."""


class Row(Record, array_like=True):
    """A record that travels as a list (rows of long lists)."""


class Ack(Row):
    """Pieces of a split the training loop consumed (a running total)."""

    split_id: Count
    pieces: Count


class DoneRange(Row):
    """Rows ``[lo, hi)`` of a base split consumed before an elastic resume."""

    base_split: Count
    lo: Count
    hi: Count


class SplitRef(Row):
    """A split a worker hands back."""

    epoch: Count
    split_id: Count


class EpochSplitInfo(Row):
    """One split of a rank's epoch, as ``start_epoch`` answers it."""

    split_id: Count
    rows: Count
    base_split: Count
    row_lo: Count
    padding: bool  # repeats a row to even out batch counts
    # Tables mixed by weight: the split's lane key (table, offset, rows a batch), which says the
    # rows of each table every batch takes (core/mix.py). None: no mix of tables.
    lane: Optional[Annotated[list[Count], Meta(min_length=3, max_length=3)]] = None
    # Tables mixed by weight: (table, pass) of the split, which with its base split names its rows
    # in positions (a restarted table reads a base split once per pass). None: no mix of tables.
    table: Optional[Annotated[list[Count], Meta(min_length=2, max_length=2)]] = None


class SplitHolder(Row):
    """A split of the rank's run and the worker producing it."""

    split_id: Count
    worker_id: Id


class WorkerAddr(Row):
    """A worker of the client's partition and its data endpoint."""

    worker_id: Id
    addr: Id
    key: Key = ""  # its X25519 public key: clients open its sealed frames with it
    arena: Id = ""  # register.arena: a client on the worker's host maps its arena there


class UnitRecord(Row):
    """An ORC stripe or Parquet row group: ``first_row`` within the file, ``nbytes`` on storage."""

    index: Count
    first_row: Count
    num_rows: Count
    nbytes: Count


class TensorDesc(Row):
    """The data frame at the same position: its dtype and shape (at most two dimensions)."""

    name: Id
    dtype: DType
    shape: Annotated[list[Dim], Meta(max_length=2)]


class ArenaSlice(Row):
    """Where a batch's tensors lie in the client's arena: a region of ``nbytes`` at ``offset``,
    the tensors one after another in the header's order, each starting at a multiple of
    ``ARENA_ALIGN`` from the region's start."""

    offset: Count
    nbytes: Dim


class ProducingSplit(Row):
    """The split a worker is producing."""

    epoch: Count
    split_id: Count
    pieces: Count  # produced so far


class FileRecord(Record):
    """A file of the table; in a split task, only the split's units."""

    path: Id
    format: Id
    partition: Id
    num_rows: Count
    nbytes: Count
    units: Annotated[list[UnitRecord], Meta(max_length=MAX_LIST)]
    tail_digest: Annotated[str, Meta(max_length=64)] = ""  # the file's identity with path and size (block cache keys)
    identity: Annotated[str, Meta(max_length=128)] = ""  # its version: inode and times, or an object's mtime (ditto)


MAX_FEATURES = 1 << 14  # features or columns a cache directive or a cost report names


class CacheDirective(Record):
    """What a split does with the block cache (docs/cache.md), from the master's cache plan
    for the job: look up the transformed blocks of ``features`` and the raw blocks of table
    columns ``sources``; of what it then computes or reads from the table, store the
    features in ``write_features`` and the columns in ``write_sources`` (with the label and
    passthrough columns, so that a split whose features are all cached reads no table)."""

    features: Annotated[list[Id], Meta(max_length=MAX_FEATURES)]
    sources: Annotated[list[Id], Meta(max_length=MAX_FEATURES)]
    write_features: Annotated[list[Id], Meta(max_length=MAX_FEATURES)]
    write_sources: Annotated[list[Id], Meta(max_length=MAX_FEATURES)]


class SplitTaskRecord(Record):
    """What a worker produces: units ``[first_unit, stop_unit)`` of ``file``, the rows
    ``[row_lo, row_hi)`` of them after the per-epoch shuffle, minus ``skip`` leading pieces."""

    epoch: Count
    split_id: Count
    rank: Count
    base: Count
    file: FileRecord
    first_unit: Count
    stop_unit: Count
    raw_rows: Count  # rows stored in the units
    position: Count  # canonical position of the first of them (table-level sampling hashes it)
    base_rows: Count  # rows after sampling: the space row_lo/row_hi index
    row_lo: Count
    row_hi: Count
    skip: Count  # leading pieces the client already consumed
    session: Annotated[str, Meta(max_length=64)]
    seq: Count
    fingerprint: Annotated[str, Meta(max_length=64)]
    cache: Optional[CacheDirective] = None  # None: the split does not touch the cache
    # Deterministic order (spec order.deterministic): the split's (cycle group, slot) in its
    # rank's schedule; the worker sends its pieces by key (group, piece, slot). None: arrival order.
    order: Optional[Annotated[list[Count], Meta(min_length=2, max_length=2)]] = None
    # Batches that mix splits (spec mix_splits): the split's (lane, offset in the lane, the lane's
    # share of a batch); the worker sends its pieces by key (row // share, lane, row), row the
    # piece's first in the lane (core/schedule.py). None: the split is in no lane.
    lane: Optional[Annotated[list[Count], Meta(min_length=3, max_length=3)]] = None
    # Tables mixed by weight (spec tables): the split's (table, pass of the table): the worker
    # reads the table's columns under their job names and shuffles a later pass's rows anew.
    table: Optional[Annotated[list[Count], Meta(min_length=2, max_length=2)]] = None


class JobInfo(Record):
    """The job as a client sees it (``welcome.job``)."""

    fingerprint: Id
    total_rows: Count
    rank_rows: Count  # rows of this rank's epoch, padding included
    dropped_rows: Count  # rows of each epoch no rank reads
    world_size: Optional[Count]
    sparse_keys: Annotated[list[Id], Meta(max_length=MAX_LIST)]
    sparse_scored: Annotated[list[bool], Meta(max_length=MAX_LIST)]  # per sparse key: does it carry scores
    plan: Id  # fingerprint of the split plan: a saved position resumes only over the same plan
    dense_width: Count


class SplitError(Record):
    """A split that failed (``skipped`` when the spec's ``on_error`` is ``skip``); a file left
    out at the job's start has epoch, rank and split_id -1."""

    epoch: OrUnset
    rank: OrUnset
    split_id: OrUnset
    rows: Count
    message: Text
    skipped: bool


class IOCounters(Record, omit_defaults=True):
    """A worker's storage reads: requests, bytes transferred and bytes the decoder needed."""

    requests: Optional[Count] = None
    bytes_requested: Optional[Count] = None
    bytes_needed: Optional[Count] = None
    splits: Optional[Count] = None


class Discarded(Record, omit_defaults=True):
    """Pieces a worker threw away so far, by reason (their splits went back to the master)."""

    stale_run: Optional[Count] = None
    session_gone: Optional[Count] = None
    silent: Optional[Count] = None
    yielded: Optional[Count] = None
    wrong_job: Optional[Count] = None


DISCARD_REASONS: tuple[str, ...] = Discarded.__struct_fields__


class CacheStats(Record, omit_defaults=True):
    """A worker's block cache: lookups found and missed, blocks put, faults by kind, bytes and seconds."""

    hits: Optional[Count] = None
    misses: Optional[Count] = None
    puts: Optional[Count] = None
    put_bytes: Optional[Count] = None
    corrupt: Optional[Count] = None  # a block whose checksum or MAC failed (written without the key, too)
    unverifiable: Optional[Count] = None  # a keyed block seen without the key
    faults: Optional[Count] = None  # listing, reading or writing failed, or timed out
    dropped: Optional[Count] = None  # writes dropped because the background writer was full
    bytes_read: Optional[Count] = None
    read_seconds: Optional[Amount] = None
    write_seconds: Optional[Amount] = None


class SharedBlockStats(Record, omit_defaults=True):
    """A worker's memo of blocks shared between the jobs it serves (a shared fleet): blocks
    one job computed that another took, those kept for another job, and those dropped unread."""

    hits: Optional[Count] = None
    hit_bytes: Optional[Count] = None
    puts: Optional[Count] = None
    put_bytes: Optional[Count] = None
    expired: Optional[Count] = None
    held_bytes: Optional[Count] = None  # what it holds now


class Cost(Row):
    """What computing one column or feature cost a worker so far: rows, seconds, bytes."""

    name: Id
    rows: Count
    seconds: Amount
    nbytes: Count


class JobCosts(Record):
    """A job's measured costs on a worker (the cache policy's input, cumulative): per table
    column read and decoded, per feature transformed, and whole splits (``split_s`` over
    ``rows``, with or without the cache)."""

    fingerprint: Annotated[str, Meta(max_length=64)]
    rows: Count
    split_s: Amount
    columns: Annotated[list[Cost], Meta(max_length=MAX_FEATURES)]
    features: Annotated[list[Cost], Meta(max_length=MAX_FEATURES)]


class WorkerStats(Record, omit_defaults=True):
    """Cumulative counters a worker reports with each heartbeat (the autoscaler's input)."""

    rows: Optional[Count] = None
    batches: Optional[Count] = None
    splits: Optional[Count] = None
    busy_s: Optional[Amount] = None
    cpu: Optional[Amount] = None  # 0..1
    mem: Optional[Amount] = None  # bytes
    time: Optional[Amount] = None
    capacity: Optional[Count] = None  # its buffer size
    ahead: Optional[Count] = None  # pieces held for a prefetched next epoch
    held_bytes: Optional[Count] = None  # bytes of the transformed splits it holds
    ahead_bytes: Optional[Count] = None  # of those, splits of a next epoch read ahead
    budget_bytes: Optional[Count] = None  # its --buffer-bytes
    split: Optional[ProducingSplit] = None  # while producing
    job: Optional[Id] = None  # the job (spec fingerprint) of that split
    io: Optional[IOCounters] = None
    discarded: Optional[Discarded] = None
    refused: Optional[Count] = None  # sealed credit refused (replayed, reordered, altered, out of bounds)
    cache: Optional[CacheStats] = None
    shared: Optional[SharedBlockStats] = None  # its memo of blocks shared between jobs
    costs: Optional[Annotated[list[JobCosts], Meta(max_length=16)]] = None  # the jobs it produced for lately


class ClientStats(Record, omit_defaults=True):
    """Cumulative counters a client reports with each heartbeat."""

    wait_s: Optional[Amount] = None  # blocked mid-epoch
    starved_s: Optional[Amount] = None  # the part of wait_s while no worker held a piece for the rank
    epoch_start_s: Optional[Amount] = None  # waiting for an epoch's first batch
    batches: Optional[Count] = None
    rows: Optional[Count] = None
    queued: Optional[Count] = None
    time: Optional[Amount] = None
    since_batch_s: Optional[Amount] = None  # since the training loop last got a batch
    wait_le: Optional[Annotated[list[Amount], Meta(max_length=MAX_BUCKETS)]] = None  # histogram bounds
    wait_buckets: Optional[Annotated[list[Count], Meta(max_length=MAX_BUCKETS)]] = None
    refused: Optional[Count] = None  # sealed batches refused (replayed, reordered, altered, out of bounds)


# -- messages ---------------------------------------------------------------------------
class Message(Struct, tag_field="t", forbid_unknown_fields=True, kw_only=True):
    """A header: ``v`` (checked first) and ``t`` (the type's tag), then the type's fields."""

    DIRECTION: ClassVar[str] = ""
    v: int = PROTOCOL_VERSION


class WorkerRequest(Message):
    DIRECTION: ClassVar[str] = "worker → master"


class ClientRequest(Message):
    DIRECTION: ClassVar[str] = "client → master"


class MasterReply(Message):
    DIRECTION: ClassVar[str] = "master → worker / client"


class DataMessage(Message):
    DIRECTION: ClassVar[str] = "client ↔ worker"


class Register(WorkerRequest, tag="register"):
    """A worker with a compiled pipeline offers its data endpoint."""

    addr: Id  # tcp://HOST:PORT with a concrete host and a port in 1..65535
    pid: Count
    fingerprint: Id  # the job its pipeline is compiled for
    key: Key = ""  # its X25519 public key (made at process start), passed to clients in membership
    node: Node = ""  # the node it runs on (remoteloader-worker --node): ranks of that node get it first
    arena: Id = ""  # its arena socket's path (protocol/arena.py): clients on its host map batches there


class GetSpec(WorkerRequest, tag="get_spec"):
    """A job's spec and schema, to compile a pipeline."""

    fingerprint: Id = ""  # the job a split task named; "": the master's oldest job


class WorkerNamed(WorkerRequest):
    worker_id: Id
    token: Id  # registered.token


class Heartbeat(WorkerNamed, tag="heartbeat"):
    """Liveness and statistics."""

    buffered: Count  # pieces in its buffer
    stats: Optional[WorkerStats] = None


class GetSplit(WorkerNamed, tag="get_split"):
    """The next split to produce."""

    avoid_ranks: Annotated[list[Count], Meta(max_length=MAX_LIST)] = []  # their share of the buffer is full
    # The same, by client session: to a master of several jobs, whose jobs' ranks share numbers.
    avoid_sessions: Annotated[list[Id], Meta(max_length=MAX_LIST)] = []
    read_ahead: bool = True  # it has room for a split of a next epoch read ahead (within its --buffer-bytes)


class SplitsReleased(WorkerNamed, tag="splits_released"):
    """Splits the worker gives back; they are pending again."""

    splits: Annotated[list[SplitRef], Meta(max_length=MAX_RELEASED)]
    reason: Id  # a discard reason
    job: Id = ""  # the splits' job's spec fingerprint (the split tasks'); "": the master's only job


class SplitProduced(WorkerNamed, tag="split_produced"):
    """Every piece of the split is in the worker's buffer."""

    epoch: Count
    split_id: Count
    job: Id = ""  # its job's spec fingerprint (the split task's); "": the master's only job


class SplitFailed(WorkerNamed, tag="split_failed"):
    """The split could not be produced."""

    epoch: Count
    split_id: Count
    error: Text  # names file, split and cause
    job: Id = ""  # its job's spec fingerprint (the split task's); "": the master's only job


class Drain(WorkerNamed, tag="drain"):
    """The worker got SIGTERM: no new split; it leaves when told stop."""


class Bye(WorkerNamed, tag="bye"):
    """The worker leaves now; its unfinished splits are re-queued."""


class Hello(ClientRequest, tag="hello"):
    """A loader of one rank joins: the master issues a session."""

    rank: Count
    world_size: Count
    spec: dict[str, Any]  # validated by DatasetSpec.from_dict
    fingerprint: Id
    key: Key = ""  # the session's X25519 public key: welcome.token signs it with the session
    node: Node = ""  # the node this rank runs on: the master gives it the workers of that node first
    job: JobName = ""  # the job's name: loaders of one spec and name are one job (a shared fleet's; "": unnamed)


class SessionRequest(ClientRequest):
    session: Id


class StartEpoch(SessionRequest, tag="start_epoch"):
    """A run of an epoch; a resumed client says what it already consumed."""

    epoch: Count
    consumed: Annotated[list[Ack], Meta(max_length=MAX_LIST)] = []
    done: Annotated[list[DoneRange], Meta(max_length=MAX_LIST)] = []  # rows consumed before an elastic resume


class ClientHeartbeat(SessionRequest, tag="client_heartbeat"):
    """Acks of the run ``seq`` (others are ignored) and statistics."""

    seq: Count
    acks: Annotated[list[Ack], Meta(max_length=MAX_LIST)]
    stats: Optional[ClientStats] = None


class FinishEpoch(SessionRequest, tag="finish_epoch"):
    """Every batch of the run was delivered."""

    seq: Count


class Goodbye(SessionRequest, tag="goodbye"):
    """The loader closed: the master forgets the session now."""


class Status(ClientRequest, tag="status"):
    """What ``remoteloader status --json`` prints."""

    history: bool = False  # the run over time too (the reply's `history`: `remoteloader report`)


class Registered(MasterReply, tag="registered"):
    """Answers register."""

    worker_id: Id
    heartbeat_interval: Amount
    fingerprint: Id  # the master's job: another one than the worker's means fetch the spec again
    token: Id  # HMAC of the worker id: every request naming the worker carries it
    verify_key: Id  # the master's Ed25519 public key (hex): verifies client tokens
    max_jobs: Count = 1  # jobs the master holds at once: above 1, split tasks may name any job (compile it)


class Spec(MasterReply, tag="spec"):
    """Answers get_spec."""

    spec: dict[str, Any]
    schema: dict[str, Any]
    fingerprint: Id
    split_bytes: Optional[Count] = None  # estimated transformed bytes of the job's largest split (nil: unknown)


class HeartbeatOk(MasterReply, tag="heartbeat_ok"):
    """Answers heartbeat."""

    state: WorkerState
    # Live sessions of the ranks it serves; left out: the worker keeps what it knows.
    sessions: Optional[Annotated[list[Id], Meta(max_length=MAX_LIST)]] = None
    # The master process (as membership.master): when it changes, the worker gives up any
    # request the previous process never answered.
    master: Id = ""


class Split(MasterReply, tag="split"):
    """Answers get_split: a split task."""

    split: SplitTaskRecord


class NoSplit(MasterReply, tag="no_split"):
    """Answers get_split: nothing to do now."""

    retry_ms: Count
    reason: Id


class Welcome(MasterReply, tag="welcome"):
    """Answers hello."""

    session: Id
    token: Id  # the master's signature of the session and hello.key: sent in every credit
    job: JobInfo


class Epoch(MasterReply, tag="epoch"):
    """Answers start_epoch: the run's number and this rank's splits."""

    epoch: Count
    seq: Count
    splits: Annotated[list[EpochSplitInfo], Meta(max_length=MAX_LIST)]


class Membership(MasterReply, tag="membership"):
    """Answers client_heartbeat: the partition now, failed splits, the master process."""

    workers: Annotated[list[WorkerAddr], Meta(max_length=MAX_LIST)]
    errors: Annotated[list[SplitError], Meta(max_length=MAX_LIST)]
    master: Id = ""
    # Deterministic order: which worker holds each of the run's splits in flight, [split id,
    # worker id], so the client keeps credit at the worker holding the head of its schedule.
    holders: Annotated[list[SplitHolder], Meta(max_length=MAX_LIST)] = []


class Ok(MasterReply, tag="ok"):
    """Done."""


class Error(MasterReply, tag="error"):
    """The request was refused."""

    message: Text
    code: Optional[ErrorCode] = None


class StatusReply(MasterReply, tag="status_reply"):
    """Answers status."""

    status: dict[str, Any]


class Credit(DataMessage, tag="credit"):
    """Running totals of pieces and bytes granted for a run."""

    session: Id
    token: Id  # the session's welcome.token
    seq: Count
    pieces: Count
    bytes: Count
    key: Key = ""  # the session's hello.key (the token signs it)
    gen: Optional[Gen] = None  # sealed (cluster keys): the key generation; one data frame, the tag
    nonce: Optional[Nonce] = None  # sealed: the counter of the tag
    arena: Optional[Id] = None  # the worker's arena this client maps (arena_offer.arena): batches may lie there


class Batch(DataMessage, tag="batch"):
    """A run of consecutive pieces of one split; one data frame per tensor."""

    session: Id
    seq: Count
    split_id: Count
    piece: Count  # the first piece of the run
    rows: Annotated[list[Annotated[int, Meta(ge=1, le=MAX_FRAME_BYTES)]], Meta(min_length=1, max_length=MAX_PIECES)]
    held: Count  # pieces of the run the worker still holds after this message
    tensors: Annotated[list[TensorDesc], Meta(max_length=64)]
    gen: Optional[Gen] = None  # sealed (cluster keys): the key generation
    nonce: Optional[Nonce] = None  # sealed: the counter of the first frame; frame i has nonce + i
    arena: Optional[ArenaSlice] = None  # the tensors lie in the client's arena there; no data frames

    def __getitem__(self, name: str) -> Any:
        # wire.unpack_pieces (issue 24's jagged-layout work owns it) reads the header as a map.
        return getattr(self, name)


class ArenaMessage(Message):
    DIRECTION: ClassVar[str] = "client ↔ worker, on the arena socket"


class ArenaOffer(ArenaMessage, tag="arena_offer"):
    """A worker's answer to a connection on its arena socket (``<data socket path>.arena``,
    one host only): a shared-memory file of ``bytes`` (its descriptor passed with this
    message, SCM_RIGHTS) that this worker writes this client's batches into, named ``arena``."""

    arena: Id
    bytes: Annotated[int, Meta(ge=1, le=1 << 40)]


class ArenaRelease(ArenaMessage, tag="arena_release"):
    """Regions of the arena (``arena_slice.offset`` of batches received) the client no
    longer reads: the worker may write them again."""

    offsets: Annotated[list[Count], Meta(max_length=MAX_ARENA_RELEASES)]


MESSAGE_TYPES: tuple[type[Message], ...] = (
    Register, GetSpec, Heartbeat, GetSplit, SplitsReleased, SplitProduced, SplitFailed, Drain, Bye,
    Hello, StartEpoch, ClientHeartbeat, FinishEpoch, Goodbye, Status,
    Registered, Spec, HeartbeatOk, Split, NoSplit, Welcome, Epoch, Membership, Ok, Error, StatusReply,
    Credit, Batch, ArenaOffer, ArenaRelease)
AnyMessage = Union[MESSAGE_TYPES]  # type: ignore[valid-type]
RECORD_TYPES: tuple[type[Record], ...] = (
    Ack, DoneRange, SplitRef, EpochSplitInfo, SplitHolder, WorkerAddr, SplitError, JobInfo, SplitTaskRecord, FileRecord,
    UnitRecord, TensorDesc, CacheDirective, CacheStats, SharedBlockStats, Cost, JobCosts, WorkerStats, ProducingSplit,
    IOCounters, Discarded, ClientStats, ArenaSlice)
MASTER_REQUESTS = frozenset(c.__struct_config__.tag for c in MESSAGE_TYPES
                            if issubclass(c, (WorkerRequest, ClientRequest)))


def tag(message: Message) -> str:
    return message.__struct_config__.tag


def from_fields(t: str, fields: dict[str, Any]) -> Message:
    """The message of type ``t`` from plain fields, validated like a received one (for
    tests and tools that write messages as maps)."""
    return msgspec.convert({"t": t, **fields}, AnyMessage)
