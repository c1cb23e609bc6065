"""Test hooks for fault injection (chaos, autoscaling and sealing tests); inert by default."""
from __future__ import annotations

import os
import threading
from typing import Callable, Optional

ENV_SEAL_TAMPER = "REMOTELOADER_TEST_SEAL_TAMPER"  # KIND:EVERY, for workers started as processes
SEAL_TAMPERS = ("replay", "reorder", "flip")


class Faults:
    def __init__(self, batch_delay_s: float = 0.0, hang_after_pieces: int = -1,
                 seal_tamper: Optional[str] = None, tamper_every: int = 0) -> None:
        self.batch_delay_s = batch_delay_s
        self.hang_after_pieces = hang_after_pieces
        self._pieces = 0
        # Sealing tests: besides every ``tamper_every``-th batch message, send an extra copy:
        # the same message again (replay), the message again after the next one (reorder),
        # or, before it, a copy with one bit flipped in its last frame (flip).
        if seal_tamper is None and os.environ.get(ENV_SEAL_TAMPER):
            seal_tamper, _, every = os.environ[ENV_SEAL_TAMPER].partition(":")
            tamper_every = int(every or 1)
        if seal_tamper and seal_tamper not in SEAL_TAMPERS:
            raise ValueError(f"seal_tamper {seal_tamper!r}: one of {SEAL_TAMPERS}")
        self.seal_tamper = seal_tamper or ""
        self.tamper_every = max(1, tamper_every)
        self.tampered = 0  # extra copies sent
        self._sent = 0
        self._held: Optional[list] = None

    def before_piece(self, stop: threading.Event) -> None:
        if self.batch_delay_s:
            stop.wait(self.batch_delay_s)  # an expensive transform, for autoscaling tests
        self._pieces += 1
        if self.hang_after_pieces >= 0 and self._pieces > self.hang_after_pieces:
            stop.wait()  # a hung worker: heartbeats go on, the split makes no progress

    def send(self, parts: list, send: Callable[[list], None]) -> None:
        """Send a genuine message (``parts``: identity, header, frames) through ``send``,
        with the extra copy this hook is set to add. The genuine send's errors propagate."""
        if not self.seal_tamper:
            send(parts)
            return
        held, self._held = self._held, None
        self._sent += 1
        due = self._sent % self.tamper_every == 0 and len(parts) > 2
        if due and self.seal_tamper == "flip":
            flipped = bytearray(memoryview(parts[-1]).cast("B")) if not isinstance(parts[-1], bytes) \
                else bytearray(parts[-1])
            flipped[len(flipped) // 2] ^= 0x10
            self._extra(send, [*parts[:-1], bytes(flipped)])
        send(parts)
        if due and self.seal_tamper == "replay":
            self._extra(send, list(parts))
        if held is not None:
            self._extra(send, held)
        if due and self.seal_tamper == "reorder":
            self._held = list(parts)

    def _extra(self, send: Callable[[list], None], parts: list) -> None:
        try:
            send(parts)
            self.tampered += 1
        except Exception:  # a copy that cannot go is simply not sent
            pass
