"""Deterministic order in the assembler: whatever order pieces arrive in (one worker's
splits in sequence, several interleaved, duplicates after a failure), and from whatever
batch a run is resumed, a rank's batch sequence is the schedule's."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from remoteloader.client.assembly import EpochAssembler
from remoteloader.core.schedule import rank_schedule, split_order, piece_key
from tests.assembly_helpers import drain
from tests.test_assembly import pieces_for
from tests.conftest import examples

BATCH = 4


def sequence(split_rows, arrivals, cycle, padding=(), consumed=None, stop_after=None):
    """Row ids of each batch the assembler yields, and its consumed state when stopped."""
    a = EpochAssembler(list(enumerate(split_rows)), BATCH, False, consumed=consumed, cycle=cycle, padding=padding)
    return drain(a, arrivals, stop_after, state=lambda a: a.consumed_state())


def arrival_orders(pieces, rng, workers):
    """Pieces as ``workers`` workers would send them: each worker's splits in order, piece by
    piece, the workers' streams interleaved at random, with some pieces sent twice."""
    by_split = {}
    for sid, p, b in pieces:
        by_split.setdefault(sid, []).append((sid, p, b))
    streams = [[] for _ in range(workers)]
    for sid in sorted(by_split):
        streams[rng.randrange(workers)].extend(by_split[sid])
    out = []
    while any(streams):
        s = rng.choice([s for s in streams if s])
        item = s.pop(0)
        out.append(item)
        if rng.random() < 0.1:
            out.append(item)  # a re-sent duplicate
    return out


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(1, 11), min_size=1, max_size=9), st.integers(1, 5), st.integers(0, 1 << 30))
def test_the_sequence_is_the_schedules_whatever_the_arrival_order(split_rows, cycle, seed):
    rng = random.Random(seed)
    pieces = pieces_for(split_rows, BATCH)
    reference, _ = sequence(split_rows, sorted(pieces, key=lambda x: (split_order(x[0], cycle, False), x[1])), cycle)
    for workers in (1, 2, 4):
        got, _ = sequence(split_rows, arrival_orders(pieces, rng, workers), cycle)
        assert got == reference
    # Full pieces come in schedule order; every row exactly once.
    rows = [r for batch in reference for r in batch]
    assert sorted(rows) == list(range(sum(split_rows)))


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(1, 11), min_size=1, max_size=9), st.integers(1, 5), st.integers(0, 1 << 30))
def test_a_resumed_run_continues_the_same_sequence(split_rows, cycle, seed):
    rng = random.Random(seed)
    pieces = pieces_for(split_rows, BATCH)
    reference, _ = sequence(split_rows, arrival_orders(pieces, rng, 2), cycle)
    stop = rng.randrange(1, len(reference) + 1)
    first, state = sequence(split_rows, arrival_orders(pieces, rng, 3), cycle, stop_after=stop)
    # The new run is offered every piece again (the master re-produces from what was consumed).
    rest, _ = sequence(split_rows, arrival_orders(pieces, rng, 2), cycle, consumed=state)
    assert first + rest == reference


def test_the_schedule_interleaves_cycles_of_splits_and_puts_padding_last():
    # Splits 0..4 of 3, 1, 2, 2, 1 pieces; split 5 pads. Cycle 2: {0, 1}, then {2, 3}, then {4}.
    order = rank_schedule([(0, 12, False), (1, 4, False), (2, 8, False), (3, 7, False), (4, 2, False), (5, 1, True)],
                          BATCH, 2)
    assert order == [(0, 0), (1, 0), (0, 1), (0, 2), (2, 0), (3, 0), (2, 1), (3, 1), (4, 0), (5, 0)]
    assert piece_key(split_order(7, 4, False), 3) == (1, 3, 3)
