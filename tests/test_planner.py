from __future__ import annotations

import msgpack
import numpy as np
import pytest

from remoteloader.formats import DataFile, Unit
from remoteloader.core.plan import SplitTask, make_task, pieces_of, plan_base_splits, plan_epoch, rank_rows


def make_file(rows_per_unit):
    units, first = [], 0
    for i, n in enumerate(rows_per_unit):
        units.append(Unit(i, first, n, n * 10))
        first += n
    return DataFile("f", "orc", "", first, first * 10, tuple(units))


def test_base_splits_align_to_units_and_cover_every_row():
    files = [make_file([300, 300, 300, 50]), make_file([1000]), make_file([10, 10])]
    splits = plan_base_splits(files, split_rows=650)
    assert [(s.file, s.first_unit, s.stop_unit, s.rows) for s in splits] == [
        (0, 0, 2, 600), (0, 2, 4, 350), (1, 0, 1, 1000), (2, 0, 2, 20)]
    assert [s.id for s in splits] == list(range(len(splits)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
@pytest.mark.parametrize("shuffle", [False, True])
def test_epoch_plan_partitions_rows_between_ranks(world_size, shuffle):
    base = plan_base_splits([make_file([137] * 9), make_file([51, 77])], split_rows=200)
    total = sum(s.rows for s in base)
    plan = plan_epoch(base, epoch=3, seed=11, shuffle=shuffle, world_size=world_size)
    covered = {s.id: np.zeros(s.rows, bool) for s in base}
    for s in plan:
        assert 0 <= s.row_lo < s.row_hi <= base[s.base].rows
        assert not covered[s.base][s.row_lo:s.row_hi].any()
        covered[s.base][s.row_lo:s.row_hi] = True
    assert all(c.all() for c in covered.values())
    for r in range(world_size):
        assert sum(s.rows for s in plan if s.rank == r) == rank_rows(total, world_size, r)
    assert [s.id for s in plan] == list(range(len(plan)))


def test_shuffled_plan_is_deterministic_per_epoch():
    base = plan_base_splits([make_file([100] * 20)], split_rows=100)
    a = plan_epoch(base, 1, 5, True, 2)
    assert a == plan_epoch(base, 1, 5, True, 2)
    assert [s.base for s in a] != [s.base for s in plan_epoch(base, 2, 5, True, 2)]


def test_pieces_of():
    assert [pieces_of(n, 10) for n in (1, 10, 11, 20, 21)] == [1, 1, 2, 2, 3]


def test_split_task_travels_as_named_fields_and_rejects_anything_else():
    f = make_file([100, 100])
    base = plan_base_splits([f], 100)[0]
    split = plan_epoch([base], 0, 0, False, 1)[0]
    task = make_task([f], base, split, epoch=3, skip=1)
    wire = msgpack.unpackb(msgpack.packb(task.to_wire()))
    assert wire["file"]["path"] == "f" and SplitTask.from_wire(wire) == task
    for bad in ({**wire, "file": ["f", "orc", "", 200, 2000, []]},        # the old positional form
                {**wire, "file": {**wire["file"], "num_rows": "200"}},
                {**wire, "file": {**wire["file"], "units": [[0, 0, 100]]}},
                {**wire, "extra": 1}):
        with pytest.raises(ValueError, match="malformed"):
            SplitTask.from_wire(bad)
