"""A rank's deterministic batch order (spec ``order: {deterministic: true, cycle: K}``).

The rank's splits, in plan order, are taken ``K`` at a time (a **cycle**); within a cycle
the order is one piece of each split in turn (piece 0 of every split of the cycle, then
piece 1 of each split that has one, ...), and cycles follow each other. Padding splits
(``even_batches: pad``) come after every cycle. So piece ``i`` of the split at position
``j`` of the rank's plan has the key ``(j // K, i, j % K)`` and the rank's schedule is its
pieces sorted by key: a pure function of the plan, hence of the table, spec, seed, epoch
and world size, and never of the number of workers, their speed or their failures.

The key is closed-form on purpose: a worker orders what it sends by it (``Piece.order``)
from the task alone, the client assembles by it, and a later global-batch plan can key
pieces the same way over the whole job rather than per rank (guarantees.md).

Tail pieces (a split's short last piece) are merged into full batches in schedule order,
so which rows share a merged batch is fixed too; the epoch's one short batch comes last.
"""
from __future__ import annotations

from typing import Sequence

PADDING_GROUP = 1 << 62  # after every cycle
OrderKey = tuple[int, int, int]


def pieces_of(rows: int, batch_size: int) -> int:
    """A split's rows travel as full batches plus one short tail piece."""
    return -(-rows // batch_size)


def split_order(position: int, cycle: int, padding: bool) -> tuple[int, int]:
    """(cycle group, slot) of the split at ``position`` in its rank's plan: what a task carries.
    Padding splits share one group after all cycles, ordered by position (keys stay unique)."""
    return (PADDING_GROUP, position) if padding else (position // cycle, position % cycle)


def piece_key(order: Sequence[int], piece: int) -> OrderKey:
    """Where piece ``piece`` of a split with ``split_order`` ``order`` comes in its rank's schedule."""
    group, slot = order
    return group, piece, slot


def rank_schedule(splits: Sequence[tuple[int, int, bool]], batch_size: int, cycle: int) -> list[tuple[int, int]]:
    """The rank's pieces, ``(split id, piece)``, in schedule order; ``splits`` are
    ``(split id, rows, padding)`` in plan order."""
    keyed = []
    for position, (split_id, rows, padding) in enumerate(splits):
        order = split_order(position, cycle, padding)
        keyed.extend((piece_key(order, i), split_id, i) for i in range(pieces_of(rows, batch_size)))
    keyed.sort()
    return [(split_id, piece) for _, split_id, piece in keyed]


# -- batches that mix splits (spec ``mix_splits: K``) ------------------------------------------
#
# The rank's rows, its splits in plan order taken as one sequence, are cut into K contiguous
# **lanes**; the plan cuts splits at lane boundaries (``core.plan.plan_epoch``), so each split
# lies in one lane. Every full batch takes ``share(j)`` rows from lane j, in lane order, so
# its rows come from K places of the epoch's shuffled order at once; the epoch's one short
# batch takes what is left of every lane. Lanes are sized to make that exact: lane j holds
# ``full * share(j) + rest(j)`` rows, ``full`` the rank's full batches and ``rest(j)`` lane
# j's part of the short one, so no full batch ever lacks a lane.
#
# A piece (``batch_size`` rows of a split, as workers cut them) starting at row ``o`` of its
# lane is first needed by batch ``o // share(j)``: its key ``(o // share(j), j, o)`` orders
# the rank's pieces as the batches use them. Like the cycle's key it is closed-form, from what
# the split's task carries (``lane_of``: lane, offset, share), so a worker sends its pieces
# in the order the client takes them.

LaneOrder = tuple[int, int, int]  # (lane, row of the lane the split starts at, the lane's share of a batch)


def proportional(total: int, parts: int) -> tuple[int, ...]:
    """``total`` rows shared out over ``parts`` in order: part j gets
    ``floor(total * (j + 1) / parts) - floor(total * j / parts)``, so shares differ by at
    most one row, the larger ones later, and add up to ``total``."""
    return tuple(total * (j + 1) // parts - total * j // parts for j in range(parts))


def lane_rows(rows: int, batch_size: int, lanes: int) -> tuple[int, ...]:
    """The rows of each of ``lanes`` lanes over a rank's ``rows`` rows."""
    full, rest = divmod(rows, batch_size)
    return tuple(full * s + r for s, r in zip(proportional(batch_size, lanes), proportional(rest, lanes)))


def lane_bounds(rows: int, batch_size: int, lanes: int) -> list[int]:
    """Where each lane starts in the rank's row sequence, and where the last one ends."""
    bounds = [0]
    for n in lane_rows(rows, batch_size, lanes):
        bounds.append(bounds[-1] + n)
    return bounds


def lane_of(split_rows: Sequence[int], batch_size: int, lanes: int) -> list[LaneOrder]:
    """(lane, offset in the lane, the lane's share) of each of a rank's splits, given in plan
    order by their rows. A split across a lane boundary is a plan not cut for these lanes."""
    bounds = lane_bounds(sum(split_rows), batch_size, lanes)
    shares = proportional(batch_size, lanes)
    out, start, lane = [], 0, 0
    for rows in split_rows:
        while lane < lanes - 1 and start >= bounds[lane + 1]:
            lane += 1
        if start + rows > bounds[lane + 1]:
            raise ValueError(f"a split of rows [{start}, {start + rows}) of the rank's plan crosses the boundary of "
                             f"lane {lane} at row {bounds[lane + 1]}: the plan is not cut for mix_splits {lanes}")
        out.append((lane, start - bounds[lane], shares[lane]))
        start += rows
    return out


def lane_piece_key(order: Sequence[int], piece: int, batch_size: int) -> OrderKey:
    """Where piece ``piece`` of a split with ``lane_of`` ``order`` comes in its rank's schedule."""
    lane, offset, share = order
    row = offset + piece * batch_size
    return row // share, lane, row


def lane_schedule(splits: Sequence[tuple[int, int]], batch_size: int, lanes: int) -> list[tuple[int, int]]:
    """The rank's pieces, ``(split id, piece)``, in the order its mixed batches use them;
    ``splits`` are ``(split id, rows)`` in plan order."""
    keyed = []
    for (split_id, rows), order in zip(splits, lane_of([rows for _, rows in splits], batch_size, lanes)):
        keyed.extend((lane_piece_key(order, i, batch_size), split_id, i) for i in range(pieces_of(rows, batch_size)))
    keyed.sort()
    return [(split_id, piece) for _, split_id, piece in keyed]
