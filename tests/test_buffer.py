"""PieceBuffer: pieces keyed by run (session, seq); staleness per session, never across
sessions by number; backpressure for the run being read, never for a prefetched one."""
from __future__ import annotations

import threading

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
