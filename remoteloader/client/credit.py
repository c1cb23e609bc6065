"""How far ahead of the training loop the client lets its workers push: the credit window.

The client grants its workers credit (pieces and bytes, see protocol.md); the window
is what it keeps granted ahead of the training loop, split evenly over its partition.
It starts at ``initial`` pieces per worker and is sized by what the client observes:
when the training loop has to wait while a worker holds pieces for it (the worker's
last piece said ``held`` > 0) and every piece granted to that worker has arrived, the
worker had data and no credit to send it. That wait is the window's fault, and the
window doubles. A wait with credit still out at every worker that holds data is not
(the pieces are on their way), and a wait on workers that hold nothing is theirs:
more credit would not help, more workers would, which is the autoscaler's business.

The window halves again when, for a whole period (``period_s``), the training loop
never emptied its queue: at every top-up of credit another batch waited beyond the one
it was taking, so the window held more than the loop needed (after a burst, or while the loop is slow or idle), and
keeping it would keep a burst's worth of data waiting in memory. If half is too little,
the next wait on credit doubles it back, so the window stays within a factor of two of
what the loop needs. It never shrinks below ``initial`` per worker of the partition, nor
below ``initial`` per lane when batches mix ``lanes`` sources (``mix_splits`` K, or the
tables mixed by weight): every lane's piece serves the same run of batches, so all K lanes
want their next piece at the same batch, and a window smaller than that burst stalls the
loop once a piece's worth of batches (it grew back only after such a stall, and a period
of full queues halved it again).

The window never holds more than ``max_bytes`` of batches at the measured mean piece
size, so memory stays bounded whatever the batch size.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

SHRINK_PERIOD_S = 5.0


class CreditWindow:
    def __init__(self, initial_per_worker: int, max_bytes: int, period_s: float = SHRINK_PERIOD_S,
                 clock: Callable[[], float] = time.monotonic, lanes: int = 1) -> None:
        if initial_per_worker < 1:
            raise ValueError(f"inflight must be >= 1, got {initial_per_worker}")
        if max_bytes < 1:
            raise ValueError(f"prefetch_bytes must be >= 1, got {max_bytes}")
        self.initial_per_worker = initial_per_worker
        self.lanes = max(1, lanes)  # sources every batch takes rows of (see the module's docstring)
        self.max_bytes = max_bytes  # bytes the workers may push beyond what has arrived, over the partition
        self.period_s, self.clock = period_s, clock
        self.reset()

    def get_state(self) -> dict:
        """What the window learned (kept across epochs): its size and floor, the mean piece
        size and how many pieces that mean is of (up to the 64 it weighs), and where its
        shrink period stands."""
        least = None if self._least_queued == math.inf else self._least_queued
        return {"pieces": self.pieces, "floor": self._floor, "piece_bytes": self.piece_bytes,
                "arrived": min(self._arrived, 64), "grown": self.grown, "shrunk": self.shrunk,
                "period_elapsed_s": self.clock() - self._period_start, "least_queued": least}

    def reset(self, state: Optional[dict] = None) -> None:
        """Back to ``state`` (``get_state()``), or to ``initial`` per worker."""
        state = state or {}
        self._floor = int(state.get("floor", self.initial_per_worker))  # initial x workers or lanes (fit)
        self.pieces = max(self._floor, int(state.get("pieces", self.initial_per_worker)))  # the window in pieces
        self.piece_bytes = float(state.get("piece_bytes", 0.0))  # running mean size of a piece
        self._arrived = int(state.get("arrived", 0))
        self.grown = int(state.get("grown", 0))  # times the window doubled (what the benchmarks report)
        self.shrunk = int(state.get("shrunk", 0))  # times it halved
        # The shrink period in progress: how far into it, and the shortest queue sampled in it.
        self._period_start = self.clock() - float(state.get("period_elapsed_s", 0.0))
        least = state.get("least_queued")
        self._least_queued: float = math.inf if least is None else least

    def fit(self, workers: int) -> None:
        """At least ``initial`` per worker of the partition, and per lane (it may have grown
        past that)."""
        self._floor = self.initial_per_worker * max(1, workers, self.lanes)
        self.pieces = min(self.cap, max(self.pieces, self._floor))

    def arrived(self, pieces: int, nbytes: int) -> None:
        """``pieces`` arrived in one message of ``nbytes``."""
        self._arrived += pieces
        self.piece_bytes += (nbytes / pieces - self.piece_bytes) * min(1.0, pieces / min(self._arrived, 64))
        self.pieces = min(self.pieces, self.cap)

    def starved(self) -> None:
        """The training loop waited on a worker that held pieces and had no credit left."""
        if self.pieces < self.cap:
            self.pieces = min(self.cap, 2 * self.pieces)
            self.grown += 1

    def queued(self, batches: int) -> None:
        """``batches`` wait for the training loop now (sampled at each top-up of credit; 0 when
        it waits or takes the last one); after a period without a 0, the window halves."""
        now = self.clock()
        self._least_queued = min(self._least_queued, batches)
        if now - self._period_start < self.period_s:
            return
        if self._least_queued > 0 and self.pieces > self._floor:
            self.pieces = max(self._floor, self.pieces // 2)
            self.shrunk += 1
        self._period_start, self._least_queued = now, batches

    @property
    def cap(self) -> int:
        if not self.piece_bytes:
            return 1 << 16
        return max(1, int(self.max_bytes // self.piece_bytes))
