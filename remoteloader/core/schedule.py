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

from .plan import pieces_of

PADDING_GROUP = 1 << 62  # after every cycle
OrderKey = tuple[int, int, int]


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
