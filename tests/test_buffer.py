"""BatchBuffer: backpressure for the epoch being read, never for a prefetched next one."""
from __future__ import annotations

import threading

from remoteloader.worker.buffer import BatchBuffer
from remoteloader.core.processor import Piece


def piece(i: int) -> Piece:
    return Piece(0, i, 1, {})


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
