"""How far ahead of the training loop the client lets its workers push: the credit window.

The client grants its workers credit (pieces and bytes, see protocol.md); the window
is the most it keeps granted-but-not-yet-consumed across its partition. It starts at
``initial`` pieces per worker and grows from what the client measures: whenever the
training loop had to wait while the whole window was out (every granted piece in
flight or queued, none ready), credit was the limit, and the window doubles. Nothing
grows it when the workers themselves are slow (credit left over while waiting): more
credit would not help, more workers would, which is the autoscaler's business.

The window never holds more than ``max_bytes`` of batches, measured from the pieces
that arrive (an average of their sizes), so memory stays bounded whatever the batch
size.
"""
from __future__ import annotations

import math


class CreditWindow:
    def __init__(self, initial_per_worker: int, max_bytes: int) -> None:
        if initial_per_worker < 1:
            raise ValueError(f"inflight must be >= 1, got {initial_per_worker}")
        if max_bytes < 1:
            raise ValueError(f"prefetch_bytes must be >= 1, got {max_bytes}")
        self.initial_per_worker = initial_per_worker
        self.max_bytes = max_bytes
        self.pieces = 0  # the window in pieces; 0 until the partition is known
        self.piece_bytes = 0.0  # running mean size of a piece
        self._arrived = 0
        self.grown = 0  # times the window doubled (reported, for the autoscaler and benchmarks)

    def fit(self, workers: int) -> None:
        """At least ``initial`` per worker of the partition (it may have grown)."""
        self.pieces = min(self.cap, max(self.pieces, self.initial_per_worker * max(1, workers)))

    @property
    def cap(self) -> int:
        if not self.piece_bytes:
            return 1 << 16
        return max(1, int(self.max_bytes // self.piece_bytes))

    @property
    def bytes(self) -> int:
        """The window in bytes: what the workers may push on top of what is queued."""
        return self.max_bytes

    def arrived(self, nbytes: int) -> None:
        self._arrived += 1
        self.piece_bytes += (nbytes - self.piece_bytes) / min(self._arrived, 64)
        if self.pieces > self.cap:
            self.pieces = self.cap

    def starved(self) -> None:
        """The training loop waited with the whole window out: credit was the limit."""
        if self.pieces < self.cap:
            self.pieces = min(self.cap, max(self.pieces + 1, math.ceil(self.pieces * 2)))
            self.grown += 1
