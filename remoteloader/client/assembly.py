"""Turning the pieces of one rank's epoch into batches, exactly once.

Workers send each split as full batches plus one short tail piece. ``EpochAssembler``

* accepts piece ``i`` of a split only when it is the next one expected, so a piece
  re-sent after a worker failure (or still in flight from a dead worker) is dropped;
* passes full pieces straight through (no copy) and merges tails into full batches;
* knows when the epoch is complete (it counts rows against the plan), and emits the
  one short batch of the epoch at the very end (or drops it with ``drop_last``);
* records what the training loop has consumed: per split, whole pieces plus the rows
  already taken from a partly used tail. That is the checkpoint state and the source
  of the acks that let the master retire splits.

With a ``cycle`` (spec ``order: {deterministic: true}``), pieces are routed in the rank's
schedule order (``core/schedule.py``), not in arrival order: a piece that arrives ahead of
the schedule waits (``waiting``) until every piece before it has been routed. What the
training loop has consumed is then always a prefix of the schedule, so the per-split
state above identifies the position exactly, and a resumed run (the schedule less the
consumed pieces, a partly used tail re-added at its place) yields the same batches.

With ``mix_splits`` K > 1 (batches that mix splits), pieces are routed the same way, in the
schedule of the rank's K lanes, each into its lane's queue (``Lanes``), and every batch is
cut from all K queues in their shares: a piece serves about K batches, and the per-split
state (whole pieces, rows of a partly used one) still says exactly what was consumed.

With tables mixed by weight (spec ``tables``, ``core/mix.py``) each table is a lane, the
splits' lane keys come with the plan (``lanes``), and a batch's rows of each table are the
plan's for that batch (``BatchCounts``): the same machinery, with shares that change where a
table runs out.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Optional, Sequence

from .batch import Batch, concat_rows
from ..core.mix import BatchCounts
from ..core.plan import pieces_of
from ..core.schedule import lane_of, lane_piece_key, lane_rows, lane_schedule, proportional, rank_schedule


@dataclass(slots=True)
class Contribution:
    split_id: int
    piece: int
    stop_row: int  # rows [.., stop_row) of the piece are consumed once the batch is
    last_of_piece: bool


class Ready:
    """A batch the training loop will take next (in the assembler's queue order): the rows of
    received pieces it is made of and where they end. Its ``batch`` is built when first read:
    a whole piece as it is (no copy), rows of several merged into new tensors; a stager (a
    node after the assembler) builds it straight into pinned memory instead."""

    __slots__ = ("pieces", "parts", "ticket", "_batch")

    def __init__(self, pieces: list[tuple[Batch, int, int]], parts: list[Contribution]) -> None:
        self.pieces, self.parts = pieces, parts
        self.ticket: Any = None  # the stager's job for it, when one was submitted
        self._batch: Optional[Batch] = None

    @property
    def whole(self) -> bool:
        """One received piece, all of it: handed out as it is."""
        if len(self.pieces) != 1:
            return False
        batch, start, stop = self.pieces[0]
        return start == 0 and stop == len(batch)

    @property
    def batch(self) -> Batch:
        if self._batch is None:
            self._batch = self.pieces[0][0] if self.whole else concat_rows(self.pieces)
        return self._batch

    def __len__(self) -> int:
        return sum(stop - start for _, start, stop in self.pieces)


@dataclass
class SplitCursor:
    rows: int
    pieces: int
    next_piece: int = 0  # next piece index accepted from the wire
    consumed_pieces: int = 0
    consumed_rows_in_piece: int = 0  # rows of piece `consumed_pieces` already consumed (a tail)
    skipped: bool = False


@dataclass(slots=True)
class _Tail:
    split_id: int
    piece: int
    batch: Batch
    start: int  # first row not yet used
    stop: int  # the piece's rows (kept: a mixed batch's piece is cut K times)


class RowQueue:
    """Rows of received pieces waiting to be cut into batches, in the order they were routed:
    tails (and partly consumed pieces) merged into full batches, or one lane's rows of mixed
    batches. Rows leave from the front as (piece rows, where they end) with no copy."""

    def __init__(self) -> None:
        self._tails: deque[_Tail] = deque()
        self.rows = 0

    def push(self, split_id: int, piece: int, batch: Batch, start: int) -> int:
        """Queue rows ``[start, ..)`` of a piece; returns how many."""
        rows = len(batch)
        self._tails.append(_Tail(split_id, piece, batch, start, rows))
        self.rows += rows - start
        return rows - start

    def take(self, rows: int, pieces: list, parts: list[Contribution]) -> None:
        """Move the first ``rows`` rows into ``pieces`` (``(batch, start, stop)``) and ``parts``."""
        self.rows -= rows
        while rows:
            tail = self._tails[0]
            stop = min(tail.start + rows, tail.stop)
            pieces.append((tail.batch, tail.start, stop))
            last = stop == tail.stop
            parts.append(Contribution(tail.split_id, tail.piece, stop, last))
            rows -= stop - tail.start
            if last:
                self._tails.popleft()
            else:
                tail.start = stop


class Lanes:
    """Where a mixed batch's rows come from (spec ``mix_splits: K``, ``core/schedule.py``):
    K row queues, one per lane, and each lane's share of a batch. A batch takes its share
    from every lane in lane order; a lane whose rows have all been received and that holds
    less than its share (only with a split skipped, ``on_error: skip``) gives what it holds,
    and the other lanes, in order, make up the rest. The proportions are the mechanism's input, so
    sources other than a rank's lanes can be mixed the same way."""

    def __init__(self, shares: Sequence[int], coming: Sequence[int],
                 per_batch: Optional[Callable[[int], Sequence[int]]] = None, first_batch: int = 0) -> None:
        """``coming``: the rows each lane is still to receive; ``per_batch``: batch b's rows of
        each lane where they change from batch to batch (tables mixed by weight), ``shares``
        then give only the batch size; ``first_batch``: the number of the next batch cut."""
        self.shares = tuple(shares)
        self.batch_size = sum(self.shares)
        self.queues = [RowQueue() for _ in self.shares]
        self.coming = list(coming)
        self.per_batch, self.batch = per_batch, first_batch

    def _shares(self) -> Sequence[int]:
        return self.shares if self.per_batch is None else self.per_batch(self.batch)

    @property
    def rows(self) -> int:
        return sum(q.rows for q in self.queues)

    def push(self, lane: int, split_id: int, piece: int, batch: Batch, start: int) -> None:
        self.coming[lane] -= self.queues[lane].push(split_id, piece, batch, start)

    def forgo(self, lane: int, rows: int) -> None:
        """``rows`` of the lane will never come (a skipped split)."""
        self.coming[lane] -= rows

    def full(self) -> bool:
        """Whether the next full batch can be cut: every lane holds its share or all it will."""
        shares = self._shares()
        return sum(shares) == self.batch_size and self.rows >= self.batch_size and all(
            q.rows >= share or not coming for q, share, coming in zip(self.queues, shares, self.coming))

    def cut(self) -> Ready:
        """The next full batch: each lane's share (or what it holds), then what is missing from
        the lanes in order."""
        pieces: list = []
        parts: list[Contribution] = []
        short = self.batch_size
        shares = self._shares()
        self.batch += 1
        for q, share in zip(self.queues, shares):
            n = min(share, q.rows)
            if n:
                q.take(n, pieces, parts)
                short -= n
        for q in self.queues:
            n = min(short, q.rows)
            if n:
                q.take(n, pieces, parts)
                short -= n
        return Ready(pieces, parts)

    def rest(self) -> Ready:
        """Every row left, lane by lane: the epoch's short last batch."""
        pieces: list = []
        parts: list[Contribution] = []
        for q in self.queues:
            if q.rows:
                q.take(q.rows, pieces, parts)
        return Ready(pieces, parts)


class EpochAssembler:
    def __init__(self, splits: list[tuple[int, int]], batch_size: int, drop_last: bool,
                 consumed: Optional[dict[int, tuple[int, int]]] = None, cycle: Optional[int] = None,
                 padding: Collection[int] = (), mix_splits: int = 1,
                 lanes: Optional[Mapping[int, Sequence[int]]] = None) -> None:
        """``splits``: (split id, rows) in plan order; ``padding``: the ids of padding splits;
        ``cycle``: route in the deterministic schedule's order (None: in arrival order);
        ``mix_splits`` > 1: batches mix the rank's lanes, routed in their schedule's order
        (``cycle`` is then unused); ``lanes``: tables mixed by weight, each split's lane key
        (table, offset, rows a batch) as planned (``core/mix.py``; ``cycle`` is then unused)."""
        # Called with each batch as it joins the queue, so in the order the training loop takes
        # them (a stager copies them in that order: see staging.py).
        self.on_ready: Optional[Callable[[Ready], None]] = None
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._splits, self._cycle, self._padding = list(splits), cycle, set(padding)
        self._mix_splits = mix_splits
        self._table_lanes = dict(lanes) if lanes else None
        self.dirty: set[int] = set()  # splits whose consumed count changed since the last ack
        self.reset({"consumed": [[sid, p, r] for sid, (p, r) in consumed.items()]} if consumed else None)

    # -- node state ---------------------------------------------------------------------------
    def get_state(self) -> dict:
        """What the training loop consumed, ``{"consumed": [[split id, pieces, tail rows], ...]}``.
        Pieces received and not consumed are not in it: after ``reset`` they are expected
        again (the master has them produced again), so nothing is lost or repeated."""
        return {"consumed": [[sid, p, r] for sid, (p, r) in sorted(self.consumed_state().items())]}

    def reset(self, state: Optional[dict] = None) -> None:
        """Back to ``state`` (``get_state()``), or to the epoch's start: every piece from the
        first one not consumed is expected again."""
        batch_size = self.batch_size
        self.cursors = {sid: SplitCursor(rows, pieces_of(rows, batch_size)) for sid, rows in self._splits}
        self.expected_rows = sum(rows for _, rows in self._splits)
        self.received_rows = 0
        for sid, pieces, rows_in_piece in (state or {}).get("consumed", ()):
            c = self.cursors[sid]
            c.consumed_pieces, c.consumed_rows_in_piece, c.next_piece = pieces, rows_in_piece, pieces
            self.received_rows += min(c.rows, pieces * batch_size + rows_in_piece)
        self._tails = RowQueue()  # without lanes: tails waiting to be merged
        self._lanes: Optional[Lanes] = None
        self._lane: dict[int, int] = {}  # split id -> its lane
        self._ready: deque[Ready] = deque()
        self._final_emitted = False
        # Deterministic order: the schedule's pieces not yet routed, and those that arrived early.
        self._schedule: Optional[deque] = None
        self._waiting: dict[tuple[int, int], Batch] = {}
        if self._table_lanes is not None:
            self._start_table_lanes()
            keys = self._table_lanes
            order = sorted(((sid, p) for sid, rows in self._splits for p in range(pieces_of(rows, batch_size))),
                           key=lambda sp: lane_piece_key(keys[sp[0]], sp[1], batch_size))
        elif self._mix_splits > 1:
            self._start_lanes()
            order = lane_schedule(self._splits, batch_size, self._mix_splits)
        elif self._cycle is not None:
            order = rank_schedule([(sid, rows, sid in self._padding) for sid, rows in self._splits], batch_size,
                                  self._cycle)
        if self._table_lanes is not None or self._mix_splits > 1 or self._cycle is not None:
            self._schedule = deque((sid, p) for sid, p in order if p >= self.cursors[sid].consumed_pieces)

    def _start_lanes(self) -> None:
        """Each split's lane, and what each lane is still to receive. Every lane has given the
        same number of batches its share (consumption is a prefix of the schedule), so a
        position of another plan or another mix_splits is refused here."""
        batch_size, mix = self.batch_size, self._mix_splits
        coming = list(lane_rows(self.expected_rows, batch_size, mix))
        shares = proportional(batch_size, mix)
        for (sid, _), (lane, _, _) in zip(self._splits, lane_of([rows for _, rows in self._splits], batch_size, mix)):
            self._lane[sid] = lane
            c = self.cursors[sid]
            coming[lane] -= min(c.rows, c.consumed_pieces * batch_size + c.consumed_rows_in_piece)
        used = [lane_total - left for lane_total, left in zip(lane_rows(self.expected_rows, batch_size, mix), coming)]
        batches = {(u + share - 1) // share for u, share in zip(used, shares)}
        if len(batches) > 1 and any(coming):
            raise ValueError(f"the consumed rows per lane ({used}) are not whole batches' shares {shares} of "
                             f"mix_splits {mix}: the position is not of this plan's lanes")
        self._lanes = Lanes(shares, coming)

    def _start_table_lanes(self) -> None:
        """Each table's lane and what it is still to receive, and the number of the next batch:
        consumption is a prefix of the schedule, so whole batches of the plan's rows of each
        table were consumed; a position of another plan is refused here."""
        batch_size, keys = self.batch_size, self._table_lanes
        tables = 1 + max((key[0] for key in keys.values()), default=0)
        counts = BatchCounts([(keys[sid], rows) for sid, rows in self._splits], tables)
        coming, used = [0] * tables, [0] * tables
        for sid, rows in self._splits:
            table, c = keys[sid][0], self.cursors[sid]
            self._lane[sid] = table
            done = min(c.rows, c.consumed_pieces * batch_size + c.consumed_rows_in_piece)
            used[table] += done
            coming[table] += rows - done
        batches, rest = divmod(sum(used), batch_size)
        expected = [counts.rows_before(batches, t) for t in range(tables)]  # closed form: no loop over batches
        if any(coming) and (rest or expected != used):
            raise ValueError(f"the consumed rows per table ({used}) are not those of {batches} batches of this plan "
                             f"({expected}): the position is not of this plan's mix")
        self._lanes = Lanes(proportional(batch_size, tables), coming, counts.counts, batches)

    # -- input ---------------------------------------------------------------------------
    def wants(self, split_id: int, piece: int) -> bool:
        c = self.cursors.get(split_id)
        return c is not None and not c.skipped and piece == c.next_piece

    def add(self, split_id: int, piece: int, batch: Batch) -> None:
        """Take a piece that ``wants`` accepted."""
        c = self.cursors[split_id]
        c.next_piece += 1
        start = c.consumed_rows_in_piece if piece == c.consumed_pieces else 0  # after resume: rows already used
        self.received_rows += len(batch) - start
        if self._schedule is None:
            self._route(split_id, piece, batch, start)
            return
        self._waiting[split_id, piece] = batch
        self._advance()

    def _advance(self) -> None:
        """Route the schedule's pieces that have arrived, in order, up to the first missing one."""
        schedule = self._schedule
        while schedule:
            split_id, piece = schedule[0]
            batch = self._waiting.pop((split_id, piece), None)
            if batch is None:
                c = self.cursors[split_id]
                if c.skipped and piece >= c.next_piece:  # quarantined (on_error: skip): never coming
                    schedule.popleft()
                    continue
                return
            schedule.popleft()
            c = self.cursors[split_id]
            self._route(split_id, piece, batch, c.consumed_rows_in_piece if piece == c.consumed_pieces else 0)

    def _route(self, split_id: int, piece: int, batch: Batch, start: int) -> None:
        """A full piece is a batch of its own; a tail (or a partly consumed piece) waits to be
        merged. With lanes, a piece joins its lane, and batches are cut once every lane has its share."""
        if self._lanes is not None:
            self._lanes.push(self._lane[split_id], split_id, piece, batch, start)
            self._cut_mixed()
            return
        if start == 0 and len(batch) == self.batch_size:
            self._queue(Ready([(batch, 0, len(batch))], [Contribution(split_id, piece, len(batch), True)]))
            return
        self._tails.push(split_id, piece, batch, start)
        while self._tails.rows >= self.batch_size:
            self._queue(self._cut(self.batch_size))

    def _cut_mixed(self) -> None:
        while self._lanes.full():
            self._queue(self._lanes.cut())

    def _queue(self, ready: Ready) -> None:
        self._ready.append(ready)
        if self.on_ready is not None:
            self.on_ready(ready)

    @property
    def ordered(self) -> bool:
        """Whether pieces are routed in a deterministic schedule's order."""
        return self._schedule is not None

    @property
    def waiting(self) -> int:
        """Pieces that arrived ahead of the schedule (deterministic order) and wait here."""
        return len(self._waiting)

    @property
    def head(self) -> Optional[int]:
        """The split of the schedule's next piece (deterministic order); None otherwise or at the end."""
        return self._schedule[0][0] if self._schedule else None

    def skip_split(self, split_id: int) -> None:
        """A split quarantined by ``on_error: skip``: its missing rows are no longer expected."""
        c = self.cursors.get(split_id)
        if c is None or c.skipped:
            return
        c.skipped = True
        delivered = min(c.rows, c.next_piece * self.batch_size)
        self.expected_rows -= c.rows - delivered
        if self._lanes is not None:
            self._lanes.forgo(self._lane[split_id], c.rows - delivered)
        if self._schedule is not None:
            self._advance()
        if self._lanes is not None:
            self._cut_mixed()

    # -- output ---------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self.received_rows >= self.expected_rows

    def next_ready(self) -> Optional[Ready]:
        if self._ready:
            return self._ready.popleft()
        if self.complete and self._held_rows and not self._final_emitted:
            self._final_emitted = True
            final = self._lanes.rest() if self._lanes is not None else self._cut(self._tails.rows)
            if not self.drop_last:
                if self.on_ready is not None:
                    self.on_ready(final)
                return final
            self.consume(final)  # dropped rows count as used, so the epoch can close
        return None

    @property
    def ready_count(self) -> int:
        """Batches assembled and waiting for the training loop (the client's queue depth)."""
        return len(self._ready)

    @property
    def exhausted(self) -> bool:
        return self.complete and not self._ready and not self._held_rows and not self._waiting

    @property
    def _held_rows(self) -> int:
        """Rows received and routed, not yet cut into a batch."""
        return self._lanes.rows if self._lanes is not None else self._tails.rows

    def consume(self, ready: Ready) -> None:
        """The training loop has this batch: advance the consumed cursors."""
        for part in ready.parts:
            c = self.cursors[part.split_id]
            if part.last_of_piece:
                c.consumed_pieces, c.consumed_rows_in_piece = part.piece + 1, 0
            else:
                c.consumed_pieces, c.consumed_rows_in_piece = part.piece, part.stop_row
            self.dirty.add(part.split_id)

    def _cut(self, rows: int) -> Ready:
        pieces: list = []
        parts: list[Contribution] = []
        self._tails.take(rows, pieces, parts)
        return Ready(pieces, parts)

    # -- checkpoint and acks ----------------------------------------------------------------
    def consumed_state(self) -> dict[int, tuple[int, int]]:
        return {sid: (c.consumed_pieces, c.consumed_rows_in_piece) for sid, c in self.cursors.items()
                if c.consumed_pieces or c.consumed_rows_in_piece}

    def take_acks(self) -> list[list[int]]:
        acks = [[sid, self.cursors[sid].consumed_pieces] for sid in sorted(self.dirty)]
        self.dirty.clear()
        return acks
