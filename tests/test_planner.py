from __future__ import annotations

from dataclasses import replace

import msgspec
import numpy as np
import pytest

from remoteloader.formats import DataFile, Unit
from remoteloader.protocol.messages import SplitTaskRecord
from remoteloader.core.plan import (SplitTask, make_task, pieces_of, plan_base_splits, plan_epoch, rank_shares,
                                    remaining_rows)


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
        assert sum(s.rows for s in plan if s.rank == r) == rank_shares(total, world_size).rows[r]
    assert max(rank_shares(total, world_size).rows) - min(rank_shares(total, world_size).rows) <= 1
    assert [s.id for s in plan] == list(range(len(plan)))


def test_even_batches_examples_from_the_issue():
    # 20,001 rows on 2 ranks in batches of 1,000: near-equal shares give 11 and 10 batches.
    off = rank_shares(20_001, 2, 1000, False, "off")
    assert [off.batches(r, 1000, False) for r in range(2)] == [10, 11]
    pad = rank_shares(20_001, 2, 1000, False, "pad")
    assert pad.rows == (10_000, 10_001) and pad.padding == (1, 0) and pad.dropped == 0
    drop = rank_shares(20_001, 2, 1000, False, "drop")
    assert drop.rows == (10_000, 10_000) and drop.dropped == 1
    # drop_last: 19,999 rows gave 9 and 10 batches; now 9 each, 1,999 rows dropped.
    last = rank_shares(19_999, 2, 1000, True, "pad")
    assert [last.batches(r, 1000, True) for r in range(2)] == [9, 9] and last.dropped == 1999


@pytest.mark.parametrize("even", ["pad", "drop"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_even_batches_hold_for_every_size(even, drop_last):
    for world_size in (1, 2, 3, 5, 8):
        for batch_size in (1, 3, 10):
            for total in range(0, 3 * world_size * batch_size + 2):
                s = rank_shares(total, world_size, batch_size, drop_last, even)
                counts = {s.batches(r, batch_size, drop_last) for r in range(world_size)}
                assert len(counts) == 1, (total, world_size, batch_size, s)
                assert sum(s.rows) + s.dropped == total
                assert max(s.padding) <= 1 and sum(s.padding) <= world_size - 1
                if not drop_last and even == "pad":
                    assert s.dropped == 0                     # every row, at most W-1 repeats
                if not drop_last and even == "drop":
                    assert s.dropped < world_size and not any(s.padding)
                if drop_last:
                    assert s.dropped < world_size * batch_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_padding_splits_repeat_one_row_for_short_ranks(world_size):
    base = plan_base_splits([make_file([7])], split_rows=100)   # 7 rows, batches of 3
    plan = plan_epoch(base, 0, 0, False, world_size, batch_size=3 if world_size == 2 else 2, even="pad")
    real = [s for s in plan if not s.padding]
    assert sorted((s.row_lo, s.row_hi) for s in real) == sorted(
        (s.row_lo, s.row_hi) for s in plan_epoch(base, 0, 0, False, world_size))
    pads = [s for s in plan if s.padding]
    assert len(pads) == (1 if world_size == 2 else 2) and all(s.rows == 1 for s in pads)
    assert [s.id for s in plan] == list(range(len(plan)))


def test_resumed_plan_covers_exactly_the_rows_not_done():
    base = plan_base_splits([make_file([137] * 9), make_file([51, 77])], split_rows=200)
    first = plan_epoch(base, 4, 9, True, 2, batch_size=10, even="pad")
    done: dict = {}
    for s in first[::3]:                                        # some splits, partly consumed
        done.setdefault(s.base, []).append((s.row_lo, s.row_lo + s.rows // 2))
    done = {b: sorted(r) for b, r in done.items()}
    for world_size in (1, 2, 3):
        plan = plan_epoch(base, 4, 9, True, world_size, batch_size=10, even="pad", done=done)
        covered = {s.id: np.zeros(s.rows, int) for s in base}
        for b, ranges in done.items():
            for lo, hi in ranges:
                covered[b][lo:hi] += 1
        for s in plan:
            if not s.padding:
                covered[s.base][s.row_lo:s.row_hi] += 1
        assert all((c == 1).all() for c in covered.values())   # every row once: before or after
        counts = {-(-sum(s.rows for s in plan if s.rank == r) // 10) for r in range(world_size)}
        assert len(counts) == 1
    assert remaining_rows(base[0], {base[0].id: [(0, 5), (5, 9)]})[0] == (9, base[0].rows)


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
    wire = msgspec.to_builtins(task.to_wire())
    received = SplitTask.from_wire(msgspec.convert(wire, SplitTaskRecord))
    assert wire["file"]["path"] == "f" and wire["file"]["units"] == [[0, 0, 100, 1000]]  # the split's unit only
    assert received == replace(task, file=replace(f, units=f.units[:1]))
    for bad in ({**wire, "file": ["f", "orc", "", 200, 2000, []]},        # the old positional form
                {**wire, "file": {**wire["file"], "num_rows": "200"}},
                {**wire, "file": {**wire["file"], "units": [[0, 0, 100]]}},
                {**wire, "extra": 1}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, SplitTaskRecord)
