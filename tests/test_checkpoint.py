"""Torch-native edges: equal batches per rank, the state's forms (rank parts, the job's position),
elastic resume, resume with another batch size, set_epoch. Ranks are loaders of one process
against in-process clusters (tests/cluster.py): what is asserted is the loaders' arithmetic,
which real processes add nothing to (test_dcp.py and test_ddp.py run real ranks)."""
from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import pytest
import torch

from remoteloader import RemoteDataLoader
from remoteloader.client import resume
from remoteloader.client.epoch import SplitPlan
from remoteloader.spec import load_spec
from tests.conftest import ROWS, spec_dict

# 5,000 rows on 3 ranks in batches of 833: near-equal shares (1,666 / 1,667 / 1,667 rows)
# give 2, 3 and 3 batches, the hang the issue describes.
UNEVEN = dict(batch_size=833, shuffle=True, split_rows=700)


def loaders(spec: dict, addr: str, world_size: int, **kw) -> list[RemoteDataLoader]:
    return [RemoteDataLoader(spec, master=addr, rank=r, world_size=world_size, timeout=90, **kw)
            for r in range(world_size)]


def lockstep(ranks: list[RemoteDataLoader], steps: int | None = None) -> list[list]:
    """Iterate the ranks together, as DDP steps do; stop after ``steps`` steps (None: the epoch)."""
    its = [iter(x) for x in ranks]
    out: list[list] = [[] for _ in ranks]
    while steps is None or len(out[0]) < steps:
        got = [next(it, None) for it in its]
        if all(b is None for b in got):
            break
        assert all(b is not None for b in got), f"ranks ran out at different steps: {[len(o) for o in out]}"
        for o, b in zip(out, got):
            o.append(b)
    return out


def real_rows(batches) -> Counter:
    rows = Counter()
    for b in batches:
        ids = b.passthrough["row_id"]
        keep = ids if b.padding is None else ids[~b.padding]
        rows.update(keep.tolist())
    return rows


def save_load(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_even_batches_pad_marks_repeated_rows_and_len_is_exact(tables, inprocess):
    master = inprocess(2)
    ranks = loaders(spec_dict(tables["orc"], **UNEVEN), master.addr, 3)
    try:
        assert [len(x) for x in ranks] == [3, 3, 3]
        per_rank = lockstep(ranks)
        assert [len(b) for b in per_rank] == [3, 3, 3]
        rows = real_rows(b for bs in per_rank for b in bs)
        assert sorted(rows) == list(range(ROWS)) and max(rows.values()) == 1
        padded = [b.padding for bs in per_rank for b in bs if b.padding is not None]
        assert sum(int(p.sum()) for p in padded) == 1            # 5,000 = 2 x 2,499 + 2: one rank short
    finally:
        for x in ranks:
            x.close()


def test_even_batches_drop_reports_left_out_rows(tables, inprocess):
    master = inprocess(2)
    ranks = loaders(spec_dict(tables["orc"], even_batches="drop", **UNEVEN), master.addr, 3)
    try:
        with pytest.warns(RuntimeWarning, match="2 rows of each epoch are left out"):
            assert [len(x) for x in ranks] == [2, 2, 2]
        per_rank = lockstep(ranks)
        rows = real_rows(b for bs in per_rank for b in bs)
        assert len(rows) == ROWS - 2 and max(rows.values()) == 1
        assert all(b.padding is None for bs in per_rank for b in bs)
    finally:
        for x in ranks:
            x.close()


def test_state_is_rank_keyed_small_and_survives_a_save_right_after_resume(tables, inprocess):
    master = inprocess(2)
    spec = spec_dict(tables["orc"], batch_size=100, shuffle=True)
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(15)]
        state = loader.state_dict()
    assert list(state) == ["rank_0"] and state["rank_0"]["epoch"] == 0 and state["rank_0"]["batches_yielded"] == 15
    buf = io.BytesIO()
    torch.save(state, buf)
    assert buf.tell() < 8192
    # Pre-empted again before the first step: the state saved after loading is the loaded one.
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        loader.load_state_dict(save_load(state))
        assert loader.state_dict() == state
        again = save_load(loader.state_dict())
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        loader.load_state_dict(again)
        rest = list(loader)
    rows = real_rows(first) + real_rows(rest)
    assert sorted(rows) == list(range(ROWS)) and max(rows.values()) == 1


def test_state_of_another_rank_is_refused_with_a_clear_error(tables, inprocess):
    master = inprocess(1)
    spec = spec_dict(tables["orc"], batch_size=100)
    a, b = loaders(spec, master.addr, 2)
    try:
        state = a.state_dict()
        with pytest.raises(ValueError, match="rank 1 of 2 needs its own part"):
            b.load_state_dict(state)
        with pytest.raises(ValueError, match="not a RemoteDataLoader state"):
            b.load_state_dict({"epoch": 3})
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("new_world", [3, 1])
def test_elastic_resume_from_two_ranks(tables, inprocess, new_world):
    spec = spec_dict(tables["orc"], **UNEVEN)
    old = inprocess(2)
    ranks = loaders(spec, old.addr, 2)
    try:
        before = lockstep(ranks, steps=1)
        states = {}
        for x in ranks:
            states.update(save_load(x.state_dict()))
    finally:
        for x in ranks:
            x.close()
    new = inprocess(2)                                # a new job on another world size
    ranks = loaders(spec, new.addr, new_world)
    try:
        for x in ranks:
            x.load_state_dict(states)
        assert all(x.state_dict()[f"rank_{x.rank}"]["done"] for x in ranks)
        promised = [len(x) for x in ranks]  # the batches still to come (was the whole epoch's count)
        after = lockstep(ranks)
        counts = {len(bs) for bs in after}
        assert len(counts) == 1                                    # equal batch counts on the new ranks
        assert promised == [len(bs) for bs in after]
        rows = real_rows(b for bs in before + after for b in bs)
        assert sorted(rows) == list(range(ROWS)) and max(rows.values()) == 1
        # The epoch after the resumed one is a whole epoch again.
        whole = [len(x) for x in ranks]
        following = lockstep(ranks)
        assert sorted(real_rows(b for bs in following for b in bs)) == list(range(ROWS))
        assert whole == [len(bs) for bs in following]
    finally:
        for x in ranks:
            x.close()


def test_len_after_a_rank_resumes_its_own_part_is_the_batches_still_to_come(tables, inprocess):
    cluster = inprocess(1)
    spec = spec_dict(tables["orc"])  # 900-row splits in batches of 256: the position falls inside tails
    first = cluster.loader(spec)
    it = iter(first)
    taken = [next(it) for _ in range(7)]
    state = save_load(first.state_dict())
    whole = len(first)
    it.close()
    first.close()
    again = cluster.loader(spec)
    again.load_state_dict(state)
    promised = len(again)
    rest = []
    for b in again:
        assert len(again) == promised  # the same while the resumed epoch is under way
        rest.append(b)
    assert promised == len(rest) < whole and len(taken) + len(rest) >= whole
    assert sorted(real_rows(taken + rest)) == list(range(ROWS))
    assert len(again) == whole


def test_set_epoch_chooses_the_next_epoch(tables, inprocess):
    master = inprocess(2)
    spec = spec_dict(tables["orc"], batch_size=500, shuffle=True)   # 900-row splits: one full piece each
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        next(iter(loader))                                         # a peek uses up epoch 0 without set_epoch
        loader.set_epoch(0)
        epoch0 = list(loader)
        epoch1 = list(loader)                                      # no set_epoch: the next one
        loader.set_epoch(1)
        again1 = list(loader)
    # Batch order depends on which worker answers first, but a split's full piece holds
    # the same rows whenever its epoch is produced, and other rows in another epoch.
    batches = [{frozenset(b.passthrough["row_id"].tolist()) for b in e} for e in (epoch0, epoch1, again1)]
    for e in (epoch0, epoch1, again1):
        assert sorted(real_rows(e)) == list(range(ROWS))
    assert len(batches[1] & batches[2]) >= 4 and not batches[0] & batches[1]


@pytest.mark.slow
def test_local_dataset_set_epoch_reaches_persistent_workers(tables):
    from torch.utils.data import DataLoader

    from remoteloader import LocalDataset

    dataset = LocalDataset(spec_dict(tables["orc"], batch_size=500, shuffle=True))
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in (0, 1, 0):
        dataset.set_epoch(epoch)
        epochs.append({frozenset(b.passthrough["row_id"].tolist()) for b in loader})
    del loader
    assert epochs[0] == epochs[2] and not epochs[0] & epochs[1]


# -- the state's forms, without processes --------------------------------------------------------
def spec_of(**overrides):
    return load_spec(spec_dict(Path("/data/t"), **overrides))


def rank_part(spec, rank: int, world: int, consumed: list, epoch: int = 0, done: list | None = None) -> dict:
    return resume.part(spec, "plan-a", rank, world, epoch, done or [], consumed, len(consumed))


def two_rank_parts(spec) -> dict[int, dict]:
    # Rank 0 read base split 3 rows [0, 250) and half of a tail; rank 1 rows [400, 650) of the
    # same base split, and a padding row (a repeat, not a row of its own).
    return {0: rank_part(spec, 0, 2, [[0, 2, 50, 3, 0, 250, 0]]),
            1: rank_part(spec, 1, 2, [[4, 2, 50, 3, 400, 650 - 400, 0], [9, 0, 1, 3, 0, 1, 1]])}


def test_the_job_position_merges_every_rank_and_no_key_names_a_rank():
    spec = spec_of(batch_size=100)
    position = resume.job_position(two_rank_parts(spec))
    assert position == {"version": resume.STATE_VERSION, "spec": resume.spec_keys(spec), "plan": "plan-a",
                        "epoch": 0, "done": [[3, 0, 250], [3, 400, 650]], "world_size": 2, "batch_size": 100,
                        "job": ""}
    assert save_load(position) == position


def test_the_job_position_resumes_any_rank_of_any_world_size():
    spec = spec_of(batch_size=100)
    position = resume.job_position(two_rank_parts(spec))
    for world in (1, 3):
        for rank in range(world):
            r = resume.resume_of(position, spec, rank, world)
            assert (r.epoch, r.plan, r.done, r.consumed) == (0, "plan-a", [[3, 0, 250], [3, 400, 650]], {})
            # state_dict() before the epoch starts: this rank's part, and the job's position again.
            assert (r.part["rank"], r.part["world_size"]) == (rank, world)
            assert resume.job_position({0: r.part}) == dict(position, world_size=world)


def test_a_resume_may_change_batch_size():
    old, new = spec_of(batch_size=100), spec_of(batch_size=250)
    parts = two_rank_parts(old)
    r = resume.resume_of(resume.job_position(parts), new, 0, 2)
    assert r.done == [[3, 0, 250], [3, 400, 650]] and r.part["batch_size"] == 250
    # Every rank's part: the rows they consumed, left out of an epoch planned for the new batches.
    r = resume.resume_of({f"rank_{k}": p for k, p in parts.items()}, new, 1, 2)
    assert (r.done, r.consumed) == ([[3, 0, 250], [3, 400, 650]], {})
    # One rank's own splits are counted in pieces of the old batch size: not enough alone.
    with pytest.raises(ValueError, match="batch_size of 250 instead of 100 or all 2 parts"):
        resume.resume_of({"rank_1": parts[1]}, new, 1, 2)
    r = resume.resume_of({"rank_1": parts[1]}, old, 1, 2)
    assert (r.done, r.consumed) == ([], {4: (2, 50), 9: (0, 1)})


@pytest.mark.parametrize("change, key", [(dict(seed=1), "seed"), (dict(shuffle=True), "shuffle"),
                                         (dict(split_rows=1000), "split_rows"),
                                         (dict(passthrough=["row_id", "label"]), "features")])
def test_another_incompatible_spec_is_refused_naming_the_key(change, key):
    old = spec_of(batch_size=100)
    features = dict(spec_dict(Path("/data/t"))["features"], passthrough=change.pop("passthrough", ["row_id"]))
    new = spec_of(batch_size=100, features=features, **change)
    position = resume.job_position(two_rank_parts(old))
    with pytest.raises(ValueError, match=f"another dataset spec: '{key}' was .*only batch_size may change"):
        resume.resume_of(position, new, 0, 1)
    with pytest.raises(ValueError, match=f"state of rank 0 is of another dataset spec: '{key}'"):
        resume.resume_of({"rank_0": two_rank_parts(old)[0]}, new, 0, 2)


def test_states_this_version_cannot_read_are_refused():
    spec = spec_of()
    with pytest.raises(ValueError, match="version 2, this remoteloader reads versions 3, 4"):
        resume.resume_of({"version": 2, "fingerprint": "f", "plan": "p", "epoch": 0, "done": []}, spec, 0, 1)
    with pytest.raises(ValueError, match=r"missing \['done'\]"):
        resume.resume_of({"version": 3, "spec": resume.spec_keys(spec), "plan": "p", "epoch": 0}, spec, 0, 1)
    with pytest.raises(ValueError, match="disagree on 'epoch'"):
        resume.job_position({0: rank_part(spec, 0, 2, []), 1: rank_part(spec, 1, 2, [], epoch=1)})


def test_a_job_position_in_deterministic_order_resumes_in_place_on_the_same_world_and_batch_size():
    ordered = spec_of(batch_size=100, order={"deterministic": True, "cycle": 2})
    position = resume.job_position(two_rank_parts(ordered))
    same = resume.resume_of(position, ordered, 1, 2)
    assert same.in_place and same.part["done"] == same.done == position["done"]
    # Rank 1's splits of that plan: split 4 of base 3 from row 400 (250 rows consumed), split 9 padding.
    splits = {4: SplitPlan(300, 3, 400, False), 9: SplitPlan(1, 3, 0, True), 5: SplitPlan(300, 4, 0, False)}
    assert resume.consumed_in(same.done, splits, 100) == {4: (2, 50)}
    assert not resume.resume_of(position, ordered, 0, 3).in_place                 # another world size
    assert not resume.resume_of(position, ordered.replace(batch_size=50), 0, 2).in_place
    assert not resume.resume_of(position, spec_of(batch_size=100), 0, 2).in_place  # arrival order
    with pytest.raises(ValueError, match="not a prefix"):
        resume.consumed_in([[3, 10, 20]], {4: SplitPlan(300, 3, 0, False)}, 100)


def test_dcp_keeps_one_job_position_that_a_template_of_any_progress_loads(tmp_path):
    """DCP saves a leaf per key; the job position's keys do not depend on the world size or
    progress, so a fresh loader's state (the template ``dcp.load`` fills) has the same keys."""
    import torch.distributed.checkpoint as dcp

    spec = spec_of(batch_size=100)
    saved = resume.job_position(two_rank_parts(spec))
    dcp.save({"dataloader": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh = resume.job_position({0: rank_part(spec, 0, 1, [], epoch=4)})
    template = {"dataloader": fresh}
    dcp.load(template, checkpoint_id=str(tmp_path), no_dist=True)
    assert template["dataloader"] == saved
    assert resume.read_rank_states(tmp_path) == saved


def test_a_resume_with_another_batch_size_is_exact_and_other_spec_changes_are_refused(tables, inprocess):
    master = inprocess(2)
    spec = spec_dict(tables["orc"], batch_size=100, shuffle=True)
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(15)]
        state = save_load(loader.state_dict())
    with RemoteDataLoader(dict(spec, seed=1), master=master.addr, timeout=60) as loader:
        with pytest.raises(ValueError, match="another dataset spec: 'seed' was 0, this loader's is 1"):
            loader.load_state_dict(state)
    other = inprocess(2)                              # a master serves one spec
    with RemoteDataLoader(dict(spec, batch_size=250), master=other.addr, timeout=60) as loader:
        loader.load_state_dict(state)
        loader.set_epoch(0)                                        # the position's own epoch
        rest = list(loader)
    assert {len(b) for b in rest[:-1]} == {250}
    rows = real_rows(first) + real_rows(rest)
    assert sorted(rows) == list(range(ROWS)) and max(rows.values()) == 1


def test_set_epoch_over_a_loaded_position_of_another_epoch_raises(tables, inprocess):
    master = inprocess(1)
    spec = spec_dict(tables["orc"], batch_size=100)
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        loader.load_state_dict(state)
        with pytest.raises(ValueError, match=r"set_epoch\(1\) after load_state_dict of a position in epoch 0: "
                                             r"call set_epoch\(0\)"):
            loader.set_epoch(1)
        loader.set_epoch(0)
        assert len(list(loader)) == 49                             # 5,000 rows in 100s, one taken before
        loader.set_epoch(3)                                        # the position was resumed: any epoch now
