"""Credit-based flow control: the client's window and the worker's per-client credit."""
from __future__ import annotations

import random

import pytest
import zmq

from remoteloader.client.credit import CreditWindow
from remoteloader.client.fetch import Stream, WorkerFetcher
from remoteloader.client.session import RunId
from remoteloader.protocol.rpc import BACKOFF_MAX_S, backoff_delay
from remoteloader.worker.credit import Credit


def test_window_starts_at_inflight_per_worker_and_doubles_when_credit_was_the_limit():
    window = CreditWindow(initial_per_worker=2, max_bytes=1 << 20)
    window.fit(3)
    assert window.pieces == 6
    window.starved()
    window.starved()
    assert window.pieces == 24 and window.grown == 2
    window.fit(1)  # a smaller partition never shrinks what was learned
    assert window.pieces == 24


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_window_for_batches_mixing_lanes_holds_the_next_piece_of_every_lane_however_few_the_workers():
    # mix_splits 8 on 2 workers: all 8 lanes want their next piece at the same batch.
    clock = Clock()
    window = CreditWindow(initial_per_worker=2, max_bytes=1 << 30, period_s=5.0, clock=clock, lanes=8)
    window.fit(2)
    assert window.pieces == 16
    window.starved()
    assert window.pieces == 32
    for _ in range(4):  # full queues for many periods: it halves back to the lanes' floor, not the workers'
        clock.now += 6.0
        window.queued(3)
    assert window.pieces == 16 and window.shrunk == 1
    window.fit(12)  # more workers than lanes: per worker again
    assert window.pieces == 24
    assert CreditWindow(2, 1 << 30, lanes=8).pieces == 2  # nothing granted before fit knows the partition


def test_window_halves_back_to_its_initial_size_while_the_loop_never_waits():
    clock = Clock()
    window = CreditWindow(initial_per_worker=2, max_bytes=1 << 20, period_s=5.0, clock=clock)
    window.fit(2)
    for _ in range(3):
        window.starved()  # a burst: 4 -> 32
    assert window.pieces == 32
    sizes = []
    for _ in range(5):  # then a slow loop: a batch is always queued for it
        for _ in range(10):
            clock.now += 0.5
            window.queued(1)
        sizes.append(window.pieces)
    assert sizes == [16, 8, 4, 4, 4] and window.shrunk == 3  # never below inflight x workers


def test_window_keeps_its_size_when_the_loop_waited_in_the_period():
    clock = Clock()
    window = CreditWindow(initial_per_worker=2, max_bytes=1 << 20, period_s=5.0, clock=clock)
    window.fit(1)
    window.starved()
    window.starved()
    for queued in (8, 3, 0, 8, 8):  # one wait (nothing queued): the window may be needed
        clock.now += 1.0
        window.queued(queued)
    assert window.pieces == 8 and window.shrunk == 0
    clock.now += 4.5  # a queue long for less than a whole period is not enough either
    window.queued(8)
    assert window.pieces == 8
    clock.now += 0.5
    window.queued(8)
    assert window.pieces == 4 and window.shrunk == 1


def test_the_fetcher_samples_the_queue_at_each_top_up_and_grants_less_once_the_window_shrank():
    clock = Clock()
    window = CreditWindow(initial_per_worker=2, max_bytes=1 << 20, period_s=5.0, clock=clock)
    ctx = zmq.Context.instance()
    worker = ctx.socket(zmq.ROUTER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.bind("tcp://127.0.0.1:*")
    fetcher = WorkerFetcher(ctx, 0, RunId("s-1", 0, 0, "t"), window, ["s0"])
    try:
        fetcher.set_workers([["w-1", worker.getsockopt(zmq.LAST_ENDPOINT).decode()]])
        window.starved()
        window.starved()  # a burst: 2 -> 8
        fetcher.top_up(0)
        stream = fetcher.streams["w-1"]
        assert stream.granted == 8
        stream.arrived(8, 8000, held=4, window=window)  # all of it, and the loop is slow
        for _ in range(10):  # the period of the first top-up (nothing queued), then one with 7 queued
            clock.now += 1.0
            fetcher.top_up(7)  # less than a chunk of the window is free: nothing is granted
        assert window.pieces == 4 and stream.granted == 8
        fetcher.top_up(3)
        assert stream.granted == 9  # the free quarter of 4, not 5 of 8
    finally:
        fetcher.close()
        worker.close(linger=0)


def test_window_is_capped_by_prefetch_bytes_at_the_measured_piece_size():
    window = CreditWindow(initial_per_worker=2, max_bytes=100_000)
    window.fit(2)
    for _ in range(10):
        window.arrived(1, 10_000)
    for _ in range(20):
        window.starved()
    assert window.pieces == 10 == window.cap  # 100 kB of 10 kB pieces
    for _ in range(64):
        window.arrived(1, 50_000)  # pieces got bigger: the window shrinks to stay within the bound
    assert window.pieces == window.cap == 2


def test_window_rejects_nonsense():
    with pytest.raises(ValueError, match="inflight"):
        CreditWindow(0, 1 << 20)
    with pytest.raises(ValueError, match="prefetch_bytes"):
        CreditWindow(2, 0)


def test_worker_credit_is_a_running_total_so_repeats_and_reordering_change_nothing():
    credit = Credit()
    credit.grant(4, 1000)
    credit.grant(2, 500)  # a late, older grant
    credit.grant(4, 1000)  # a repeat
    sent = 0
    while credit.open:
        credit.spend(1, 100)
        sent += 1
    assert sent == 4  # pieces ran out first (400 of 1000 bytes sent)
    credit.grant(20, 1000)  # more pieces, same byte total: bytes now bound it
    while credit.open:
        credit.spend(1, 100)
        sent += 1
    assert sent == 10 and credit.sent_bytes == 1000
    credit.grant(20, 1500)
    assert credit.open


def test_a_piece_larger_than_the_byte_credit_left_still_goes():
    credit = Credit()
    credit.grant(2, 10)
    assert credit.open
    credit.spend(1, 1 << 20)
    assert not credit.open  # and then the bytes are spent


def test_client_stream_counts_what_is_in_flight():
    window = CreditWindow(2, 1 << 20)
    stream = Stream()
    stream.granted, stream.granted_bytes = 5, 5000
    stream.arrived(1, 1000, held=3, window=window)
    assert stream.in_flight == 4 and stream.in_flight_bytes == 4000 and stream.held == 3
    stream.arrived(3, 3000, held=0, window=window)  # one message of three pieces
    assert stream.in_flight == 1 and stream.in_flight_bytes == 1000 and window.piece_bytes == 1000


def test_credit_open_after_counts_what_one_message_would_take():
    credit = Credit()
    credit.grant(3, 10_000)
    assert credit.open_after(2, 200) and not credit.open_after(3, 300) and not credit.open_after(1, 10_000)
    credit.spend(3, 300)
    assert not credit.open


def test_backoff_grows_is_capped_and_jittered():
    rng = random.Random(1)
    delays = [backoff_delay(n, 0.25, rng) for n in range(12)]
    assert all(0 < d <= 1.5 * BACKOFF_MAX_S for d in delays)
    assert delays[0] < 0.5 and delays[-1] > BACKOFF_MAX_S / 2
    assert len({round(backoff_delay(3, 0.25, rng), 6) for _ in range(20)}) > 1  # not in step
