"""Tables mixed by weight (spec ``tables``, core/mix.py): the per-batch shares, the three
``when_done`` policies, each table's rows exactly once per pass, every rank's plan, the
assembler fed by the plan's lane keys (any arrival order, a resume, a state round trip),
and spec validation naming the key."""
from __future__ import annotations

import random
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest

from remoteloader.client.assembly import EpochAssembler
from remoteloader.core.mix import check_passes, composition, plan_mixed_epoch, table_rows
from remoteloader.core.plan import BaseSplit, pieces_of
from remoteloader.core.schedule import lane_piece_key
from remoteloader.spec import DatasetSpec, SpecError, weighted_shares
from tests.assembly_helpers import drain
from tests.conftest import spec_dict
from tests.test_assembly import make_batch


def test_weighted_shares_add_up_and_are_within_one_row_of_exact():
    rng = random.Random(3)
    for _ in range(300):
        weights = [rng.choice([1, 2, 3, 0.5, 7.25, 100]) for _ in range(rng.randint(1, 6))]
        batch = rng.randint(len(weights) * 100, 5000)
        shares = weighted_shares(batch, weights)
        assert sum(shares) == batch
        exact = [Fraction(batch) * Fraction(w) / sum(map(Fraction, weights)) for w in weights]
        assert all(abs(s - e) < 1 for s, e in zip(shares, exact))
    assert weighted_shares(1024, [3, 1]) == (768, 256)


def batches_of(segments):
    """Per batch, the rows of each table."""
    return [s.counts for s in segments for _ in range(s.batches)]


@pytest.mark.parametrize("policies", [("drop", "drop"), ("stop", "drop"), ("drop", "stop"), ("restart", "drop"),
                                      ("drop", "restart"), ("stop", "stop"), ("restart", "stop")])
@pytest.mark.parametrize("rows", [(3000, 1000), (3001, 999), (100, 5000), (5000, 7), (0, 900)])
def test_composition_is_exact_and_follows_each_policy(policies, rows):
    batch, weights = 64, (3, 1)
    segments = composition(batch, weights, policies, rows)
    per_batch = batches_of(segments)
    taken = table_rows(segments, 2)
    exact = weighted_shares(batch, weights)
    cumulative = [0, 0]
    for b, counts in enumerate(per_batch):
        last = b == len(per_batch) - 1
        in_mix = [t for t in (0, 1) if cumulative[t] < rows[t] or (policies[t] == "restart" and rows[t])]
        ends = [t for t in in_mix if policies[t] != "restart" and cumulative[t] + counts[t] == rows[t]]
        if not last:
            assert sum(counts) == batch  # every batch but the epoch's last is full
        if len(in_mix) == 2 and not ends:  # both tables in the mix, none running out: the weighted shares
            assert counts == exact
        cumulative = [c + n for c, n in zip(cumulative, counts)]
    for t in (0, 1):
        if policies[t] == "drop":  # read to its end (unless a stop table ended the epoch first)
            other_stops = policies[1 - t] == "stop" and taken[1 - t] == rows[1 - t]
            assert taken[t] == rows[t] or other_stops
        if policies[t] != "restart":
            assert taken[t] <= rows[t]
    stops = [t for t in (0, 1) if policies[t] == "stop"]
    finite = [t for t in (0, 1) if policies[t] != "restart"]
    # The epoch ends when a stop table ran out, or every table that can run out did.
    assert any(taken[t] == rows[t] for t in stops) or all(taken[t] == rows[t] for t in finite)


def test_a_restarted_table_is_read_in_whole_passes_while_the_other_runs():
    segments = composition(100, (1, 1), ("restart", "drop"), (30, 500))
    assert table_rows(segments, 2) == [500, 500]  # 50 rows a batch of each: 16 passes and a part
    with pytest.raises(ValueError, match="never end"):
        composition(100, (1, 1), ("restart", "restart"), (30, 500))


def base_splits(sizes_by_table):
    """Base splits of several tables (one file per split), and each one's table."""
    out, tables, position = [], [], 0
    for t, sizes in enumerate(sizes_by_table):
        for n in sizes:
            out.append(BaseSplit(len(out), len(out), 0, 1, n, n, position))
            tables.append(t)
            position += n
    return out, tables


def rows_of(plan_splits):
    """(table, pass, base, row) of every row a plan's splits hold."""
    return [(s.table[0], s.table[1], s.base, r) for s in plan_splits for r in range(s.row_lo, s.row_hi)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("policies", [("drop", "drop"), ("restart", "drop"), ("stop", "restart")])
def test_the_plan_reads_each_table_once_per_pass_and_gives_every_rank_the_same_batches(world, policies):
    sizes = ([300, 250, 400, 120], [90, 110, 75])
    base, tables = base_splits(sizes)
    plans = plan_mixed_epoch(base, tables, (3, 1), policies, epoch=2, seed=9, shuffle=True, world_size=world,
                             batch_size=32, even="pad")
    assert len({tuple(map(tuple, batches_of(p.segments))) for p in plans.values()}) == 1  # even: the same batches
    ids = [s.id for r in sorted(plans) for s in plans[r].splits]
    assert ids == list(range(len(ids)))  # unique in the epoch, rank by rank
    everything = [row for p in plans.values() for row in rows_of(p.splits)]
    for t, table_sizes in enumerate(sizes):
        rows_t = [x for x in everything if x[0] == t]
        passes = {x[1] for x in rows_t}
        total = sum(table_sizes)
        for p in sorted(passes)[:-1]:  # every whole pass: each row of the table once (padding aside)
            got = sorted((b, r) for tt, pp, b, r in rows_t if pp == p)
            assert len(set(got)) == total and len(got) < total + world
        last = [(b, r) for tt, pp, b, r in rows_t if pp == max(passes)]
        assert len(set(last)) == len(last) - sum(1 for p in plans.values() for s in p.splits
                                                 if s.padding and s.table == (t, max(passes)))
        if policies[t] == "drop":
            assert passes == {0} and len(set(last)) == total


def assemble_rank(plan, batch, arrivals_seed=None, consumed=None, stop_after=None):
    """The batches of a rank's mixed plan, its pieces arriving in a shuffled order; rows are
    encoded ``table * 10**6 + pass * 10**5 + base * 1000 + row``."""
    splits = plan.splits
    pieces = []
    for s in splits:
        ids = np.array([s.table[0] * 10**6 + s.table[1] * 10**5 + s.base * 1000 + r
                        for r in range(s.row_lo, s.row_hi)], np.int64)
        for i in range(pieces_of(s.rows, batch)):
            pieces.append((s.id, i, make_batch(ids[i * batch:(i + 1) * batch])))
    if arrivals_seed is not None:
        random.Random(arrivals_seed).shuffle(pieces)
    # Split pieces must arrive in order per split (workers send them so); keep that, shuffle across splits.
    by_split: dict[int, list] = {}
    for p in pieces:
        by_split.setdefault(p[0], []).append(p)
    for v in by_split.values():
        v.sort(key=lambda p: p[1])
    order = [by_split[sid].pop(0) for sid, _, _ in pieces]
    assembler = EpochAssembler([(s.id, s.rows) for s in splits], batch, False, consumed=consumed,
                               lanes={s.id: s.lane for s in splits})
    return assembler, drain(assembler, order, stop_after)


def test_the_assembler_cuts_the_plans_batches_whatever_the_arrival_order():
    base, tables = base_splits(([300, 250, 400, 120], [90, 110, 75]))
    plans = plan_mixed_epoch(base, tables, (3, 1), ("drop", "restart"), 0, 4, True, 2, 32, "pad")
    for plan in plans.values():
        _, (reference, _) = assemble_rank(plan, 32)
        expected = batches_of(plan.segments)
        assert [[sum(1 for r in b if r // 10**6 == t) for t in (0, 1)] for b in reference] == \
               [list(c) for c in expected]
        for seed in range(3):
            _, (batches, _) = assemble_rank(plan, 32, arrivals_seed=seed)
            assert batches == reference


def test_a_resumed_mixed_run_continues_the_same_sequence_and_its_state_round_trips():
    base, tables = base_splits(([300, 250, 400, 120], [90, 110, 75]))
    plan = plan_mixed_epoch(base, tables, (3, 1), ("drop", "drop"), 1, 4, True, 1, 32, "pad")[0]
    _, (whole, _) = assemble_rank(plan, 32)
    for stop in (1, 17, len(whole) - 1):
        first, (head, state) = assemble_rank(plan, 32, stop_after=stop)
        consumed = {sid: (p, r) for sid, p, r in state["consumed"]}
        resumed, (rest, _) = assemble_rank(plan, 32, arrivals_seed=stop, consumed=consumed)
        assert head + rest == whole
        first.reset(state)
        assert first.get_state() == state
    other = plan_mixed_epoch(base, tables, (1, 1), ("drop", "drop"), 1, 4, True, 1, 32, "pad")[0]
    _, (_, state) = assemble_rank(plan, 32, stop_after=5)
    with pytest.raises(ValueError, match="not of this plan"):  # a position of another mix
        assemble_rank(other, 32, consumed={sid: (p, r) for sid, p, r in state["consumed"]})


def mix_dict(tmp_path, **overrides):
    spec = spec_dict(tmp_path / "a")
    del spec["table"]
    spec["tables"] = [{"path": str(tmp_path / "a"), "weight": 3},
                      {"path": str(tmp_path / "b"), "weight": 1, "columns": {"label": "clicked"}}]
    spec.update(overrides)
    return spec


def test_a_spec_of_one_table_keeps_its_form_and_a_mix_round_trips(tmp_path):
    one = DatasetSpec.from_dict(spec_dict(tmp_path / "a"))
    assert "tables" not in one.to_dict() and not one.tables
    mix = DatasetSpec.from_dict(mix_dict(tmp_path))
    assert "table" not in mix.to_dict()
    assert DatasetSpec.from_dict(mix.to_dict()) == mix
    assert mix.tables[1].stored("label") == "clicked" and mix.tables[1].stored("float_0") == "float_0"
    assert mix.fingerprint() != one.fingerprint()


@pytest.mark.parametrize("change, key", [
    (lambda s: s["tables"][0].update(weight=0), r"tables\[0\]\.weight"),
    (lambda s: s["tables"][1].update(weight=True), r"tables\[1\]\.weight"),
    (lambda s: s["tables"][1].update(when_done="loop"), r"tables\[1\]\.when_done"),
    (lambda s: s["tables"][1].update(colour="red"), r"tables\[1\]\.colour"),
    (lambda s: s["tables"][0].pop("path"), r"tables\[0\]\.path"),
    (lambda s: s["tables"][1].update(columns={"a": "x", "b": "x"}), r"tables\[1\]\.columns"),
    (lambda s: s["tables"][1].update(columns=["x"]), r"tables\[1\]\.columns"),
    (lambda s: s["tables"][0].update(partitions=[]), r"tables\[0\]\.partitions"),
    (lambda s: s["tables"][0].update(format="csv"), r"tables\[0\]\.format"),
    (lambda s: [t.update(when_done="restart") for t in s["tables"]], r"^tables: every table"),
    (lambda s: s["tables"][0].update(weight=0.001), r"tables\[0\]\.weight: .* no row"),
    (lambda s: s.update(table="x"), r"^tables: give either"),
    (lambda s: s.update(tables=[]), r"^tables: 0 tables"),
    (lambda s: s.update(mix_splits=2), r"^mix_splits"),
    (lambda s: s.update(order={"deterministic": True, "cycle": 2}), r"^order\.cycle"),
    (lambda s: s["tables"][1].update(follow={"every": 60}), r"tables\[1\]\.follow: a mix's tables are fixed"),
])
def test_the_spec_validates_a_mix_naming_the_key(tmp_path, change, key):
    spec = mix_dict(tmp_path)
    change(spec)
    with pytest.raises(SpecError, match=key):
        DatasetSpec.from_dict(spec)


def test_piece_keys_order_pieces_as_the_batches_use_them():
    """A piece's key's batch is the batch that takes its first row (segments included)."""
    base, tables = base_splits(([300, 250, 400, 120], [90, 110, 75]))
    plan = plan_mixed_epoch(base, tables, (5, 2), ("drop", "drop"), 0, 1, True, 1, 16, "pad")[0]
    per_batch = batches_of(plan.segments)
    first_batch_of_row = {0: [], 1: []}
    for b, counts in enumerate(per_batch):
        for t in (0, 1):
            first_batch_of_row[t] += [b] * counts[t]
    lane_row = {0: 0, 1: 0}
    for s in sorted(plan.splits, key=lambda s: (s.lane[0], lane_piece_key(s.lane, 0, 16))):
        t = s.lane[0]
        for i in range(pieces_of(s.rows, 16)):
            assert lane_piece_key(s.lane, i, 16)[0] == first_batch_of_row[t][lane_row[t] + i * 16]
        lane_row[t] += s.rows


def test_a_restarted_table_read_too_many_times_an_epoch_is_refused_naming_its_weight(tmp_path):
    spec = DatasetSpec.from_dict(mix_dict(tmp_path, batch_size=1024))
    spec = spec.replace(tables=(spec.tables[0], replace(spec.tables[1], when_done="restart")))
    check_passes(spec, [10**6, 1000])  # 1,000 passes: fine
    with pytest.raises(SpecError, match=r"tables\[1\]\.weight: .* 333,333 times"):
        check_passes(spec, [10**9, 1000])


def replayed_mixed_job(world: int, resumed=None):
    """A master's state of a mix of 3 files (2 of table a at weight 3, 1 of table b, restarted),
    each of 2 base splits of 50 rows, from a journal: ``world`` ranks joined and started epoch 3
    (``resumed``: after an elastic resume of it, its ``done`` ranges)."""
    from remoteloader.formats import DataFile, Unit
    from remoteloader.master import updates as U
    from remoteloader.master.state import JobState

    spec = DatasetSpec.from_dict({"tables": [{"path": "/a", "weight": 3}, {"path": "/b", "when_done": "restart"}],
                                  "features": {"dense": ["x"]}, "batch_size": 8, "shuffle": True})
    files = [U.file_record(DataFile(f"f{i}", "orc", "", 100, 1000, (Unit(0, 0, 50, 500), Unit(1, 50, 50, 500))))
             for i in range(3)]
    records = [U.SplitRecord(f, u, u + 1, 50, 50, 100 * f + 50 * u) for f in range(3) for u in range(2)]
    history = [U.MasterStarted(0.0), U.JobSubmitted(spec, "fp", {"x": "float"}, files, records, [], [0, 0, 1]),
               *(U.ClientJoined(f"c{r}", r, world, 0.0) for r in range(world)),
               *([U.EpochResumed(3, resumed)] if resumed is not None else []),
               *(U.EpochStarted(r, 3, f"c{r}", 0) for r in range(world))]
    st = JobState()
    for u in history:
        st.apply(U.decode(U.encode(u)))  # as a journal replays them
    return st


def test_the_master_plans_a_mix_and_a_replayed_journal_or_snapshot_rebuilds_it():
    from remoteloader.master import updates as U
    from remoteloader.master.state import JobState

    st = replayed_mixed_job(2)
    expected = plan_mixed_epoch(st.job.splits, [0, 0, 0, 0, 1, 1], (3, 1), ("drop", "restart"), 3, 0, True, 2, 8, "pad")
    for rank in (0, 1):
        progress = st.epoch_splits(rank, 3)
        assert [p.split for p in progress] == expected[rank].splits
        assert all(p.lane == p.split.lane for p in progress)
        assert list(st.ranks[rank].pending) == [s.id for s in sorted(expected[rank].splits,
                                                                       key=lambda s: lane_piece_key(s.lane, 0, 8))]
        assert st.shares().rows[rank] == sum(s.rows for s in expected[rank].splits)
    snap = st.snapshot()
    rebuilt = JobState()
    rebuilt.apply(U.decode(U.encode(snap)))
    assert rebuilt.snapshot() == snap and rebuilt.job.file_tables == [0, 0, 1]
    assert [p.split for p in rebuilt.epoch_splits(1, 3)] == expected[1].splits


def test_a_skipped_split_leaves_every_other_row_of_the_mix_exactly_once():
    """on_error: skip: the skipped split's rows never come; the batches take the shortfall
    from the other table and every other row is delivered once, every batch but the last full."""
    base, tables = base_splits(([300, 250, 400, 120], [90, 110, 75]))
    plan = plan_mixed_epoch(base, tables, (3, 1), ("drop", "drop"), 0, 4, True, 1, 32, "pad")[0]
    skipped = next(s for s in plan.splits if s.table[0] == 1)
    ids = {s.id: [s.table[0] * 10**6 + s.base * 1000 + r for r in range(s.row_lo, s.row_hi)] for s in plan.splits}
    assembler = EpochAssembler([(s.id, s.rows) for s in plan.splits], 32, False,
                               lanes={s.id: s.lane for s in plan.splits})
    order = sorted(((s.id, i) for s in plan.splits for i in range(pieces_of(s.rows, 32))),
                   key=lambda sp: lane_piece_key(plan.splits[sp[0]].lane, sp[1], 32))
    out = []
    for sid, p in order:
        if sid == skipped.id:
            assembler.skip_split(sid)
        else:
            assembler.add(sid, p, make_batch(ids[sid][p * 32:(p + 1) * 32]))
        while (r := assembler.next_ready()) is not None:
            assembler.consume(r)
            out.append(r.batch.passthrough["row_id"].tolist())
    assert assembler.exhausted
    assert sorted(r for b in out for r in b) == sorted(r for sid, rows in ids.items() if sid != skipped.id for r in rows)
    assert all(len(b) == 32 for b in out[:-1])


def test_a_restarted_tables_later_passes_shuffle_rows_anew():
    from remoteloader.core.mix import row_stream

    assert row_stream(5, None) == row_stream(5, [1, 0]) == 6  # one table, and a mix's first pass: as before
    assert len({row_stream(5, [1, p]) for p in range(4)} | {row_stream(6, [1, p]) for p in range(4)}) == 8


def test_a_mix_whose_tables_select_no_row_names_the_first_such_table(tmp_path):
    """Not ``table.partitions``, a key a mix's spec does not have."""
    import pyarrow.parquet as pq

    from remoteloader.master.service import _bind_and_plan
    from tests.follow_tables import follow_spec, partition_table

    for name in "ab":
        (tmp_path / name).mkdir()
        pq.write_table(partition_table(0, 0), tmp_path / name / "part-0.parquet")
    spec = follow_spec(tmp_path / "a")
    del spec["table"]
    spec["tables"] = [{"path": str(tmp_path / "a")}, {"path": str(tmp_path / "b")}]
    with pytest.raises(SpecError, match=r"^tables\[0\]\.partitions: the selection of table .* has no rows"):
        _bind_and_plan(DatasetSpec.from_dict(spec))
