"""JobState.apply and the journal: live operation and replay are the same code path."""
from __future__ import annotations

import msgspec
import pytest

from remoteloader.formats import DataFile, Unit
from remoteloader.master import updates as U
from remoteloader.master.journal import Journal
from remoteloader.master.state import JobState
from remoteloader.spec import DatasetSpec

SPEC = DatasetSpec.from_dict({"table": "/t", "features": {"dense": ["x"]}, "batch_size": 10})
FILES = [U.file_record(DataFile("f0", "orc", "", 100, 1000, (Unit(0, 0, 50, 500), Unit(1, 50, 50, 500))))]


def splits(rows: list) -> list[U.SplitRecord]:
    return [U.SplitRecord(*row) for row in rows]


_MEMBERSHIP = (U.WorkerRegistered, U.WorkerLost, U.WorkerDraining, U.ClientJoined, U.ClientLeft)


def apply(st: JobState, update: U.Update, cap: int = 32) -> None:
    """Apply as the service commits: a membership change is followed by its partition decision."""
    st.apply(update)
    if isinstance(update, _MEMBERSHIP):
        st.apply(U.PartitionsChanged(sorted([r, m] for r, m in st.balanced_partitions(cap).items())))


def history():
    return [
        U.MasterStarted(0.0),
        U.JobSubmitted(SPEC, "fp", {"x": "float"}, FILES, splits([[0, 0, 1, 50, 50, 0], [0, 1, 2, 50, 50, 50]]), []),
        U.WorkerRegistered("w1", "tcp://a", 1, 0.0),
        U.WorkerRegistered("w2", "tcp://b", 2, 0.0),
        U.ClientJoined("c0", 0, 2, 0.0),
        U.ClientJoined("c1", 1, 2, 0.0),
        U.EpochStarted(0, 0, "c0", 0),
        U.EpochStarted(1, 0, "c1", 0),
        U.SplitAssigned(0, 0, "w1", 0.0),
        U.SplitAssigned(0, 1, "w2", 0.0),
        U.SplitsConsumed(0, 0, [[0, 2]]),
    ]


def test_worker_lost_requeues_its_unfinished_splits_with_consumed_progress():
    st = JobState()
    for u in history():
        apply(st, u)
    assert st.partitions == {0: ["w1", "w2"], 1: ["w1", "w2"]}
    assert st.choose_split("w1") is None  # everything assigned
    apply(st, U.WorkerLost("w1", "test"))
    run, p = st.choose_split("w2")
    assert run.epoch == 0 and p.split.id == 0 and p.consumed == 2 and p.worker is None
    assert st.partitions == {0: ["w2"], 1: ["w2"]}
    st.apply(U.SplitAssigned(0, 0, "w2", 0.0))
    st.apply(U.SplitsConsumed(0, 0, [[0, 5]]))
    assert st.ranks[0].splits[0].done
    assert ("w2" in st.workers) and st.workers["w2"].assigned == {(0, 1)}


def test_journal_survives_a_torn_tail(tmp_path):
    j = Journal(tmp_path)
    for u in history()[:3]:
        j.append(u)
    j.close()
    with open(j.path, "ab") as f:
        f.write(b"\x40\x00\x00\x00partial")
    assert len(list(Journal(tmp_path).replay())) == 3
    j2 = Journal(tmp_path)
    j2.append(U.WorkerLost("w1", "x"))
    j2.close()
    assert [type(u).__name__ for u in Journal(tmp_path).replay()][-1] == "WorkerLost"


def test_rebalance_caps_workers_per_client():
    st = JobState()
    for u in history()[:2]:
        apply(st, u, cap=2)
    for i in range(4):
        apply(st, U.WorkerRegistered(f"w{i}", "a", i, 0.0), cap=2)
    for r in range(4):
        apply(st, U.ClientJoined(f"c{r}", r, 4, 0.0), cap=2)
    assert all(len(m) == 2 for m in st.partitions.values())
    load = {}
    for m in st.partitions.values():
        for w in m:
            load[w] = load.get(w, 0) + 1
    assert sorted(load.values()) == [2, 2, 2, 2]


def test_prefetched_next_epoch_is_taken_over_with_its_progress():
    st = JobState()
    for u in history():
        apply(st, u)
    # Nothing pending in epoch 0: both ranks' next epoch, each reserving its session's next run.
    assert st.prefetch_candidates("w1") == [U.EpochPrefetched(0, 1, "c0", 1), U.EpochPrefetched(1, 1, "c1", 1)]
    apply(st, U.EpochPrefetched(0, 1, "c0", 1))
    run, p = st.choose_split("w1")
    assert (run.epoch, run.session, run.seq) == (1, "c0", 1) and p.split.rank == 0
    apply(st, U.SplitAssigned(1, p.split.id, "w1", 0.0))
    apply(st, U.EpochStarted(0, 1, "c0", 1))  # the trainer reaches epoch 1: the head start stands
    assert st.ranks[0].epoch == 1 and st.ranks[0].splits[p.split.id].worker == "w1"
    assert 0 not in st.prefetched
    apply(st, U.EpochPrefetched(1, 1, "c1", 1))
    apply(st, U.EpochStarted(1, 0, "c1", 2))  # rank 1 restarts epoch 0 instead: the prefetch is dropped
    assert (st.ranks[1].epoch, st.ranks[1].seq) == (0, 2) and 1 not in st.prefetched
    assert st.next_seq["c1"] == 3


def test_damaged_record_is_quarantined_and_the_rest_replayed(tmp_path, caplog):
    j = Journal(tmp_path)
    for u in history()[:3]:
        j.append(u)
    j.close()
    with open(j.path, "ab") as f:                       # a whole record that is not an update
        blob = b"\x93garbage"
        f.write(len(blob).to_bytes(4, "little") + blob)
    j2 = Journal(tmp_path)
    j2.append(U.WorkerLost("w1", "x"))
    j2.close()
    replayed = [type(u).__name__ for u in Journal(tmp_path).replay()]
    assert len(replayed) == 4 and replayed[-1] == "WorkerLost"
    assert "quarantined" in caplog.text and (tmp_path / "journal.quarantine").exists()


def _choose_by_full_scan(st: JobState, worker_id: str):
    """Split choice as it was before the per-rank index: every rank, every split."""
    if st.workers[worker_id].draining:
        return None
    for epochs in (st.ranks, st.prefetched):
        best = None
        for rank, members in sorted(st.partitions.items()):
            re = epochs.get(rank)
            if worker_id not in members or re is None or re.finished or not re.pending:
                continue
            in_flight = sum(1 for p in re.splits.values() if p.worker is not None and not p.done)
            if best is None or in_flight < best[0]:
                best = (in_flight, re, re.splits[re.pending[0]])
        if best is not None:
            return best[1], best[2]
    return None


def test_indexed_split_choice_matches_a_full_scan_through_random_histories():
    import random
    many = [[0, i, i + 1, 20, 20, 20 * i] for i in range(12)]
    for seed in range(20):
        rng = random.Random(seed)
        st = JobState()
        st.apply(U.JobSubmitted(SPEC, "fp", {"x": "float"}, FILES, splits(many), []))
        for i in range(3):
            apply(st, U.WorkerRegistered(f"w{i}", "a", i, 0.0), cap=2)
        sessions = {}
        for r in range(4):
            sessions[r] = f"c{r}"
            apply(st, U.ClientJoined(sessions[r], r, 4, 0.0), cap=2)
            apply(st, U.EpochStarted(r, 0, sessions[r], 0), cap=2)
        n_workers = 3
        for _ in range(300):
            wid = rng.choice(sorted(st.workers))
            roll = rng.random()
            if roll < 0.45:
                chosen = st.choose_split(wid)
                assert chosen == _choose_by_full_scan(st, wid)
                if chosen is not None:
                    st.apply(U.SplitAssigned(chosen[0].epoch, chosen[1].split.id, wid, 0.0))
            elif roll < 0.75:
                rank = rng.randrange(4)
                re = st.ranks.get(rank)
                if re is None:
                    continue
                sid = rng.choice(sorted(re.splits))
                st.apply(U.SplitsConsumed(rank, re.seq, [[sid, rng.randrange(1, 3)]]))
            elif roll < 0.8 and st.workers[wid].assigned:
                epoch, sid = sorted(st.workers[wid].assigned)[0]
                st.apply(U.SplitRevoked(epoch, sid, wid, "test"))
            elif roll < 0.83 and st.workers[wid].assigned:
                epoch, sid = sorted(st.workers[wid].assigned)[0]
                st.apply(U.SplitFailed(epoch, sid, wid, "bad", True))
            elif roll < 0.86 and len(st.workers) > 1:
                apply(st, U.WorkerLost(wid, "test"), cap=2)
            elif roll < 0.89:
                apply(st, U.WorkerRegistered(f"w{n_workers}", "a", n_workers, 0.0), cap=2)
                n_workers += 1
            elif roll < 0.92:  # a new process of the rank: a new session, which starts the epoch again
                rank = rng.randrange(4)
                epoch = st.ranks[rank].epoch if rank in st.ranks else 0
                sessions[rank] = f"c{rank}-{rng.random()}"
                apply(st, U.ClientJoined(sessions[rank], rank, 4, 0.0), cap=2)
                apply(st, U.EpochStarted(rank, epoch, sessions[rank], 0), cap=2)
            elif roll < 0.95:
                rank = rng.randrange(4)
                session = sessions[rank]
                st.apply(U.EpochPrefetched(rank, st.ranks[rank].epoch + 1, session, st.next_seq[session]))
            else:
                rank = rng.randrange(4)
                session = sessions[rank]
                st.apply(U.EpochStarted(rank, st.ranks[rank].epoch + 1, session, st.next_seq[session]))
            for re in [*st.ranks.values(), *st.prefetched.values()]:
                assert re.in_flight == {s for s, p in re.splits.items() if p.worker is not None and not p.done}
        rebuilt = JobState()
        rebuilt.apply(st.snapshot())
        for wid in st.workers:
            assert rebuilt.choose_split(wid) == st.choose_split(wid)
        for rank, re in st.ranks.items():
            assert rebuilt.ranks[rank].in_flight == re.in_flight


def test_snapshot_keeps_a_resumed_epoch_of_a_rank_behind_the_others():
    """Restoring rank 0 (already in the next epoch) must not forget rank 1's resume."""
    many = [[0, i, i + 1, 20, 20, 20 * i] for i in range(6)]
    st = JobState()
    st.apply(U.JobSubmitted(SPEC, "fp", {"x": "float"}, FILES, splits(many), []))
    apply(st, U.WorkerRegistered("w1", "a", 1, 0.0))
    for r in range(2):
        apply(st, U.ClientJoined(f"c{r}", r, 2, 0.0))
    st.apply(U.EpochResumed(3, [[0, 0, 20], [1, 0, 10]]))  # rows consumed before an elastic resume
    for r in range(2):
        st.apply(U.EpochStarted(r, 3, f"c{r}", 0))
    st.apply(U.EpochStarted(0, 4, "c0", 1))  # rank 0 moves on; rank 1 is still in the resumed epoch
    rebuilt = JobState()
    rebuilt.apply(st.snapshot())
    assert {s: p.split for s, p in rebuilt.ranks[1].splits.items()} == \
        {s: p.split for s, p in st.ranks[1].splits.items()}


def eventful_state() -> JobState:
    """A state with something in every part of a snapshot: a file left out, draining and
    busy workers, a replaced session, a resumed epoch, runs with progress and a failure,
    and a prefetched next epoch holding a split."""
    many = [[0, i, i + 1, 20, 20, 20 * i] for i in range(12)]
    st = JobState()
    st.apply(U.JobSubmitted(SPEC, "fp", {"x": "float"}, FILES, splits(many), ["f1 skipped (on_error: skip): bad"]))
    for i in range(3):
        apply(st, U.WorkerRegistered(f"w{i}", f"tcp://h{i}:1", 100 + i, 1.25 * i))
    apply(st, U.ClientJoined("old", 0, 2, 0.5))
    apply(st, U.ClientJoined("c0", 0, 2, 2.5))  # a new process of rank 0 replaces the old session
    apply(st, U.ClientJoined("c1", 1, 2, 3.5))
    st.apply(U.EpochResumed(0, [(0, 0, 10), (3, 0, 5)]))
    st.apply(U.EpochStarted(0, 0, "c0", 0))
    st.apply(U.EpochStarted(1, 0, "c1", 0))
    for wid in ("w0", "w1", "w0", "w1"):
        run, progress = st.choose_split(wid, ahead=False)
        st.apply(U.SplitAssigned(run.epoch, progress.split.id, wid, 4.75))
    held = sorted(st.workers["w0"].assigned)
    st.apply(U.SplitProduced(*held[0], "w0"))
    st.apply(U.SplitFailed(*held[-1], "w0", "damaged stripe", False))
    st.apply(U.SplitsConsumed(0, 0, [(sid, 1) for sid in st.ranks[0].in_flight]))
    apply(st, U.WorkerDraining("w2"))
    st.apply(U.EpochPrefetched(1, 1, "c1", 1))
    st.apply(U.SplitAssigned(1, st.prefetched[1].pending[0], "w1", 6.0))
    return st


def test_a_snapshot_read_back_is_equal_field_by_field():
    st = eventful_state()
    snap = st.snapshot()
    # Every part of the tree holds something, so the comparison below covers it.
    assert snap.replaced == ["old"] and snap.resumed and snap.prefetched and len(snap.errors) == 2
    assert any(w.draining for w in snap.workers) and any(w.assigned for w in snap.workers)
    assert any(p.consumed for r in snap.runs for p in r.progress) and any(p.failed for r in snap.runs for p in r.progress)
    read = U.decode(U.encode(snap))
    for name in snap.__struct_fields__:
        assert getattr(read, name) == getattr(snap, name), name
    rebuilt = JobState()
    rebuilt.apply(read)  # and the state it rebuilds takes the same snapshot
    assert rebuilt.snapshot() == snap
    for wid in st.workers:
        assert rebuilt.choose_split(wid) == st.choose_split(wid)


@pytest.mark.parametrize("change", [
    lambda s: msgspec.structs.replace(s, version=U.SNAPSHOT_VERSION - 1),  # another version
    lambda s: msgspec.structs.replace(JobState().snapshot(), version=U.SNAPSHOT_VERSION + 1),
    # this version, but not of one piece: a progress entry of a split its run does not have
    lambda s: msgspec.structs.replace(s, runs=[msgspec.structs.replace(
        s.runs[0], progress=[*s.runs[0].progress, U.ProgressRecord(999, 1, None, 0.0, False, None)])]),
])
def test_a_snapshot_that_does_not_fit_is_refused_with_the_state_untouched(change):
    st = eventful_state()
    before = st.snapshot()
    with pytest.raises((ValueError, KeyError)):
        st.apply(change(before))
    assert st.snapshot() == before


@pytest.mark.parametrize("damage", [
    lambda raw: raw.pop("workers"),                 # a field of the tree missing
    lambda raw: raw["runs"][0].pop("session"),      # a field of a nested record missing
    lambda raw: raw["job"]["splits"][0].pop(),      # a split row one short
    lambda raw: raw.update(version="3"),            # a field of another type
])
def test_a_snapshot_record_missing_a_field_is_refused_whole(tmp_path, caplog, damage):
    """The journal decodes a snapshot whole, against this version's types: one that lacks
    anything is quarantined before any of it is applied, and the master starts without it."""
    st = eventful_state()
    raw = msgspec.msgpack.decode(U.encode(st.snapshot()))
    damage(raw)
    j = Journal(tmp_path)
    for u in history()[:3]:
        j.append(u)
    j.sync()
    blob = msgspec.msgpack.encode(raw)
    with open(j.path, "ab") as f:
        f.write(len(blob).to_bytes(4, "little") + blob)
    j.close()
    with pytest.raises(msgspec.ValidationError):
        U.decode(blob)
    replayed = JobState()
    for u in Journal(tmp_path).replay():
        replayed.apply(u)
    expected = JobState()
    for u in history()[:3]:
        expected.apply(u)
    assert replayed.snapshot() == expected.snapshot()
    assert "quarantined" in caplog.text and (tmp_path / "journal.quarantine").exists()
