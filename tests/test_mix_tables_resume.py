"""A mix of tables resumed from a job position (what DCP saves): on another world size (and
batch size) the rest of each table's passes is dealt to the new ranks and every row is read exactly once per
pass, the batches keeping their shares; on the same world size the position is named back in
each rank's own splits (padding included), so the sequence continues unchanged."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from remoteloader.client import resume
from remoteloader.client.epoch import EpochPlan, EpochRun, _split_plan
from remoteloader.core.mix import MAX_PASSES, PASS_KEY, base_and_pass, plan_mixed_epoch, rows_key
from remoteloader.master import updates as U
from remoteloader.master.service import MasterConfig, MasterService, RequestError
from remoteloader.master.state import JobState
from remoteloader.protocol import messages as M
from remoteloader.spec import DatasetSpec
from tests.conftest import examples
from tests.test_mix_tables import assemble_rank, base_splits, batches_of, mix_dict, replayed_mixed_job

POLICIES = [("drop", "drop"), ("drop", "restart"), ("restart", "stop"), ("stop", "drop")]


def decoded(row_id: int) -> tuple[int, int, int, int]:
    """(table, pass, base, row) of an id ``assemble_rank`` made."""
    return row_id // 10**6, row_id // 10**5 % 10, row_id // 1000 % 100, row_id % 1000


def run_of(plan, assembler) -> EpochRun:
    """The client's run of a rank's mixed plan, as ``start_epoch`` would have told it."""
    infos = [M.EpochSplitInfo(s.id, s.rows, s.base, s.row_lo, s.padding, list(s.lane), list(s.table))
             for s in plan.splits]
    return EpochRun(EpochPlan(0, [], {i.split_id: _split_plan(i) for i in infos}), assembler)


def checkpoint(plans, batch, stops):
    """Each rank consumes its first ``stops[r]`` batches: their row ids, each rank's run, and
    the job's position's ``done`` (``resume.job_position``'s merge of the ranks' parts)."""
    head, runs, parts = [], {}, {}
    for rank, plan in plans.items():
        assembler, (batches, _) = assemble_rank(plan, batch, stop_after=stops[rank])
        head += [r for b in batches for r in b]
        runs[rank] = run_of(plan, assembler)
        parts[rank] = {"done": [], "consumed": runs[rank].consumed(batch)}
    return head, runs, resume.merged_done(parts)


def as_intervals(done):
    out: dict[int, list[tuple[int, int]]] = {}
    for key, lo, hi in done:
        out.setdefault(key, []).append((lo, hi))
    return out


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(5, 90), min_size=1, max_size=5), st.lists(st.integers(3, 60), min_size=1, max_size=4),
       st.sampled_from(POLICIES), st.sampled_from([(3, 1), (1, 1), (1, 4)]), st.integers(1, 4), st.integers(1, 4),
       st.sampled_from(["off", "pad"]), st.integers(0, 10**6), st.integers(6, 24), st.integers(6, 24))
def test_a_resume_on_another_world_size_reads_each_pass_exactly_once_in_the_same_shares(
        sizes_a, sizes_b, policies, weights, old_world, new_world, even, cut, batch, new_batch):
    base, tables = base_splits((sizes_a, sizes_b))
    old = plan_mixed_epoch(base, tables, weights, policies, 3, 7, True, old_world, batch, even)
    total = {r: len(batches_of(p.segments)) for r, p in old.items()}
    stops = {r: (cut + 13 * r) % (total[r] + 1) or None for r in old}  # ranks stop at other batches
    head, runs, done = checkpoint(old, batch, {r: s for r, s in stops.items()})
    if all(stops[r] is None for r in old):
        return  # every rank read its whole epoch: nothing to resume
    new = plan_mixed_epoch(base, tables, weights, policies, 3, 7, True, new_world, new_batch, even,
                           done=as_intervals(done))
    assume(all(s.table[1] < 10 for p in (*old.values(), *new.values()) for s in p.splits))  # ids hold 10 passes
    tail = []
    for plan in new.values():
        _, (batches, _) = assemble_rank(plan, new_batch)
        # Every batch holds what the plan composed: each table's share, but where one runs out and the last.
        assert [[sum(1 for r in b if r // 10**6 == t) for t in (0, 1)] for b in batches] == \
               [list(c) for c in batches_of(plan.segments)]
        tail += [r for b in batches for r in b]
    # Repeated rows are the padding of each pass, read in the old epoch or in the resumed one.
    padding = Counter()
    for run in runs.values():
        for _, _, _, key, _, rows, pad in run.consumed(batch):
            padding[base_and_pass(key)[1], tables[base_and_pass(key)[0]]] += rows * pad
    padding.update((s.table[1], s.table[0]) for p in new.values() for s in p.splits if s.padding)
    read = Counter(decoded(r) for r in head + tail)
    sizes = (sizes_a, sizes_b)
    for t in (0, 1):
        passes = sorted({p for tt, p, _, _ in read if tt == t})
        for p in passes:
            rows = {(b, r): n for (tt, pp, b, r), n in read.items() if (tt, pp) == (t, p)}
            assert sum(rows.values()) - len(rows) == padding[p, t], f"table {t} pass {p}: a row read twice"
            # A table that can run out is read whole (a drop table unless another stops the epoch);
            # a restarted table's pass may be cut off by the epoch's end, on any rank.
            if policies[t] == "stop" or (policies[t] == "drop" and "stop" not in policies):
                assert len(rows) == sum(sizes[t]), f"table {t} pass {p}: a row skipped"
        if policies[t] != "restart":
            assert passes in ([], [0])


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(5, 90), min_size=1, max_size=5), st.lists(st.integers(3, 60), min_size=1, max_size=4),
       st.sampled_from(POLICIES), st.integers(1, 4), st.integers(0, 10**6), st.integers(6, 24))
def test_a_position_on_the_same_world_size_names_each_ranks_own_consumed_splits(
        sizes_a, sizes_b, policies, world, cut, batch):
    """In place (deterministic order, same world size and batch size): ``consumed_in`` gives
    back every rank's consumed state, the padding splits inside its lanes included."""
    base, tables = base_splits((sizes_a, sizes_b))
    plans = plan_mixed_epoch(base, tables, (3, 1), policies, 1, 2, True, world, batch, "pad")
    stops = {r: (cut + 7 * r) % len(batches_of(p.segments)) or 1 for r, p in plans.items()}
    _, runs, done = checkpoint(plans, batch, stops)
    for run in runs.values():
        splits = run.plan.splits
        assert rows_consumed(splits, resume.consumed_in(done, splits, batch), batch) == \
               rows_consumed(splits, run.assembler.consumed_state(), batch)


def rows_consumed(splits, consumed, batch):
    """Rows consumed of each split: (pieces, tail rows) of a split shorter than a batch may be
    (1, 0) or (0, rows), the same rows."""
    return {sid: splits[sid].rows_consumed(p, r, batch) for sid, (p, r) in consumed.items()}


def test_rows_keys_name_a_restarted_tables_later_passes_apart():
    assert rows_key(5, 0) == 5 and rows_key(5, 2) == 5 + 2 * PASS_KEY
    assert base_and_pass(rows_key(123, 7)) == (123, 7)


def test_a_replayed_journal_plans_a_resumed_mix_without_its_consumed_rows_and_the_master_checks_them():
    """The master's plan of a mix resumed on 3 ranks (journaled ``EpochResumed`` with rows of a
    restarted table's second pass) is ``plan_mixed_epoch`` with those rows left out, rebuilt
    alike from a snapshot; ``done`` naming a pass past the bound is refused."""
    done = [[0, 0, 30], [rows_key(4, 1), 0, 10]]  # table a's base split 0; table b's base split 4 in pass 1
    st = replayed_mixed_job(3, done)
    expected = plan_mixed_epoch(st.job.splits, [0, 0, 0, 0, 1, 1], (3, 1), ("drop", "restart"), 3, 0, True, 3, 8,
                                "pad", done=as_intervals(done))
    for rank in range(3):
        splits = [p.split for p in st.epoch_splits(rank, 3)]
        assert splits == expected[rank].splits
        assert not [s for s in splits if s.base == 0 and s.row_lo < 30 and not s.padding]  # consumed: left out
        assert not [s for s in splits if (s.base, s.table) == (4, (1, 1)) and s.row_lo < 10 and not s.padding]
    rebuilt = JobState()
    rebuilt.apply(U.decode(U.encode(st.snapshot())))
    assert [p.split for p in rebuilt.epoch_splits(2, 3)] == expected[2].splits

    service = MasterService(MasterConfig(), None, lambda: 0.0)
    ranges = [M.DoneRange(rows_key(4, 1), 5, 10), M.DoneRange(rows_key(4, 1), 0, 5), M.DoneRange(0, 0, 30)]
    assert service._check_done(st, ranges) == [[0, 0, 30], [rows_key(4, 1), 0, 10]]
    with pytest.raises(RequestError, match="base split 4 in pass 65536 do not exist"):
        service._check_done(st, [M.DoneRange(rows_key(4, MAX_PASSES), 0, 10)])


def test_a_position_of_another_mix_is_refused_naming_the_key(tmp_path):
    saved = DatasetSpec.from_dict(mix_dict(tmp_path))
    other = mix_dict(tmp_path)
    other["tables"][1]["weight"] = 2
    position = resume.part(saved, "plan", 0, 1, 0, [[0, 0, 10]], [], 0)
    with pytest.raises(ValueError, match="another dataset spec: 'table'"):
        resume.resume_of({"rank_0": position}, DatasetSpec.from_dict(other), 0, 1)
    assert resume.resume_of({"rank_0": position}, saved, 0, 1).done == [[0, 0, 10]]


@pytest.mark.parametrize("lane, table", [([10**12, 0, 1], [10**12, 0]), ([0, 0, 0], [0, 0]), ([0, 0, 1], [0, 10**9])])
def test_an_epoch_reply_with_a_lane_key_out_of_bounds_is_refused_naming_the_split(lane, table):
    """The client sizes its per-table books by the lane keys the master sends: a table past
    the most a spec may mix, a lane with no row a batch or a pass past the bound is refused
    before anything is sized from it (not a MemoryError, nor a division by zero later)."""
    info = M.EpochSplitInfo(7, 100, 3, 0, False, lane, table)
    with pytest.raises(ValueError, match="split 7: lane key"):
        _split_plan(info)
