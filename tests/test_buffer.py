"""BatchBuffer: backpressure for the epoch being read, never for a prefetched next one."""
from __future__ import annotations

import threading

from remoteloader.worker.buffer import BatchBuffer
from remoteloader.core.processor import Piece


def piece(i: int, split_id: int = 0) -> Piece:
    return Piece(split_id, i, 1, None, i, i + 1)


def test_current_epoch_blocks_when_full_prefetched_epoch_does_not():
    buf, stop = BatchBuffer(2), threading.Event()
    buf.drop_before(rank=0, epoch=0)  # the client of rank 0 reads epoch 0
    assert buf.put((0, 0), piece(0), stop) and buf.put((0, 0), piece(1), stop)
    for i in range(5):  # next epoch: never waits, and does not count against the room
        assert buf.put((0, 1), piece(i), stop)
    assert len(buf) == 7 and buf.ahead_count() == 5
    blocked = threading.Thread(target=buf.put, args=((0, 0), piece(2), stop))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # the current epoch is full: backpressure
    assert buf.pop((0, 0)).index == 0
    blocked.join(2)
    assert not blocked.is_alive()
    buf.drop_before(rank=0, epoch=1)  # the client moves on: epoch 0 leftovers go, epoch 1 is current
    assert buf.ahead_count() == 0 and len(buf) == 5
    stop.set()
    assert not buf.wait_for_room(stop)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_rank_holds_at_most_its_share():
    clock, stop = FakeClock(), threading.Event()
    buf = BatchBuffer(8, silent_after_s=30, clock=clock)
    for rank in (0, 1):
        buf.drop_before(rank, 0)
        assert buf.put((rank, 0), piece(0), stop) == "stored"
        buf.heard_from(rank)
    for i in range(1, 4):  # rank 1 fills its half and stops reading
        assert buf.put((1, 0), piece(i), stop) == "stored"
    assert buf.blocked_ranks() == [1]
    blocked = threading.Thread(target=buf.put, args=((1, 0), piece(4), stop))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # rank 1 is at its share of 4...
    assert buf.put((0, 0), piece(1), stop) == "stored"  # ...while rank 0 still has room
    stop.set()
    blocked.join(2)


def test_a_producer_blocked_on_a_full_share_yields_to_a_starving_rank():
    stop = threading.Event()
    buf = BatchBuffer(4, silent_after_s=30)
    for rank in (0, 1):
        buf.drop_before(rank, 0)
    for i in range(2):
        assert buf.put((1, 0), piece(i), stop) == "stored"
    buf.put((0, 0), piece(0), stop)
    buf.heard_from(0), buf.heard_from(1)
    assert buf.pop((0, 0)) is not None
    buf.set_hungry(frozenset({0}))  # rank 0 asks and nothing is buffered for it
    assert buf.put((1, 0), piece(2), stop) == "yielded"
    buf.set_hungry(frozenset({1}))  # only the blocked rank itself waits: no reason to yield
    blocked = threading.Thread(target=buf.put, args=((1, 0), piece(2), stop))
    blocked.start()
    blocked.join(0.8)
    assert blocked.is_alive()
    stop.set()
    blocked.join(2)


def test_a_silent_rank_is_released_and_taken_back_when_it_asks():
    clock, stop = FakeClock(), threading.Event()
    buf = BatchBuffer(8, silent_after_s=30, clock=clock)
    buf.drop_before(0, 0), buf.drop_before(1, 0)
    for i in range(3):
        buf.put((1, 0), piece(i, 7 + i % 2), stop)
    buf.put((0, 0), piece(0), stop)
    clock.now = 20
    buf.heard_from(0)  # rank 0 reads; rank 1 says nothing
    assert buf.release_silent() == []
    clock.now = 31
    assert buf.release_silent() == [(0, 7), (0, 8)]  # (epoch, split) the master must hand out again
    assert len(buf) == 1 and buf.pop((0, 0)) is not None
    assert buf.put((1, 0), piece(9), stop) == "released"  # nothing is kept for a silent rank
    assert buf.blocked_ranks() == [1]
    buf.heard_from(1)  # it is back
    assert buf.put((1, 0), piece(9), stop) == "stored" and buf.blocked_ranks() == []


def test_pieces_put_back_come_out_first_in_their_order():
    buf, stop = BatchBuffer(8), threading.Event()
    buf.drop_before(0, 0)
    for i in range(4):
        buf.put((0, 0), piece(i), stop)
    taken = [buf.pop((0, 0)) for _ in range(3)]
    buf.put_back((0, 0), taken)
    assert [buf.pop((0, 0)).index for _ in range(4)] == [0, 1, 2, 3] and len(buf) == 0
