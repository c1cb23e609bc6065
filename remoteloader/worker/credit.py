"""Credit that clients granted this worker, per epoch run (docs/protocol.md, flow control)."""
from __future__ import annotations

import logging
import time
from typing import Callable

from .runs import RunId

log = logging.getLogger(__name__)
MAX_CREDITORS = 1 << 14  # (run, client) entries holding credit, across all clients


class Credit:
    """What one client granted for one run, and what it has been sent.

    Grants are cumulative totals (pieces and bytes since the client started the run),
    so a repeated or reordered grant changes nothing: the largest total wins. A piece
    goes while both totals exceed what was sent (a piece bigger than the byte credit
    left still goes, so a large piece cannot wedge the stream)."""

    __slots__ = ("pieces", "bytes", "sent_pieces", "sent_bytes", "heard")

    def __init__(self) -> None:
        self.pieces = self.bytes = self.sent_pieces = self.sent_bytes = 0
        self.heard = 0.0

    def grant(self, pieces: int, nbytes: int) -> None:
        self.pieces, self.bytes = max(self.pieces, pieces), max(self.bytes, nbytes)

    @property
    def open(self) -> bool:
        return self.open_after(0, 0)

    def open_after(self, pieces: int, nbytes: int) -> bool:
        """Whether one more piece may go once ``pieces`` / ``nbytes`` more have been sent."""
        return self.sent_pieces + pieces < self.pieces and self.sent_bytes + nbytes < self.bytes

    def spend(self, pieces: int, nbytes: int) -> None:
        self.sent_pieces += pieces
        self.sent_bytes += nbytes


class CreditBook:
    """Run -> client identity -> its credit. Bounded (``MAX_CREDITORS``), and an entry
    whose client sent nothing for ``expire_after_s`` goes: credit for a run the worker
    holds no task of yet is kept (that task may come), but not forever."""

    def __init__(self, expire_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.expire_after_s = expire_after_s
        self._clock = clock
        self._runs: dict[RunId, dict[bytes, Credit]] = {}
        self._entries = 0

    def grant(self, run: RunId, client: bytes, pieces: int, nbytes: int) -> None:
        # The client moved on to this run: its credit for the session's older runs is void.
        for old in [r for r in self._runs if r[0] == run[0] and r[1] < run[1]]:
            self.drop(old)
        creditors = self._runs.setdefault(run, {})
        credit = creditors.get(client)
        if credit is None:
            if self._entries >= MAX_CREDITORS:
                log.warning("dropped credit from %s: too many clients hold credit", client.hex())
                if not creditors:
                    del self._runs[run]
                return
            credit = creditors[client] = Credit()
            self._entries += 1
        credit.grant(pieces, nbytes)
        credit.heard = self._clock()

    def runs(self) -> list[tuple[RunId, dict[bytes, Credit]]]:
        """A snapshot of the runs holding credit, to iterate over while granting changes it."""
        return list(self._runs.items())

    def remove(self, run: RunId, client: bytes) -> None:
        creditors = self._runs.get(run)
        if creditors is not None and creditors.pop(client, None) is not None:
            self._entries -= 1
            if not creditors:
                del self._runs[run]

    def drop(self, run: RunId) -> None:
        self._entries -= len(self._runs.pop(run, {}))

    def expire(self) -> None:
        cutoff = self._clock() - self.expire_after_s
        for run, creditors in list(self._runs.items()):
            for client in [c for c, credit in creditors.items() if credit.heard <= cutoff]:
                self.remove(run, client)
