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
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from .batch import Batch, concat_rows
from ..core.plan import pieces_of


@dataclass
class Contribution:
    split_id: int
    piece: int
    stop_row: int  # rows [.., stop_row) of the piece are consumed once the batch is
    last_of_piece: bool


@dataclass
class Ready:
    batch: Batch
    parts: list[Contribution]


@dataclass
class SplitCursor:
    rows: int
    pieces: int
    next_piece: int = 0  # next piece index accepted from the wire
    consumed_pieces: int = 0
    consumed_rows_in_piece: int = 0  # rows of piece `consumed_pieces` already consumed (a tail)
    skipped: bool = False


@dataclass
class _Tail:
    split_id: int
    piece: int
    batch: Batch
    start: int  # first row not yet used


class EpochAssembler:
    def __init__(self, splits: list[tuple[int, int]], batch_size: int, drop_last: bool,
                 consumed: Optional[dict[int, tuple[int, int]]] = None) -> None:
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.cursors = {sid: SplitCursor(rows, pieces_of(rows, batch_size)) for sid, rows in splits}
        self.expected_rows = sum(rows for _, rows in splits)
        self.received_rows = 0
        for sid, (pieces, rows_in_piece) in (consumed or {}).items():
            c = self.cursors[sid]
            c.consumed_pieces, c.consumed_rows_in_piece, c.next_piece = pieces, rows_in_piece, pieces
            self.received_rows += min(c.rows, pieces * batch_size + rows_in_piece)
        self._tails: deque[_Tail] = deque()
        self._tail_rows = 0
        self._ready: deque[Ready] = deque()
        self._final_emitted = False
        self.dirty: set[int] = set()  # splits whose consumed count changed since the last ack

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
        if start == 0 and len(batch) == self.batch_size:
            self._ready.append(Ready(batch, [Contribution(split_id, piece, len(batch), True)]))
            return
        self._tails.append(_Tail(split_id, piece, batch, start))
        self._tail_rows += len(batch) - start
        while self._tail_rows >= self.batch_size:
            self._ready.append(self._cut(self.batch_size))

    def skip_split(self, split_id: int) -> None:
        """A split quarantined by ``on_error: skip``: its missing rows are no longer expected."""
        c = self.cursors.get(split_id)
        if c is None or c.skipped:
            return
        c.skipped = True
        delivered = min(c.rows, c.next_piece * self.batch_size)
        self.expected_rows -= c.rows - delivered

    # -- output ---------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self.received_rows >= self.expected_rows

    def next_ready(self) -> Optional[Ready]:
        if self._ready:
            return self._ready.popleft()
        if self.complete and self._tail_rows and not self._final_emitted:
            self._final_emitted = True
            final = self._cut(self._tail_rows)
            if not self.drop_last:
                return final
            self.consume(final)  # dropped rows count as used, so the epoch can close
        return None

    @property
    def ready_count(self) -> int:
        """Batches assembled and waiting for the training loop (the client's queue depth)."""
        return len(self._ready)

    @property
    def exhausted(self) -> bool:
        return self.complete and not self._ready and not self._tail_rows

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
        pieces, parts = [], []
        while rows:
            tail = self._tails[0]
            take = min(rows, len(tail.batch) - tail.start)
            stop = tail.start + take
            pieces.append((tail.batch, tail.start, stop))
            parts.append(Contribution(tail.split_id, tail.piece, stop, stop == len(tail.batch)))
            rows -= take
            self._tail_rows -= take
            if stop == len(tail.batch):
                self._tails.popleft()
            else:
                tail.start = stop
        return Ready(concat_rows(pieces), parts)

    # -- checkpoint and acks ----------------------------------------------------------------
    def consumed_state(self) -> dict[int, tuple[int, int]]:
        return {sid: (c.consumed_pieces, c.consumed_rows_in_piece) for sid, c in self.cursors.items()
                if c.consumed_pieces or c.consumed_rows_in_piece}

    def take_acks(self) -> list[list[int]]:
        acks = [[sid, self.cursors[sid].consumed_pieces] for sid in sorted(self.dirty)]
        self.dirty.clear()
        return acks
