"""What the client reports to the master with its heartbeats (the autoscaler's input)."""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from ..protocol.messages import ClientStats as WireStats

# Upper bounds of the per-batch wait histogram (seconds) reported to the master's metrics.
WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


@dataclass
class ClientStats:
    """Cumulative counters; the master turns deltas between heartbeats into rates."""

    wait_s: float = 0.0  # time the training loop spent blocked waiting for a batch (mid-epoch)
    # The part of wait_s during which no worker of the partition held a piece for this rank
    # (by the ``held`` of its last message): waits more producers would shorten. The rest
    # is data held at a worker or on its way (credit, transport, a busy worker thread).
    starved_s: float = 0.0
    epoch_start_s: float = 0.0  # time spent waiting for the first batch of an epoch
    batches: int = 0
    rows: int = 0
    wait_buckets: list = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS_S) + 1))  # per-batch waits
    # When the training loop last got a batch (or the loader was made): a rank stuck at an
    # epoch's start shows as a growing ``since_batch_s``, not as "stall 0%".
    last_batch: float = field(default_factory=time.monotonic)

    def delivered(self, rows: int, waited_s: float) -> None:
        self.batches += 1
        self.rows += rows
        self.wait_buckets[bisect.bisect_left(WAIT_BUCKETS_S, waited_s)] += 1
        self.last_batch = time.monotonic()

    def to_wire(self, queued: int) -> WireStats:
        now = time.monotonic()
        return WireStats(wait_s=self.wait_s, starved_s=self.starved_s, epoch_start_s=self.epoch_start_s,
                         batches=self.batches, rows=self.rows, queued=queued, time=now,
                         since_batch_s=now - self.last_batch, wait_le=list(WAIT_BUCKETS_S),
                         wait_buckets=list(self.wait_buckets))
