"""A bounded history of the run, for ``remoteloader report`` and ``status --watch``.

The metrics hold the story of a run, but only a Prometheus scraping them keeps it. This
keeps a small picture of it in the master itself: once a second (``SAMPLE_EVERY_S``) the
service's tick records the workers (registered, draining, launched and not started), the
bytes they hold against their budget (summed), the rows per second they produce and the
trainers take, and each rank's stall; the autoscaler's add and remove decisions (action,
count, target, reason) are kept beside them, and the block cache's hits and misses are
counted per epoch. Every series is a ring buffer (``collections.deque`` with a
``maxlen``), so a tick costs O(1) in the history's length (the sample itself is O(workers
+ clients), like the status it is read from) and a master running for weeks holds at most
``capacity`` samples: the last hour at the defaults.

Measurement, not job state: nothing here is journaled, and a restarted master starts an
empty history. The status RPC returns it (``to_dict``) only when asked (``status`` with
``history: true``), so a plain ``status`` stays small.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable, Optional

SAMPLE_EVERY_S = 1.0
CAPACITY = 3600          # samples: one hour at one a second
MAX_DECISIONS = 512      # autoscaler decisions (adds and removes) kept
MAX_EPOCHS = 512         # epochs whose cache hits and misses are kept
MAX_RANKS = 64           # ranks whose stall is kept one by one (all count in stall_max / stall_mean)


class History:
    def __init__(self, capacity: int = CAPACITY, interval_s: float = SAMPLE_EVERY_S,
                 max_decisions: int = MAX_DECISIONS, max_epochs: int = MAX_EPOCHS, max_ranks: int = MAX_RANKS) -> None:
        if capacity < 1:
            raise ValueError("a history needs room for one sample at least")
        self.capacity, self.interval_s, self.max_epochs, self.max_ranks = capacity, interval_s, max_epochs, max_ranks
        # One tuple a sample: (time, workers, draining, pending, held_bytes, budget_bytes,
        # rows_per_s, client_rows_per_s, stall_max, stall_mean, ((rank, stall), ...)).
        self._samples: deque[tuple] = deque(maxlen=capacity)
        self._decisions: deque[tuple] = deque(maxlen=max_decisions)
        self._epochs: OrderedDict[int, list[float]] = OrderedDict()  # epoch -> [hits, misses]
        self._cache_totals = (0.0, 0.0)                                # hits, misses at the last sample
        self._last_decision: Optional[float] = None                    # its own time stamp (the autoscaler's clock)
        self._next = float("-inf")

    def __len__(self) -> int:
        return len(self._samples)

    def due(self, now: float) -> bool:
        """True once a second (``interval_s``): the service then takes a sample."""
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True

    def record(self, now: float, *, workers: int, draining: int = 0, pending: int = 0, held_bytes: float = 0.0,
               budget_bytes: float = 0.0, rows_per_s: float = 0.0, client_rows_per_s: Optional[float] = None,
               stall: Optional[dict[int, float]] = None, epoch: Optional[int] = None,
               cache_hits: float = 0.0, cache_misses: float = 0.0) -> None:
        """One sample. ``stall``: rank -> share of the window its loop waited (the largest
        where a rank has several sessions). ``cache_hits`` / ``cache_misses``: the workers'
        running totals; what they grew by since the last sample counts for ``epoch``."""
        stall = stall or {}
        values = list(stall.values())
        kept = tuple(sorted(stall.items())[: self.max_ranks])
        self._samples.append((now, workers, draining, pending, held_bytes, budget_bytes, rows_per_s,
                              client_rows_per_s, max(values, default=0.0),
                              sum(values) / len(values) if values else 0.0, kept))
        if epoch is not None:
            hits = max(0.0, cache_hits - self._cache_totals[0])
            misses = max(0.0, cache_misses - self._cache_totals[1])
            if hits or misses or epoch not in self._epochs:
                counts = self._epochs.get(epoch)
                if counts is None:
                    counts = self._epochs[epoch] = [0.0, 0.0]
                    if len(self._epochs) > self.max_epochs:
                        self._epochs.popitem(last=False)
                counts[0] += hits
                counts[1] += misses
        self._cache_totals = (cache_hits, cache_misses)

    def decisions(self, now: float, recent: Iterable[dict]) -> None:
        """Keep the autoscaler's decisions not seen yet (``recent``: its log, oldest first,
        each with its own ``time``) that changed the fleet: adds and removes, stamped
        ``now`` (they are a tick old at most). Holds are left out: ``status`` shows the
        latest reasons."""
        last = self._last_decision
        for d in recent:
            t = d.get("time")
            if t is None or (last is not None and t <= last):
                continue
            self._last_decision = last = t
            if d.get("action") in ("add", "remove"):
                self._decisions.append((now, d["action"], int(d.get("count", 0)), int(d.get("workers", 0)),
                                        str(d.get("reason", ""))))

    def to_dict(self) -> dict:
        """The history as columns (one list a series, aligned with ``time``), for the status
        reply: ``stall`` maps a rank (as a string) to its series, nil where the rank had no
        session; ``decisions`` and ``cache_epochs`` are lists of records."""
        samples = list(self._samples)
        ranks = sorted({rank for s in samples for rank, _ in s[10]})[: self.max_ranks]
        stall: dict[str, list] = {str(r): [] for r in ranks}
        for s in samples:
            per = dict(s[10])
            for r in ranks:
                v = per.get(r)
                stall[str(r)].append(None if v is None else round(v, 4))
        return {
            "interval_s": self.interval_s, "capacity": self.capacity,
            "time": [round(s[0], 3) for s in samples],
            "workers": [s[1] for s in samples],
            "draining": [s[2] for s in samples],
            "pending": [s[3] for s in samples],
            "held_bytes": [s[4] for s in samples],
            "budget_bytes": [s[5] for s in samples],
            "rows_per_s": [round(s[6], 1) for s in samples],
            "client_rows_per_s": [None if s[7] is None else round(s[7], 1) for s in samples],
            "stall_max": [round(s[8], 4) for s in samples],
            "stall_mean": [round(s[9], 4) for s in samples],
            "stall": stall,
            "decisions": [{"time": round(t, 3), "action": a, "count": c, "workers": w, "reason": r}
                          for t, a, c, w, r in self._decisions],
            "cache_epochs": [{"epoch": e, "hits": h, "misses": m} for e, (h, m) in self._epochs.items()],
        }
