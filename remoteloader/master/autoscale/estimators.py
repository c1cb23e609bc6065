"""What the policy measures and remembers: window samples, demand, per-worker capacity.

``CapacityEstimator`` learns each worker's flat-out rows/s and turns it into worker
counts; ``_DemandTracker`` follows what the trainers want across worker changes;
``_Trial`` and ``_Mark`` are the policy's memory of an addition under judgement and
of the limits it found (plateau, floor, ceiling).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from .config import AutoscaleConfig


class _Sample(NamedTuple):
    t: float
    rows: float        # total rows/s produced (= consumed when buffers are steady)
    batches: float     # total client batches/s
    demand: float      # estimated client demand, batches/s: sum b / (1 - stall)
    stall: float       # mean client stall fraction
    fill: float        # buffered / capacity over all workers
    buffered: int      # batches buffered over all workers
    # Mean client stall while no worker held a batch for the client (what more workers
    # shorten); None when no client reports it, and the buffer fill stands in.
    starved: Optional[float] = None
    # Workers' summed busy share (worker-equivalents of work done); nan when one does not say.
    busy: float = math.nan
    # Rows/s the trainers consumed, when every client reports it (else None).
    consumed: Optional[float] = None
    # Rows/s the trainers would take if never blocked (consumption, scaled up while they
    # starve); None where it cannot be told (no buffer delta yet, trainers mostly blocked).
    wanted: Optional[float] = None
    # Live client sessions (trainers connected) at this tick; None: not told.
    sessions: Optional[int] = None


@dataclass
class _Trial:
    """An addition made because trainers stalled, judged one window later."""
    n_before: int
    added: int
    ids_before: frozenset[str]
    rows_before: float
    batches_before: float
    batches_se: float
    probe_interval: float  # > 0: this addition re-checked a plateau last confirmed this long ago


@dataclass
class _Mark:
    """A remembered limit: `count` workers at consumption `level` rows/s."""
    count: int
    level: float
    time: float = 0.0
    interval: float = 0.0  # plateau: re-check after this long


class _DemandTracker:
    """Mean consumption (rows/s) over fixed-length blocks, with a standard error from the
    block means (robust to correlated samples). A block far from the long mean means
    demand moved: start over, without that block (it may straddle the change)."""

    def __init__(self, block_s: float, z: float) -> None:
        self.block_s, self.z = block_s, z
        self._start: Optional[float] = None
        self._sum, self._k = 0.0, 0
        self.reset()

    def reset(self) -> None:
        self.n, self.mean, self._m2 = 0, 0.0, 0.0

    def add(self, t: float, rows: float) -> None:
        if self._start is None or t - self._start > 2 * self.block_s:
            self._start, self._sum, self._k = t, 0.0, 0    # after a gap, start a fresh block
        self._sum, self._k = self._sum + rows, self._k + 1
        if t - self._start < self.block_s - 1e-9:
            return
        m = self._sum / self._k
        self._start, self._sum, self._k = t, 0.0, 0
        # Twice the usual margin: a false restart is cheap, but it keeps trims coarse for a while.
        if self.n >= 3 and abs(m - self.mean) > 2 * _t(self.z, self.n - 1) * self.sd * math.sqrt(1 + 1 / self.n):
            self.reset()
            return
        self._push(m)

    def _push(self, m: float) -> None:
        self.n += 1
        d = m - self.mean
        self.mean += d / self.n
        self._m2 += d * (m - self.mean)

    @property
    def sd(self) -> float:
        return math.sqrt(self._m2 / (self.n - 1)) if self.n > 1 else math.inf

    def upper(self) -> float:
        """Mean plus its one-sided confidence margin (Student t: few blocks, wide margin)."""
        if self.n < 3:
            return math.inf
        return self.mean + _t(self.z, self.n - 1) * self.sd / math.sqrt(self.n)


def _se(x: np.ndarray) -> float:
    """Standard error of the mean of a short, autocorrelated series (lag-1 correction)."""
    n = len(x)
    if n < 3:
        return math.inf
    d = x - x.mean()
    var = float(d @ d) / (n - 1)
    rho = float(d[1:] @ d[:-1]) / float(d @ d) if var > 0 else 0.0
    rho = min(max(rho, 0.0), 0.9)
    return math.sqrt(var / n * (1 + rho) / (1 - rho))


def _t(z: float, dof: int) -> float:
    """Student-t quantile matching normal quantile z (Cornish-Fisher; fine for dof >= 2)."""
    return z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)



class CapacityEstimator:
    """Each worker's flat-out rows/s, learned while its buffer is not full, and the worker
    counts it implies.

    Per-worker arrays are aligned with the worker ids of the latest observation (``align``);
    ``caps`` keeps learned values by id across changes of the worker set, and ``mean`` is
    the fleet mean that per-worker estimates shrink towards. The signals of the current
    tick (rates, buffer fill, CPU, aligned with ``ids``) are passed in by the policy.
    """

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self.caps: dict[str, float] = {}        # learned rows/s per worker id (flat-out rate)
        self.obs: dict[str, float] = {}         # samples behind each learned capacity
        self.mean: Optional[float] = None       # fleet mean of per-worker capacities, survives churn and restarts
        self.noise_var: Optional[float] = None  # variance of one rate sample around a worker's capacity
        self.selected = False                   # survivors of a removal by estimated speed: fleet mean frozen
        self.ids: tuple[str, ...] = ()
        self._first_seen: dict[str, float] = {}
        self._cap = np.empty(0)                 # learned caps aligned with ids (nan = unknown)
        self._nobs = np.empty(0)
        self._seen = np.empty(0)
        self._last_learn: Optional[float] = None

    def align(self, ids: tuple[str, ...], now: float) -> bool:
        """Re-align the per-worker arrays with `ids`; True if the worker set changed."""
        if ids == self.ids:
            return False
        self.store()
        live = set(ids)
        self.caps = {k: v for k, v in self.caps.items() if k in live}
        self.obs = {k: v for k, v in self.obs.items() if k in live}
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in live}
        for i in ids:
            self._first_seen.setdefault(i, now)
        self.ids = ids
        self._cap = np.array([self.caps.get(i, np.nan) for i in ids], dtype=float)
        # Restored capacities (no count) weigh like a few time constants of samples.
        self._nobs = np.array([self.obs.get(i, 10.0 if i in self.caps else 0.0) for i in ids], dtype=float)
        self._seen = np.array([self._first_seen[i] for i in ids], dtype=float)
        return True

    def store(self) -> None:
        """Write what the arrays learned back into ``caps`` and ``obs``, by worker id."""
        for i, v, k in zip(self.ids, self._cap.tolist(), self._nobs.tolist()):
            if not math.isnan(v):
                self.caps[i], self.obs[i] = v, k

    def load(self, caps: dict[str, float], mean: Optional[float]) -> None:
        """Restored capacities; the arrays re-align with the next observation."""
        self.caps, self.mean = caps, mean
        self.obs = {}
        self.ids = ()

    def learn(self, now: float, rates: np.ndarray, fill: np.ndarray, busy: np.ndarray) -> None:
        """Each worker's flat-out rate: ``rate / busy`` where it reports its busy share (and
        was busy long enough for the ratio to mean something), else its rate while its
        buffer is not full. A plain mean over its first samples, then an EWMA (a single
        noisy sample must not decide which workers look fastest and are kept)."""
        c = self.config
        dt = 1.0 if self._last_learn is None else min(max(now - self._last_learn, 0.0), c.learn_tau_s)
        self._last_learn = now
        if not len(self.ids):
            return
        told = ~np.isnan(busy)
        # Under credit streaming fill says little of whether a worker ran flat out (a burst
        # sits in the client's window, pieces held ahead do not count): busy says it.
        flat_out = np.where(told, np.nan_to_num(busy) >= c.min_busy, fill <= c.saturated_fill)
        sat = flat_out & (now - self._seen >= c.settle_s)
        if not sat.any():
            return
        rates = np.where(told, rates / np.clip(np.nan_to_num(busy, nan=1.0), c.min_busy, 1.0), rates)
        rates, cap = rates[sat], self._cap[sat]
        seen = ~np.isnan(cap)
        if seen.any():      # measurement noise of one sample, pooled over workers
            var = float(np.mean((rates[seen] - cap[seen]) ** 2))
            self.noise_var = var if self.noise_var is None else self.noise_var + 0.05 * (var - self.noise_var)
        self._nobs[sat] += 1
        weight = np.maximum(1.0 / self._nobs[sat], 1.0 - math.exp(-dt / c.learn_tau_s))
        cap = np.where(seen, cap, rates)
        self._cap[sat] = cap + weight * (rates - cap)
        # The fleet mean is what per-worker estimates shrink towards, so it must not inherit
        # their winner's curse: after workers were drained *because* they looked slow, the
        # survivors' estimates are biased up, and the mean stays frozen until most of the
        # fleet runs flat out again (fresh samples carry no selection).
        if sat.mean() >= 0.5:
            self.selected = False
        if not self.selected:
            self.mean = float(np.nanmean(self._cap))   # per worker, not per sample: slow ones sample more

    def estimates(self, rates: np.ndarray, cpu: np.ndarray) -> Optional[np.ndarray]:
        """Flat-out rows/s of each current worker, else the fleet mean, else a CPU guess.

        A worker's own estimate is shrunk towards the fleet mean by n / (n + k), n its
        samples, k = sample noise / spread between workers (empirical Bayes): with few
        samples, looking fast is mostly luck, and the workers kept for looking fast would
        otherwise make the fleet look faster than it is."""
        caps = self._cap.copy()
        unknown = np.isnan(caps)
        if self.mean:
            k = 0.0
            if self.noise_var and (~unknown).sum() > 2:
                noise = self.noise_var / np.maximum(self._nobs[~unknown], 1.0)
                spread = max(float(np.var(caps[~unknown])) - float(noise.mean()), 1e-6 * self.mean ** 2)
                k = self.noise_var / spread
            weight = self._nobs / (self._nobs + k) if k > 0 else np.ones_like(caps)
            caps = np.where(unknown, self.mean, self.mean + weight * (caps - self.mean))
        elif unknown.any():
            if not unknown.all():
                caps[unknown] = np.nanmean(caps)
            else:
                # Never saw a worker run flat out: rate / CPU. Overestimates I/O-bound
                # workers, so scale-down steps are capped and a stall undoes the error.
                guess = rates / np.clip(cpu, 0.1, 1.0)
                if not (guess > 0).any():
                    return None
                caps = np.where(guess > 0, guess, guess[guess > 0].mean())
        return caps

    @staticmethod
    def needed(rows: float, caps: np.ndarray) -> int:
        """Fewest workers whose estimated throughput covers `rows`/s (fastest kept first)."""
        if rows <= 0:
            return 0
        if not math.isfinite(rows):
            return 1 << 30
        cum = np.cumsum(np.sort(caps)[::-1])
        if len(cum) and cum[-1] >= rows:
            return int(np.searchsorted(cum, rows)) + 1
        total = float(cum[-1]) if len(cum) else 0.0
        return len(caps) + math.ceil((rows - total) / float(caps.mean()) - 1e-9)

    def least_useful(self, k: int, rates: np.ndarray, fill: np.ndarray, cpu: np.ndarray) -> tuple[str, ...]:
        """Slowest learned throughput first, then fullest buffer, then lowest current rate."""
        caps = self.estimates(rates, cpu)
        caps = rates if caps is None else caps
        order = np.lexsort((rates, -fill, caps))
        return tuple(self.ids[i] for i in order[:k])
