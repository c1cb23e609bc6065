"""Batches that mix splits (spec ``mix_splits: K``), without processes: the plan's lanes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remoteloader.core.plan import BaseSplit, plan_epoch
from remoteloader.core.schedule import lane_bounds, lane_of, lane_rows, proportional
from tests.conftest import examples


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
