"""Test hooks for fault injection (chaos and autoscaling tests); inert by default."""
from __future__ import annotations

import threading


class Faults:
    def __init__(self, batch_delay_s: float = 0.0, hang_after_pieces: int = -1) -> None:
        self.batch_delay_s = batch_delay_s
        self.hang_after_pieces = hang_after_pieces
        self._pieces = 0

    def before_piece(self, stop: threading.Event) -> None:
        if self.batch_delay_s:
            stop.wait(self.batch_delay_s)  # an expensive transform, for autoscaling tests
        self._pieces += 1
        if self.hang_after_pieces >= 0 and self._pieces > self.hang_after_pieces:
            stop.wait()  # a hung worker: heartbeats go on, the split makes no progress
