"""Batches that mix splits (spec ``mix_splits: K``), without processes: the plan's lanes,
the mixing mechanism (``Lanes``) alone, and the assembler building mixed batches whatever
the arrival order, resumed from its state, and with a split skipped; the spec key and the
positions that name it. The cluster-level checks are tests/test_mix_splits_cluster.py."""
from __future__ import annotations

import bisect
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remoteloader.client import resume
from remoteloader.client.assembly import EpochAssembler, Lanes
from remoteloader.core.plan import BaseSplit, EpochSplit, cut_into_lanes, plan_epoch
from remoteloader.core.schedule import lane_bounds, lane_of, lane_rows, lane_schedule, proportional
from remoteloader.spec import DatasetSpec, SpecError
from tests.conftest import examples, spec_dict
from tests.test_assembly import make_batch, pieces_for
from tests.assembly_helpers import drain
from tests.test_order_assembly import arrival_orders


def rank_plan(split_rows, batch_size, lanes):
    """A rank's splits of the given rows cut into its lanes, as ``plan_epoch`` cuts them."""
    splits = [EpochSplit(i, 0, i, 0, rows) for i, rows in enumerate(split_rows)]
    return [s.rows for s in cut_into_lanes(splits, 1, batch_size, lanes)]


def assemble(split_rows, batch_size, lanes, arrivals, consumed=None, stop_after=None, drop_last=False):
    """Row ids of each batch, and the assembler's state when stopped (or at the end)."""
    a = EpochAssembler(list(enumerate(split_rows)), batch_size, drop_last, consumed=consumed, mix_splits=lanes)
    return drain(a, arrivals, stop_after)


def test_shares_and_lanes_are_exact():
    assert proportional(10, 4) == (2, 3, 2, 3) and sum(proportional(4096, 3)) == 4096
    # 23 rows, batches of 10, 4 lanes: 2 full batches take (2, 3, 2, 3) each, the last 3 rows (0, 1, 1, 1).
    assert lane_rows(23, 10, 4) == (4, 7, 5, 7)
    assert lane_bounds(23, 10, 4) == [0, 4, 11, 16, 23]
    assert lane_of([4, 7, 3, 2, 7], 10, 4) == [(0, 0, 2), (1, 0, 3), (2, 0, 2), (2, 3, 2), (3, 0, 3)]
    with pytest.raises(ValueError, match="crosses the boundary of lane 0"):
        lane_of([5, 18], 10, 4)


@settings(max_examples=examples(80), deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=12), st.integers(1, 3), st.integers(1, 16),
       st.integers(1, 6), st.sampled_from(["pad", "drop", "off"]), st.booleans(), st.booleans())
def test_the_plan_cuts_each_ranks_rows_into_lanes_and_changes_no_row(rows, world, batch, lanes, even, shuffle,
                                                                     drop_last):
    lanes = min(lanes, batch)
    base = [BaseSplit(i, 0, 0, 1, r, r, 0) for i, r in enumerate(rows)]
    whole = plan_epoch(base, 3, 7, shuffle, world, batch, drop_last, even)
    mixed = plan_epoch(base, 3, 7, shuffle, world, batch, drop_last, even, mix_splits=lanes)
    assert [s.id for s in mixed] == list(range(len(mixed)))
    def rows_of(plan, rank):
        return [(s.base, r, s.padding) for s in plan if s.rank == rank for r in range(s.row_lo, s.row_hi)]

    for rank in range(world):
        assert rows_of(mixed, rank) == rows_of(whole, rank)  # the same rows in the same order, only cut
        mine = [s.rows for s in mixed if s.rank == rank]
        lane_of(mine, batch, lanes)  # every split in one lane
        assert sum(mine) == sum(lane_rows(sum(mine), batch, lanes))


def test_lanes_cut_batches_in_their_shares_and_the_rest_last():
    lanes = Lanes((2, 3), coming=(5, 7))
    for lane, n, first in ((0, 5, 0), (1, 7, 100)):
        lanes.push(lane, lane, 0, make_batch(list(range(first, first + n))), 0)
    assert lanes.full()
    got = [lanes.cut().batch.passthrough["row_id"].tolist() for _ in range(2)]
    assert got == [[0, 1, 100, 101, 102], [2, 3, 103, 104, 105]]
    assert not lanes.full() and lanes.rest().batch.passthrough["row_id"].tolist() == [4, 106]
    # A lane that will get no more rows (a skipped split) gives what it holds; the others make up the batch.
    lanes = Lanes((2, 3), coming=(1, 9))
    lanes.push(0, 0, 0, make_batch([0]), 0)
    lanes.push(1, 1, 0, make_batch(list(range(100, 109))), 0)
    assert lanes.full()
    assert lanes.cut().batch.passthrough["row_id"].tolist() == [0, 100, 101, 102, 103]


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(2, 12), st.integers(2, 5),
       st.integers(0, 1 << 30), st.booleans())
def test_every_full_batch_draws_its_shares_from_every_lane_whatever_the_arrival_order(sizes, batch, lanes, seed,
                                                                                      drop_last):
    lanes = min(lanes, batch)
    split_rows = rank_plan(sizes, batch, lanes)
    pieces = pieces_for(split_rows, batch)
    reference, _ = assemble(split_rows, batch, lanes, pieces, drop_last=drop_last)
    rng = random.Random(seed)
    for workers in (1, 2, 4):
        assert assemble(split_rows, batch, lanes, arrival_orders(pieces, rng, workers), drop_last=drop_last)[0] \
            == reference
    total = sum(split_rows)
    full, rest = divmod(total, batch)
    assert len(reference) == full + (1 if rest and not drop_last else 0)  # what len() counts
    rows = [r for b in reference for r in b]
    assert len(rows) == len(set(rows)) == (full * batch if drop_last else total)  # each row once; all of them
    bounds = lane_bounds(total, batch, lanes)
    split_starts = [sum(split_rows[:i]) for i in range(len(split_rows) + 1)]
    for b in reference[:full]:
        per_lane = [0] * lanes
        for r in b:
            per_lane[bisect.bisect_right(bounds, r) - 1] += 1
        assert per_lane == list(proportional(batch, lanes))
        assert len({bisect.bisect_right(split_starts, r) for r in b}) >= lanes  # K distinct splits at least


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(2, 12), st.integers(2, 5),
       st.integers(0, 1 << 30))
def test_a_resumed_mixed_run_continues_the_same_sequence(sizes, batch, lanes, seed):
    lanes = min(lanes, batch)
    split_rows = rank_plan(sizes, batch, lanes)
    pieces = pieces_for(split_rows, batch)
    rng = random.Random(seed)
    reference, _ = assemble(split_rows, batch, lanes, pieces)
    stop = rng.randrange(1, len(reference) + 1)
    first, state = assemble(split_rows, batch, lanes, arrival_orders(pieces, rng, 3), stop_after=stop)
    consumed = {sid: (p, r) for sid, p, r in state["consumed"]}
    rest, _ = assemble(split_rows, batch, lanes, arrival_orders(pieces, rng, 2), consumed=consumed)
    assert first + rest == reference


def test_get_state_and_reset_round_trip():
    split_rows = rank_plan([30, 17, 25, 9], 8, 3)
    pieces = pieces_for(split_rows, 8)
    a = EpochAssembler(list(enumerate(split_rows)), 8, False, mix_splits=3)
    taken = []
    for sid, p, b in pieces:
        a.add(sid, p, b)
        if (r := a.next_ready()) is not None:
            a.consume(r)
            taken.append(r.batch.passthrough["row_id"].tolist())
        if len(taken) == 4:
            break
    state = a.get_state()
    a.reset(state)
    assert a.get_state() == state
    rest, _ = assemble(split_rows, 8, 3, pieces, consumed={sid: (p, r) for sid, p, r in state["consumed"]})
    assert taken + rest == assemble(split_rows, 8, 3, pieces)[0]
    # The same consumed rows as another plan's lanes are refused, not mixed wrongly.
    with pytest.raises(ValueError, match="not of this plan's lanes"):
        EpochAssembler(list(enumerate(split_rows)), 8, False, mix_splits=3, consumed={0: (1, 0)})


def test_a_skipped_split_leaves_every_other_row_exactly_once():
    split_rows = rank_plan([30, 17, 25, 9], 8, 3)
    a = EpochAssembler(list(enumerate(split_rows)), 8, False, mix_splits=3)
    skipped = 2
    order = lane_schedule(list(enumerate(split_rows)), 8, 3)
    pieces = {(sid, p): b for sid, p, b in pieces_for(split_rows, 8)}
    out = []
    for sid, p in order:
        if sid == skipped:
            a.skip_split(sid)
            continue
        a.add(sid, p, pieces[sid, p])
        while (r := a.next_ready()) is not None:
            a.consume(r)
            out.append(r.batch.passthrough["row_id"].tolist())
    assert a.exhausted
    first = sum(split_rows[:skipped])
    expected = [r for r in range(sum(split_rows)) if not first <= r < first + split_rows[skipped]]
    assert sorted(r for b in out for r in b) == expected
    assert all(len(b) == 8 for b in out[:-1])


def test_the_spec_key_is_validated_and_absent_at_its_default(tables):
    spec = DatasetSpec.from_dict(spec_dict(tables["orc"]))
    assert spec.mix_splits == 1 and "mix_splits" not in spec.to_dict() and spec.splits_in_flight is None
    mixed = DatasetSpec.from_dict(spec_dict(tables["orc"], mix_splits=4))
    assert DatasetSpec.from_dict(mixed.to_dict()) == mixed and mixed.splits_in_flight == 4 and mixed.cycle is None
    assert mixed.fingerprint() != spec.fingerprint()
    for value, message in ((0, "mix_splits: 0 is not between 1 and 1024"),
                           ("4", "mix_splits: expected a positive integer"),
                           (True, "mix_splits: expected a positive integer, got a boolean"),
                           (300, "mix_splits: 300 lanes cannot each give a row to a batch of batch_size 256")):
        with pytest.raises(SpecError, match=message):
            DatasetSpec.from_dict(spec_dict(tables["orc"], mix_splits=value))
    with pytest.raises(SpecError, match="order.cycle: 3 is not used with mix_splits 2"):
        DatasetSpec.from_dict(spec_dict(tables["orc"], mix_splits=2, order={"deterministic": True, "cycle": 3}))


def test_positions_name_mix_splits_and_a_part_of_other_lanes_is_not_continued_as_its_own(tables):
    spec = DatasetSpec.from_dict(spec_dict(tables["orc"], mix_splits=2))
    plain = DatasetSpec.from_dict(spec_dict(tables["orc"]))
    mine = resume.part(spec, "plan", 0, 1, 0, [], [[0, 1, 5, 3, 0, 261, 0]], 1)
    assert mine["mix_splits"] == 2 and "mix_splits" not in resume.part(plain, "plan", 0, 1, 0, [], [], 0)
    own = resume.resume_of({"rank_0": mine}, spec, 0, 1)
    assert own.consumed == {0: (1, 5)} and not own.in_place
    # With other lanes the split ids are another plan's: the rows are replanned (elastic), never continued.
    other = resume.resume_of({"rank_0": mine}, plain, 0, 1)
    assert other.consumed == {} and other.done == [[3, 0, 261]] and not other.in_place
    position = resume.job_position({0: mine})
    assert position["mix_splits"] == 2
    assert resume.resume_of(position, spec, 0, 1).in_place  # same lanes, world size and batch size
    assert not resume.resume_of(position, DatasetSpec.from_dict(spec_dict(tables["orc"], mix_splits=4)), 0, 1).in_place
