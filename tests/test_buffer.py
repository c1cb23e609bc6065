"""PieceBuffer: pieces keyed by run (session, seq); staleness per session, never across
sessions by number; backpressure for the run being read, never for a prefetched one."""
from __future__ import annotations

import threading

import numpy as np

from remoteloader.core.processor import Piece
from remoteloader.worker.buffer import STORED, PieceBuffer
from remoteloader.worker.runs import Run


def piece(i: int, split_id: int = 0) -> Piece:
    return Piece(split_id, i, 1, None, i, i + 1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fill(buf: PieceBuffer, run: Run, n: int, split_id: int = 0) -> None:
    buf.admit(run)
    for i in range(n):
        assert buf.put(run, piece(i, split_id), threading.Event()) == STORED


def test_current_run_blocks_when_full_prefetched_run_does_not():
    buf, stop = PieceBuffer(2), threading.Event()
    now, ahead = Run("s", 0, rank=0, epoch=0), Run("s", 1, rank=0, epoch=1)
    assert buf.credited(now.id)  # the client of rank 0 reads run 0
    fill(buf, now, 2)
    fill(buf, ahead, 5)  # its next run: never waits, and does not count against the room
    assert len(buf) == 7 and buf.ahead_count() == 5
    blocked = threading.Thread(target=buf.put, args=(now, piece(2), stop))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # the current run is full: backpressure
    assert buf.pop(now.id).index == 0
    blocked.join(2)
    assert not blocked.is_alive()
    assert buf.credited(ahead.id)  # the client moves on: run 0 leftovers go, run 1 is current
    assert buf.ahead_count() == 0 and len(buf) == 5
    assert buf.discarded() == {"stale_run": 2} and buf.take_released() == {"stale_run": [(0, 0)]}
    stop.set()
    assert not buf.wait_for_room(stop)


def test_epochs_0_1_0_of_one_session_never_discard_the_live_run():
    buf = PieceBuffer(8)
    runs = [Run("s", seq, rank=0, epoch=epoch) for seq, epoch in enumerate((0, 1, 0))]
    for run in runs:
        assert buf.credited(run.id)
        fill(buf, run, 3, split_id=10 + run.seq)
    # Epoch 0 again (seq 2) is the newest run, whatever its epoch number: it keeps its pieces.
    assert buf.held(runs[2].id) == 3 and len(buf) == 3
    assert buf.discarded() == {"stale_run": 6}
    assert buf.take_released() == {"stale_run": [(0, 10), (1, 11)]}
    assert [buf.pop(runs[2].id).index for _ in range(3)] == [0, 1, 2]


def test_a_piece_of_a_stale_run_is_dropped_never_stored():
    buf, stop = PieceBuffer(8), threading.Event()
    old, new = Run("s", 0, rank=0, epoch=0), Run("s", 1, rank=0, epoch=1)
    assert buf.admit(old) is None
    assert buf.put(old, piece(0), stop) == STORED
    assert buf.credited(new.id)  # the client moved on while the split was produced
    outcome = buf.put(old, piece(1), stop)
    assert outcome.dropped and outcome.reason == "stale_run"
    assert buf.admit(old) == "stale_run"  # a late task of the old run is not produced at all
    assert not buf.credited(old.id)  # nor is late credit for it taken
    assert len(buf) == 0 and buf.discarded() == {"stale_run": 2}


def test_a_new_session_of_the_same_rank_makes_the_old_sessions_pieces_stale():
    buf, stop = PieceBuffer(8), threading.Event()
    job_a, job_b = Run("a", 0, rank=0, epoch=1), Run("b", 0, rank=0, epoch=0)
    other_rank = Run("c", 0, rank=1, epoch=5)
    fill(buf, job_a, 2, split_id=3)
    fill(buf, other_rank, 1)
    assert buf.admit(job_b) is None  # job B's rank 0 (epoch 0 after job A's epoch 1)
    assert buf.put(job_b, piece(0), stop) == STORED
    assert buf.held(job_a.id) == 0 and buf.held(other_rank.id) == 1 and buf.held(job_b.id) == 1
    assert buf.take_released() == {"session_gone": [(1, 3)]}
    outcome = buf.put(job_a, piece(2, 3), stop)
    assert outcome.dropped and outcome.reason == "session_gone"
    assert buf.discarded() == {"session_gone": 3}


def test_sessions_the_master_no_longer_lists_are_gone_but_not_those_seen_since_the_request():
    buf = PieceBuffer(8)
    fill(buf, Run("a", 0, rank=0, epoch=0), 1)
    mark = buf.mark()  # a heartbeat goes out...
    fill(buf, Run("b", 0, rank=1, epoch=0), 1)  # ...a session the master issued meanwhile...
    buf.keep_sessions([], mark)  # ...is missing from the reply, which predates it
    assert buf.held(("a", 0)) == 0 and buf.held(("b", 0)) == 1
    assert buf.take_released() == {"session_gone": [(0, 0)]}


def test_pieces_put_back_into_a_run_gone_stale_are_discarded():
    buf = PieceBuffer(8)
    run = Run("s", 0, rank=0, epoch=0)
    fill(buf, run, 2)
    taken = [buf.pop(run.id), buf.pop(run.id)]
    assert buf.credited(("s", 1))
    buf.put_back(run.id, taken)
    assert len(buf) == 0 and buf.discarded() == {"stale_run": 2}
    assert buf.take_released() == {"stale_run": [(0, 0)]}


def test_a_rank_holds_at_most_its_share():
    clock, stop = FakeClock(), threading.Event()
    buf = PieceBuffer(8, silent_after_s=30, clock=clock)
    runs = [Run(f"s{rank}", 0, rank=rank, epoch=0) for rank in (0, 1)]
    for run in runs:
        buf.credited(run.id)
        fill(buf, run, 1)
    for i in range(1, 4):  # rank 1 fills its half and stops reading
        assert buf.put(runs[1], piece(i), stop) == STORED
    assert buf.blocked_ranks() == [1]
    blocked = threading.Thread(target=buf.put, args=(runs[1], piece(4), stop))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # rank 1 is at its share of 4...
    assert buf.put(runs[0], piece(1), stop) == STORED  # ...while rank 0 still has room
    stop.set()
    blocked.join(2)


def test_a_producer_blocked_on_a_full_share_yields_to_a_starving_rank():
    stop = threading.Event()
    buf = PieceBuffer(4, silent_after_s=30)
    runs = [Run(f"s{rank}", 0, rank=rank, epoch=0) for rank in (0, 1)]
    for run in runs:
        buf.credited(run.id)
    fill(buf, runs[1], 2)
    fill(buf, runs[0], 1)
    assert buf.pop(runs[0].id) is not None
    buf.set_hungry({runs[0].id})  # rank 0 holds credit and nothing is buffered for it
    outcome = buf.put(runs[1], piece(2), stop)
    assert outcome.dropped and outcome.reason == "yielded"
    buf.set_hungry({runs[1].id})  # only the blocked run itself waits: no reason to yield
    blocked = threading.Thread(target=buf.put, args=(runs[1], piece(2), stop))
    blocked.start()
    blocked.join(0.8)
    assert blocked.is_alive()
    stop.set()
    blocked.join(2)


def test_a_silent_session_is_released_and_taken_back_when_it_credits():
    clock, stop = FakeClock(), threading.Event()
    buf = PieceBuffer(8, silent_after_s=30, clock=clock)
    reading, silent = Run("r", 0, rank=0, epoch=0), Run("q", 0, rank=1, epoch=0)
    buf.credited(reading.id), buf.credited(silent.id)
    buf.admit(silent)
    for i in range(3):
        buf.put(silent, piece(i, 7 + i % 2), stop)
    fill(buf, reading, 1)
    clock.now = 20
    buf.credited(reading.id)  # rank 0 reads; rank 1 says nothing
    buf.release_silent()
    assert buf.take_released() == {}
    clock.now = 31
    buf.release_silent()
    assert buf.take_released() == {"silent": [(0, 7), (0, 8)]}  # (epoch, split) the master hands out again
    assert len(buf) == 1 and buf.pop(reading.id) is not None
    outcome = buf.put(silent, piece(9), stop)
    assert outcome.dropped and outcome.reason == "silent"  # nothing is kept for a silent session
    assert buf.blocked_ranks() == [1]
    assert buf.discarded() == {"silent": 4}
    buf.credited(silent.id)  # it is back
    assert buf.put(silent, piece(9), stop) == STORED and buf.blocked_ranks() == []


def test_pieces_put_back_come_out_first_in_their_order():
    buf = PieceBuffer(8)
    run = Run("s", 0, rank=0, epoch=0)
    fill(buf, run, 4)
    taken = [buf.pop(run.id) for _ in range(3)]
    buf.put_back(run.id, taken)
    assert [buf.pop(run.id).index for _ in range(4)] == [0, 1, 2, 3] and len(buf) == 0


def test_a_job_change_discards_everything_without_handing_splits_back():
    buf = PieceBuffer(8)
    fill(buf, Run("s", 0, rank=0, epoch=0), 3)
    buf.discard_all("wrong_job")
    assert len(buf) == 0 and buf.discarded() == {"wrong_job": 3} and buf.take_released() == {}


# -- bytes: what the worker holds is whole transformed splits ------------------------------
class Split:
    """A stand-in for a TransformedSplit: the buffer reads only its tensors' bytes."""

    def __init__(self, nbytes: int) -> None:
        self.tensors = {"labels": np.zeros(nbytes, np.uint8)}


def put_split(buf: PieceBuffer, run: Run, split: Split, pieces: int, split_id: int = 0, done: bool = True) -> None:
    buf.admit(run)
    for i in range(pieces):
        assert buf.put(run, Piece(split_id, i, 1, split, i, i + 1), threading.Event()) == STORED
    if done:
        buf.finished(split)


def room(buf: PieceBuffer) -> bool:
    """Whether wait_for_room returns at once (it waits while there is none)."""
    done, stop = threading.Event(), threading.Event()
    waiter = threading.Thread(target=lambda: buf.wait_for_room(stop) and done.set())
    waiter.start()
    waiter.join(0.3)
    stop.set()
    waiter.join(2)
    return done.is_set()


def test_a_split_is_held_from_its_first_piece_until_its_last_leaves():
    buf = PieceBuffer(64, budget_bytes=10_000)
    run, split = Run("s", 0, rank=0, epoch=0), Split(1000)
    assert buf.credited(run.id)
    buf.admit(run)
    assert buf.put(run, Piece(0, 0, 1, split, 0, 1), threading.Event()) == STORED
    assert buf.held_bytes() == 1000  # the whole split, from its first piece
    buf.pop(run.id)
    assert buf.held_bytes() == 1000  # nothing buffered, but the producer still cuts it
    put_split(buf, run, split, 3)  # the rest of it; the producer is done with it
    assert buf.held_bytes() == 1000 and buf.byte_stats() == {"held_bytes": 1000, "ahead_bytes": 0,
                                                              "budget_bytes": 10_000}
    taken = [buf.pop(run.id), buf.pop(run.id)]
    assert buf.held_bytes() == 1000
    buf.put_back(run.id, taken)  # not sent after all
    for _ in range(3):
        buf.pop(run.id)
    assert buf.held_bytes() == 0  # its last piece left
    buf.put_back(run.id, taken[1:])  # a piece put back after that: held again while it waits
    assert buf.held_bytes() == 1000
    buf.pop(run.id)
    assert buf.held_bytes() == 0


def test_held_bytes_are_current_or_ahead_and_a_stale_runs_go_with_its_pieces():
    buf = PieceBuffer(64, budget_bytes=10_000)
    now, ahead = Run("s", 0, rank=0, epoch=0), Run("s", 1, rank=0, epoch=1)
    assert buf.credited(now.id)
    put_split(buf, now, Split(1000), 2, split_id=3)
    put_split(buf, ahead, Split(300), 2, split_id=4)  # a next epoch read ahead
    assert (buf.held_bytes(), buf.ahead_bytes()) == (1300, 300)
    assert buf.credited(ahead.id)  # the client moves on: run 0's pieces are discarded, run 1 is current
    assert (buf.held_bytes(), buf.ahead_bytes()) == (300, 0)
    assert buf.take_released() == {"stale_run": [(0, 3)]}


def test_dropped_and_discarded_splits_are_no_longer_held():
    clock = FakeClock()
    buf = PieceBuffer(64, silent_after_s=30, clock=clock, budget_bytes=10_000)
    old, new = Run("a", 0, rank=0, epoch=0), Run("a", 1, rank=0, epoch=1)
    assert buf.credited(old.id)
    # A piece dropped as the client moved on mid-split: once the producer gives the split
    # up, nothing of it is held.
    split = Split(700)
    put_split(buf, old, split, 2, done=False)
    assert buf.credited(new.id)
    outcome = buf.put(old, Piece(0, 2, 1, split, 2, 3), threading.Event())
    assert outcome.dropped and buf.held_bytes() == 700  # still the producer's
    buf.finished(split)
    assert buf.held_bytes() == 0
    # Sessions the master no longer lists, silent sessions, and a job change.
    gone, silent, other = Run("g", 0, rank=1, epoch=0), Run("q", 0, rank=2, epoch=0), Run("o", 0, rank=3, epoch=0)
    for run, nbytes in ((gone, 100), (silent, 200), (other, 400)):
        assert buf.credited(run.id)
        put_split(buf, run, Split(nbytes), 2)
    assert buf.held_bytes() == 700
    mark = buf.mark()
    buf.keep_sessions(["a", "q", "o"], mark)
    assert buf.held_bytes() == 600
    clock.now = 31
    buf.credited(new.id), buf.credited(other.id)
    buf.release_silent()
    assert buf.held_bytes() == 400
    buf.discard_all("wrong_job")
    assert buf.held_bytes() == 0 and len(buf) == 0


def test_a_new_split_is_taken_only_while_held_bytes_and_the_next_fit():
    buf = PieceBuffer(64, budget_bytes=2500)
    run = Run("s", 0, rank=0, epoch=0)
    assert buf.credited(run.id)
    assert room(buf)
    put_split(buf, run, Split(1000), 2, split_id=0)
    assert room(buf)  # 1000 held + 1000 (the largest split seen) fit 2500
    put_split(buf, run, Split(1000), 2, split_id=1)
    assert not room(buf)  # 2000 + 1000 do not
    buf.pop(run.id)
    assert not room(buf)  # split 0 still has a piece here
    buf.pop(run.id)
    assert room(buf) and buf.held_bytes() == 1000
    # A split larger than the whole budget is still taken when nothing is held, alone.
    big = PieceBuffer(64, budget_bytes=500)
    assert big.credited(run.id)
    put_split(big, run, Split(1000), 1)
    assert not room(big)
    big.pop(run.id)
    assert big.held_bytes() == 0 and room(big)


def test_reading_ahead_only_within_the_budget_leaving_a_splits_room():
    buf = PieceBuffer(64, budget_bytes=2500)
    now, ahead = Run("s", 0, rank=0, epoch=0), Run("s", 1, rank=0, epoch=1)
    assert buf.credited(now.id)
    assert not buf.room_to_read_ahead()  # no split seen: no estimate
    buf.expect_split_bytes(1000)  # the master's estimate of the job's largest split
    assert buf.room_to_read_ahead()  # 0 + 2 x 1000 <= 2500
    put_split(buf, now, Split(600), 1)
    assert not buf.room_to_read_ahead()  # 600 + 2000 > 2500: the room is the current epoch's
    buf.pop(now.id)
    put_split(buf, ahead, Split(1000), 3)  # read ahead
    assert not buf.room_to_read_ahead() and buf.ahead_bytes() == 1000
    assert room(buf)  # and room for the current epoch is left: 1000 + 1000 <= 2500
    # Even when the estimate outgrows what is left, a split read ahead alone never keeps the
    # worker from the epoch it waits for.
    buf.expect_split_bytes(2000)
    assert room(buf)
    put_split(buf, now, Split(2000), 1)
    assert not room(buf)


def test_a_rank_with_nothing_held_may_overshoot_the_budget_up_to_the_hard_limit():
    buf = PieceBuffer(64, budget_bytes=2000)
    runs = [Run(f"s{rank}", 0, rank=rank, epoch=0) for rank in (0, 1)]
    for run in runs:
        assert buf.credited(run.id)
    put_split(buf, runs[0], Split(1000), 2, split_id=0)  # rank 0 stopped reading with these
    put_split(buf, runs[0], Split(1000), 2, split_id=1)
    assert not room(buf)
    buf.set_hungry({runs[0].id})  # rank 0 itself waiting holds the room: no reason to overshoot
    assert not room(buf)
    buf.set_hungry({runs[1].id})  # rank 1 waits with nothing buffered or held
    assert room(buf)  # 2000 + 1000 <= 2 x 2000
    put_split(buf, runs[1], Split(1000), 2, split_id=2)
    assert not room(buf)  # rank 1 holds a split now: nobody starves, the budget holds again
