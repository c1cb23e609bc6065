"""Autoscaling policy: how many workers a job needs, decided from what trainers feel.

The master calls ``AutoscalePolicy.observe(snapshot)`` every tick with the latest
heartbeat signals; the policy returns a ``Decision`` when it acts (and, rate-limited,
a "hold" that says why it does not). It never launches or drains anything itself:
the caller does that, which is also what lets ``simulate.py`` run this exact code
against modelled workers.

Signals combined (see docs/autoscaling.md):
* Cachew: trainer stall (share of wall time blocked waiting for a batch) and the
  marginal gain of each addition in client consumption rate.
* DPP: buffered batches at the workers. Near-empty buffers while trainers stall
  mean workers are the bottleneck; full buffers mean they are not.
* tf.data service: needed workers ~= demand / per-worker throughput. Demand is
  estimated from trainers as consumption / (1 - stall); per-worker throughput is
  learned from workers that were producing flat out (buffer not full).

Everything else is about not fooling ourselves: measurement windows that skip the
seconds after a change, confidence margins before removing, and a remembered plateau
(adding did not pay), floor (too few at this demand) and ceiling (trainers stall with
full buffers) so that the same mistake is not made twice.

CPU is deliberately not a scaling signal: an I/O-bound worker is saturated at 30%
CPU. ``CpuTargetPolicy`` (the Kubernetes HPA rule) is here as the baseline that
shows why, and ``OraclePolicy`` as the fixed-count yardstick.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol

import numpy as np

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- signals

@dataclass(frozen=True, slots=True)
class WorkerSignal:
    worker_id: str
    rows_per_s: float      # rows produced per second over the last window
    buffered: int          # batches waiting in its bounded buffer
    capacity: int          # buffer capacity in batches
    cpu: float             # 0..1 utilization of its process (noisy, may exceed 1 slightly)


@dataclass(frozen=True, slots=True)
class ClientSignal:
    client_id: str
    stall_fraction: float  # share of wall time blocked waiting for a batch over the window, 0..1
    batches_per_s: float   # consumption rate


@dataclass(frozen=True, slots=True)
class Snapshot:
    time: float                        # seconds, monotonic (simulated time in the simulator)
    workers: tuple[WorkerSignal, ...]  # workers that report
    clients: tuple[ClientSignal, ...]
    pending_workers: int = 0           # launched but not reporting yet


@dataclass(frozen=True)
class Decision:
    time: float
    action: str            # "add" | "remove" | "hold"
    count: int             # workers to add or remove (0 for hold)
    workers: int           # worker count targeted after this decision
    reason: str            # human-readable, with the numbers that triggered it
    remove: tuple[str, ...] = ()   # ids to drain for "remove", least useful first


class Policy(Protocol):
    decisions: list[Decision]

    def observe(self, snapshot: Snapshot) -> Optional[Decision]: ...


# ----------------------------------------------------------------------------- config

@dataclass
class AutoscaleConfig:
    min_workers: int = 1
    max_workers: int = 64
    # Measurement. A window starts `settle_s` after the worker set last changed (new
    # workers fill their buffers, drained ones empty theirs: both distort rates).
    window_s: float = 10.0          # clean window needed before scaling up
    down_window_s: float = 30.0     # longer for scaling down: a stall costs more than an idle worker
    settle_s: float = 5.0           # transient ignored after any change (and a new worker's first seconds)
    cooldown_s: float = 10.0        # minimum time between two actions
    pending_timeout_s: float = 120.0  # stop waiting for launched workers that never report
    # Scale-up: trainers stall AND worker buffers are near empty (workers are the bottleneck).
    stall_threshold: float = 0.002  # 0.2% of wall time; the buffer test filters noise, so this can be low
    low_fill: float = 0.2           # mean buffer fill below which workers count as drained
    max_up_factor: float = 4.0      # at most x4 per step: the demand estimate is poor when stall ~ 100%
    # Marginal gain (Cachew): an addition pays if client consumption rose by at least this
    # fraction of what the added workers produce (so a worker must deliver half its output).
    gain_threshold: float = 0.5
    confidence_z: float = 2.0       # a shortfall or a spare capacity must exceed this many standard errors
    recheck_s: float = 300.0        # retry beyond a plateau after this long
    # Scale-down: buffers persistently full, and the learned throughput of fewer workers covers
    # demand plus its uncertainty. Demand is tracked in blocks across worker changes (what the
    # trainers want does not depend on the worker count), so trims get finer the longer it runs.
    high_fill: float = 0.7          # mean buffer fill over `down_window_s` needed to scale down
    demand_block_s: float = 10.0    # demand block length; the spread of block means gives its error
    max_down_fraction: float = 0.5  # remove at most half the workers per step
    headroom: float = 0.02          # spare supply kept: this fraction of demand ...
    headroom_workers: float = 1.0   # ... capped at this many workers' worth (1000 workers need not keep 20 spare)
    jitter_margin: float = 7.0      # ... raised so demand jitter empties the buffers ~exp(-7) of the time
    hysteresis: float = 0.1         # demand must move this much before a remembered limit is forgotten
    # Learning per-worker throughput from workers whose buffer is at most `saturated_fill` full.
    saturated_fill: float = 0.5
    learn_tau_s: float = 30.0       # EWMA time constant
    hold_log_s: float = 300.0       # repeat an unchanged "hold" at most this often


# ----------------------------------------------------------------------------- policy

class _Sample(NamedTuple):
    t: float
    rows: float        # total rows/s produced (= consumed when buffers are steady)
    batches: float     # total client batches/s
    demand: float      # estimated client demand, batches/s: sum b / (1 - stall)
    stall: float       # mean client stall fraction
    fill: float        # buffered / capacity over all workers
    buffered: int      # batches buffered over all workers


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


class AutoscalePolicy:
    def __init__(self, config: Optional[AutoscaleConfig] = None) -> None:
        self.config = config or AutoscaleConfig()
        self.decisions: list[Decision] = []
        self._caps: dict[str, float] = {}       # learned rows/s per worker id (flat-out rate)
        self._mean_cap: Optional[float] = None  # fleet mean of per-worker capacities, survives churn and restarts
        self._first_seen: dict[str, float] = {}
        self._ids: tuple[str, ...] = ()
        self._cap = np.empty(0)                 # learned caps aligned with _ids (nan = unknown)
        self._obs: dict[str, float] = {}        # samples behind each learned capacity
        self._nobs = np.empty(0)
        self._seen = np.empty(0)
        self._rates = self._fill = self._cpu = self._buffered = self._capacity = np.empty(0)
        self._rpb: Optional[float] = None       # rows per batch, to convert buffered batches to rows
        self._samples: deque[_Sample] = deque()
        self._stable_since = -math.inf
        self._pending_since: Optional[float] = None
        self._last_action = -math.inf
        self._last_learn: Optional[float] = None
        self._trial: Optional[_Trial] = None
        self._plateau: Optional[_Mark] = None   # adding beyond this count did not pay
        self._floor: Optional[_Mark] = None     # this count was too few at this demand
        self._ceiling: Optional[_Mark] = None   # trainers stalled with full buffers at this rate
        self._probe = 0.0                       # > 0 while re-checking a plateau (its interval)
        self._selected = False                  # survivors of a removal by estimated speed: fleet mean frozen
        self._noise_var: Optional[float] = None  # variance of one rate sample around a worker's capacity
        self._demand = _DemandTracker(self.config.demand_block_s, self.config.confidence_z)
        self._last_hold: tuple[str, float] = ("", -math.inf)

    # ------------------------------------------------------------------ public

    def observe(self, snap: Snapshot) -> Optional[Decision]:
        """One control tick. `snap.workers` are the live workers that take new splits (not
        the draining ones); `pending_workers` those launched but not reporting yet. Returns
        the action to carry out ("add" n, "remove" the named workers) or, now and then, a
        "hold" saying why not; None otherwise. Never acts within `cooldown_s` of an action."""
        c, now = self.config, snap.time
        self._sync(snap)
        self._learn(now, snap)
        n, pending = len(snap.workers), snap.pending_workers

        if pending:
            self._pending_since = now if self._pending_since is None else self._pending_since
        else:
            self._pending_since = None
        waiting = bool(pending) and now - self._pending_since < c.pending_timeout_s
        if waiting:
            self._reset_window(now)     # rates while workers are joining are not representative
        if not waiting and now >= self._stable_since + c.settle_s:
            sample = self._sample(now, snap)
            self._track_demand(sample)
            self._samples.append(sample)
            horizon = now - max(c.window_s, c.down_window_s) - 1e-9
            while self._samples and self._samples[0].t < horizon:
                self._samples.popleft()

        if now - self._last_action < c.cooldown_s:
            return None
        if n + pending < c.min_workers:
            return self._act(now, "add", c.min_workers - n - pending, c.min_workers,
                             f"{n + pending} workers < min_workers {c.min_workers}")
        if n > c.max_workers:
            return self._act(now, "remove", n - c.max_workers, c.max_workers,
                             f"{n} workers > max_workers {c.max_workers}", self._least_useful(n - c.max_workers))
        if waiting or not self._samples or now - self._samples[0].t < c.window_s - 1e-9:
            return None
        return self._decide(now, n)

    def state_dict(self) -> dict:
        """Plain data a restarted master can hand back: learned throughput and limits.

        Times are not kept: a new process may have another monotonic clock, so a
        restored policy starts with a fresh window and recheck timer.
        """
        self._store_caps()
        return {
            "version": 1,
            "capacity": dict(self._caps),
            "mean_capacity": self._mean_cap,
            "plateau": None if self._plateau is None else [self._plateau.count, self._plateau.level],
            "floor": None if self._floor is None else [self._floor.count, self._floor.level],
            "ceiling": None if self._ceiling is None else [self._ceiling.count, self._ceiling.level],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unsupported autoscale state version {state.get('version')!r}")
        self._caps = {str(k): float(v) for k, v in state.get("capacity", {}).items()}
        self._mean_cap = state.get("mean_capacity")
        self._plateau = (None if state.get("plateau") is None
                         else _Mark(*state["plateau"], time=math.nan, interval=self.config.recheck_s))
        self._floor = None if state.get("floor") is None else _Mark(*state["floor"])
        self._ceiling = None if state.get("ceiling") is None else _Mark(*state["ceiling"])
        self._obs = {}
        self._ids = ()     # re-align arrays with the next snapshot
        self._stable_since = -math.inf
        self._last_action = -math.inf

    # ------------------------------------------------------------------ bookkeeping

    def _sync(self, snap: Snapshot) -> None:
        """Align per-worker arrays with the snapshot; a changed set restarts the window."""
        ids = tuple(w.worker_id for w in snap.workers)
        if ids != self._ids:
            self._store_caps()
            live = set(ids)
            self._caps = {k: v for k, v in self._caps.items() if k in live}
            self._obs = {k: v for k, v in self._obs.items() if k in live}
            self._first_seen = {k: v for k, v in self._first_seen.items() if k in live}
            for i in ids:
                self._first_seen.setdefault(i, snap.time)
            self._ids = ids
            self._cap = np.array([self._caps.get(i, np.nan) for i in ids], dtype=float)
            # Restored capacities (no count) weigh like a few time constants of samples.
            self._nobs = np.array([self._obs.get(i, 10.0 if i in self._caps else 0.0) for i in ids], dtype=float)
            self._seen = np.array([self._first_seen[i] for i in ids], dtype=float)
            self._reset_window(snap.time)
        ws, n = snap.workers, len(snap.workers)
        self._rates = np.fromiter((w.rows_per_s for w in ws), float, n)
        buffered = np.fromiter((w.buffered for w in ws), float, n)
        capacity = np.fromiter((w.capacity for w in ws), float, n)
        self._fill = np.divide(buffered, capacity, out=np.ones(n), where=capacity > 0)
        self._buffered, self._capacity = buffered, capacity
        self._cpu = np.fromiter((w.cpu for w in ws), float, n)

    def _store_caps(self) -> None:
        for i, v, k in zip(self._ids, self._cap.tolist(), self._nobs.tolist()):
            if not math.isnan(v):
                self._caps[i], self._obs[i] = v, k

    def _reset_window(self, now: float) -> None:
        self._stable_since = now
        self._samples.clear()

    def _learn(self, now: float, snap: Snapshot) -> None:
        """Each worker's rate while its buffer is not full, i.e. while it runs flat out: a plain
        mean over its first samples, then an EWMA (a single noisy sample must not decide which
        workers look fastest and are kept)."""
        c = self.config
        dt = 1.0 if self._last_learn is None else min(max(now - self._last_learn, 0.0), c.learn_tau_s)
        self._last_learn = now
        if not len(self._ids):
            return
        sat = (self._fill <= c.saturated_fill) & (now - self._seen >= c.settle_s)
        if not sat.any():
            return
        rates, cap = self._rates[sat], self._cap[sat]
        seen = ~np.isnan(cap)
        if seen.any():      # measurement noise of one sample, pooled over workers
            var = float(np.mean((rates[seen] - cap[seen]) ** 2))
            self._noise_var = var if self._noise_var is None else self._noise_var + 0.05 * (var - self._noise_var)
        self._nobs[sat] += 1
        weight = np.maximum(1.0 / self._nobs[sat], 1.0 - math.exp(-dt / c.learn_tau_s))
        cap = np.where(seen, cap, rates)
        self._cap[sat] = cap + weight * (rates - cap)
        # The fleet mean is what per-worker estimates shrink towards, so it must not inherit
        # their winner's curse: after workers were drained *because* they looked slow, the
        # survivors' estimates are biased up, and the mean stays frozen until most of the
        # fleet runs flat out again (fresh samples carry no selection).
        if sat.mean() >= 0.5:
            self._selected = False
        if not self._selected:
            self._mean_cap = float(np.nanmean(self._cap))   # per worker, not per sample: slow ones sample more

    def _sample(self, now: float, snap: Snapshot) -> _Sample:
        stall = np.fromiter((cl.stall_fraction for cl in snap.clients), float, len(snap.clients))
        bps = np.fromiter((cl.batches_per_s for cl in snap.clients), float, len(snap.clients))
        # A trainer blocked a fraction s of the time would consume b / (1 - s) if never blocked.
        demand = float((bps / (1.0 - np.clip(stall, 0.0, 0.99))).sum())
        fill = float(self._fill.mean()) if len(self._fill) else 0.0
        return _Sample(now, float(self._rates.sum()), float(bps.sum()), demand,
                       float(stall.mean()) if len(stall) else 0.0, fill, int(self._buffered.sum()))

    def _track_demand(self, s: _Sample) -> None:
        """Feed the long demand estimate with what trainers would consume, in rows/s.

        Workers report rows, trainers batches. Production minus the growth of the
        buffers is consumption; scaled by the trainers' demand/consumption ratio it is
        demand. Every sample counts (selecting, say, full-buffer moments would pick the
        moments of low demand and bias the estimate low)."""
        if s.batches > 0:
            ratio = s.rows / s.batches
            self._rpb = ratio if self._rpb is None else self._rpb + 0.05 * (ratio - self._rpb)
        prev = self._samples[-1] if self._samples else None
        if prev is None:                        # no buffer delta yet
            return
        consumed = s.rows - (self._rpb or 0.0) * (s.buffered - prev.buffered) / max(s.t - prev.t, 1e-9)
        if s.fill < self.config.low_fill:
            # Drained buffers: trainers wait on workers, who must supply what trainers would
            # take unblocked. With buffers left, a stall is not the workers' to fix.
            if s.stall > 0.25 or s.batches <= 0:
                return                          # extrapolating from a mostly blocked trainer is too wild
            consumed *= s.demand / s.batches
        self._demand.add(s.t, consumed)

    # ------------------------------------------------------------------ estimates

    def _estimates(self) -> Optional[np.ndarray]:
        """Flat-out rows/s of each current worker, else the fleet mean, else a CPU guess.

        A worker's own estimate is shrunk towards the fleet mean by n / (n + k), n its
        samples, k = sample noise / spread between workers (empirical Bayes): with few
        samples, looking fast is mostly luck, and the workers kept for looking fast would
        otherwise make the fleet look faster than it is."""
        caps = self._cap.copy()
        unknown = np.isnan(caps)
        if self._mean_cap:
            k = 0.0
            if self._noise_var and (~unknown).sum() > 2:
                noise = self._noise_var / np.maximum(self._nobs[~unknown], 1.0)
                spread = max(float(np.var(caps[~unknown])) - float(noise.mean()), 1e-6 * self._mean_cap ** 2)
                k = self._noise_var / spread
            weight = self._nobs / (self._nobs + k) if k > 0 else np.ones_like(caps)
            caps = np.where(unknown, self._mean_cap, self._mean_cap + weight * (caps - self._mean_cap))
        elif unknown.any():
            if not unknown.all():
                caps[unknown] = np.nanmean(caps)
            else:
                # Never saw a worker run flat out: rate / CPU. Overestimates I/O-bound
                # workers, so scale-down steps are capped and a stall undoes the error.
                guess = self._rates / np.clip(self._cpu, 0.1, 1.0)
                if not (guess > 0).any():
                    return None
                caps = np.where(guess > 0, guess, guess[guess > 0].mean())
        return caps

    def _needed(self, rows: float, caps: np.ndarray) -> int:
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

    def _headroom(self, rows: float, mean_cap: float) -> float:
        """Spare supply to keep above a demand of `rows`/s.

        A small fixed margin, plus what demand jitter needs: with spare supply e, the
        backlog of a jittery demand is exponential with mean var * tau / e (var*tau
        measured from the 10 s blocks of the demand tracker), so buffers holding b
        seconds run dry about exp(-e * b / (var * tau)) of the time."""
        c = self.config
        spare = min(c.headroom * rows, c.headroom_workers * mean_cap)
        tr, buffer_rows = self._demand, float(self._capacity.sum()) * (self._rpb or 0.0)
        if tr.n >= 3 and buffer_rows > 0:
            var_tau = tr.sd ** 2 * tr.block_s / 2            # block variance ~ var * 2 tau / block
            spare = max(spare, c.jitter_margin * var_tau / buffer_rows)
        return spare

    def _least_useful(self, k: int) -> tuple[str, ...]:
        """Slowest learned throughput first, then fullest buffer, then lowest current rate."""
        caps = self._estimates()
        caps = self._rates if caps is None else caps
        order = np.lexsort((self._rates, -self._fill, caps))
        return tuple(self._ids[i] for i in order[:k])

    # ------------------------------------------------------------------ decision

    def _decide(self, now: float, n: int) -> Optional[Decision]:
        c = self.config
        up = [s for s in self._samples if s.t > now - c.window_s - 1e-9]
        rows = float(np.mean([s.rows for s in up]))
        batches_all = np.array([s.batches for s in up])
        batches = float(batches_all.mean())
        batches_se = _se(batches_all)
        stall = float(np.mean([s.stall for s in up]))
        fill = float(np.mean([s.fill for s in up]))
        fill_min = min(s.fill for s in up)
        # Rows/s the trainers would take if never blocked (unknown if they consume nothing at all).
        if stall <= 0:
            demand = rows
        elif batches > 0 and rows > 0:
            demand = rows * float(np.mean([s.demand for s in up])) / batches
        else:
            demand = math.inf
        worker_bound = stall >= c.stall_threshold and fill < c.low_fill
        caps = self._estimates()
        mean_cap = float(caps.mean()) if caps is not None else 0.0
        numbers = f"stall {stall:.1%}, buffers {fill:.0%} full, {rows:,.0f} rows/s from {n} workers"

        # 0. Trainers stall although worker buffers are full: the limit is past the workers.
        # Remember the rate they reach (a ceiling), so that buffers draining later do not
        # trigger an addition sized for what only the GPUs could consume.
        if stall >= c.stall_threshold and fill_min >= c.high_fill:     # persistently full, not a transient
            self._ceiling = _Mark(n, rows, now)
        elif self._ceiling is not None and (stall < c.stall_threshold or (
                worker_bound and rows > self._ceiling.level * (1 + c.hysteresis / 2))):
            log.info("autoscale: forget ceiling %.0f rows/s (%s)", self._ceiling.level, numbers)
            self._ceiling = None

        # 1. Judge the last addition (Cachew): did it pay?
        trial, self._trial = self._trial, None
        new = np.fromiter((i not in trial.ids_before for i in self._ids), bool, n) if trial else None
        added_rows = float(self._rates[new].sum()) if trial else 0.0
        if trial is not None and worker_bound and trial.batches_before > 0 and added_rows > 0:
            # What the added workers produce should reach the trainers: with drained buffers
            # everything produced is consumed, unless something past the workers caps it (or
            # the newcomers only slowed the others down, as on a shared storage).
            expected = added_rows / trial.rows_before
            measured = batches / trial.batches_before - 1.0
            gain = measured / expected
            shortfall = (expected - measured) * trial.batches_before
            noise = math.hypot(batches_se, trial.batches_se)
            # Judge only what noise can resolve: a few workers among hundreds are within the jitter.
            conclusive = expected * trial.batches_before > 2 * c.confidence_z * noise
            if conclusive and gain < c.gain_threshold and shortfall > c.confidence_z * noise:
                # In workers as they ran before (the newcomers' own rate is depressed by the contention).
                useful = max(0.0, measured * trial.n_before)
                keep = min(n, trial.n_before + math.floor(useful + 1 - c.gain_threshold))
                # Each re-check that confirms the plateau doubles the wait for the next one.
                interval = min(2 * trial.probe_interval, 8 * c.recheck_s) if trial.probe_interval else c.recheck_s
                self._plateau = _Mark(keep, rows, now, interval)
                why = (f"adding {trial.added} workers raised client consumption {measured:+.1%}, "
                       f"{gain:.0%} of the expected {expected:+.1%} (< {c.gain_threshold:.0%}): "
                       f"plateau at {keep} workers; {numbers}")
                if keep < n:
                    return self._act(now, "remove", n - keep, keep, "step back: " + why, self._least_useful(n - keep))
                return self._hold(now, "plateau", n, why)
            if trial.probe_interval:
                self._probe = trial.probe_interval  # a re-check that paid: keep probing in small steps

        # 2. Forget a plateau when the situation changed or it is time to re-check.
        if self._plateau is not None:
            if math.isnan(self._plateau.time):      # restored from state_dict: start its clock now
                self._plateau.time = now
            if stall < c.stall_threshold or rows > self._plateau.level * (1 + c.hysteresis):
                log.info("autoscale: forget plateau at %d workers (%s)", self._plateau.count, numbers)
                self._plateau = None
            elif now - self._plateau.time >= self._plateau.interval:
                log.info("autoscale: re-checking plateau at %d workers", self._plateau.count)
                self._plateau, self._probe = None, self._plateau.interval

        # 3. Scale up: trainers stall and workers are drained.
        if worker_bound:
            if n >= c.max_workers:
                return self._hold(now, "max", n, f"trainers stall but at max_workers {c.max_workers}; {numbers}")
            if self._ceiling is not None:
                demand = min(demand, self._ceiling.level * (1 + c.hysteresis))
            if caps is None or n == 0:
                target = max(c.min_workers, 1, n + 1)
            else:
                target = self._needed(demand + self._headroom(demand, mean_cap), caps)
            target = max(target, n + 1)
            cap_step = max(n + 1, math.ceil(n * c.max_up_factor))
            if self._probe:
                cap_step = n + max(1, math.ceil(0.05 * n))
            target = min(target, cap_step, c.max_workers)
            if self._plateau is not None and target > self._plateau.count:
                target = self._plateau.count
                if target <= n:
                    return self._hold(now, "plateau", n,
                                      f"trainers stall but more than {self._plateau.count} workers did not pay "
                                      f"(re-check in {self._plateau.time + self._plateau.interval - now:.0f} s); "
                                      f"{numbers}")
            probe, self._probe = self._probe, 0.0
            k = target - n
            if caps is not None and n > 0 and rows > 0:
                self._trial = _Trial(n, k, frozenset(self._ids), rows, batches, batches_se, probe)
                self._floor = _Mark(n, min(demand, float(caps.sum()) + k * mean_cap), now)
            est = f"demand ~{demand:,.0f} rows/s" if math.isfinite(demand) else "demand unknown"
            return self._act(now, "add", k, target,
                             f"trainers stall and workers are drained: {numbers}; {est}, "
                             f"~{mean_cap:,.0f} rows/s per worker -> {target} workers")
        if stall >= c.stall_threshold:
            why = ("downstream", f"trainers stall but worker buffers are not drained: the bottleneck is past "
                                 f"the workers (client, network), more workers would not help; {numbers}")
        else:
            why = ("balanced", f"balanced; {numbers}")

        # 4. Scale down: buffers persistently full and fewer workers cover demand with confidence.
        down = list(self._samples)
        upper = self._demand.upper()
        if (now - down[0].t >= c.down_window_s - 1e-9 and caps is not None and math.isfinite(upper)
                and float(np.mean([s.fill for s in down])) >= c.high_fill
                and min(s.fill for s in down) >= c.low_fill):
            level = self._demand.mean
            target = self._needed(upper + self._headroom(level, mean_cap), caps)
            if self._floor is not None:
                if level > self._floor.level * (1 - c.hysteresis):
                    if target <= self._floor.count:
                        why = (why[0], f"{why[1]}; kept above {self._floor.count} workers, too few at "
                                       f"{self._floor.level:,.0f} rows/s")
                    target = max(target, self._floor.count + 1)
                else:
                    self._floor = None          # demand fell well below: the old limit no longer applies
            target = max(target, c.min_workers, n - math.floor(n * c.max_down_fraction))
            if target < n:
                return self._act(now, "remove", n - target, target,
                                 f"buffers full for {now - down[0].t:.0f} s; demand {level:,.0f} rows/s "
                                 f"(+{upper - level:,.0f} at {c.confidence_z:g} se) is covered by {target} "
                                 f"workers at ~{mean_cap:,.0f} rows/s each (utilization "
                                 f"{level / float(caps.sum()):.0%} of {n}); {numbers}",
                                 self._least_useful(n - target))
        return self._hold(now, why[0], n, why[1])

    def _act(self, now: float, action: str, count: int, target: int, reason: str,
             remove: tuple[str, ...] = ()) -> Decision:
        d = Decision(now, action, count, target, reason, remove)
        self._selected = self._selected or action == "remove"
        self._record(d)
        self._last_action = now
        self._last_hold = ("", -math.inf)
        self._reset_window(now)
        return d

    def _hold(self, now: float, kind: str, n: int, reason: str) -> Optional[Decision]:
        """Say why we do nothing, but only when that changes or every `hold_log_s`."""
        last_kind, last_time = self._last_hold
        if kind == last_kind and now - last_time < self.config.hold_log_s:
            return None
        self._last_hold = (kind, now)
        d = Decision(now, "hold", 0, n, reason)
        self._record(d)
        return d

    def _record(self, d: Decision) -> None:
        self.decisions.append(d)
        if len(self.decisions) > 1000:      # bounded history for a long-running master
            del self.decisions[:-500]
        log.info("autoscale %s %d -> %d workers at t=%.1f: %s", d.action, d.count, d.workers, d.time, d.reason)


# ----------------------------------------------------------------------------- baselines

@dataclass
class CpuTargetConfig:
    """Kubernetes HorizontalPodAutoscaler defaults."""
    min_workers: int = 1
    max_workers: int = 64
    target: float = 0.8                 # target mean CPU utilization
    tolerance: float = 0.1              # no change while |usage/target - 1| <= tolerance
    period_s: float = 15.0              # HPA sync period
    down_stabilization_s: float = 300.0  # scale down to the highest recommendation of the last 5 min
    up_max_factor: float = 2.0          # scale-up policy: +100% or +4 pods per period, whichever is more
    up_max_add: int = 4


class CpuTargetPolicy:
    """desired = ceil(current * mean_cpu / target), as the Kubernetes HPA computes it."""

    def __init__(self, config: Optional[CpuTargetConfig] = None) -> None:
        self.config = config or CpuTargetConfig()
        self.decisions: list[Decision] = []
        self._next = -math.inf
        self._history: deque[tuple[float, int]] = deque()

    def observe(self, snap: Snapshot) -> Optional[Decision]:
        c, now = self.config, snap.time
        if now < self._next:
            return None
        self._next = now + c.period_s
        ready, pending = len(snap.workers), snap.pending_workers
        current = ready + pending
        if ready:
            cpu_sum = float(sum(w.cpu for w in snap.workers))
            ratio = cpu_sum / ready / c.target
            # Unready (starting) workers count as 0% CPU when scaling up, as HPA does.
            desired = current if abs(ratio - 1) <= c.tolerance else math.ceil(cpu_sum / c.target)
            if ratio > 1 and desired <= current:
                desired = current
        else:
            ratio, desired = 0.0, current
        desired = min(desired, max(math.ceil(current * c.up_max_factor), current + c.up_max_add))
        self._history.append((now, desired))
        while self._history[0][0] < now - c.down_stabilization_s:
            self._history.popleft()
        if desired < current:
            desired = min(current, max(d for _, d in self._history))
        desired = min(max(desired, c.min_workers), c.max_workers)
        why = f"mean CPU {ratio * c.target:.0%} of {ready} ready workers vs target {c.target:.0%}"
        if desired > current:
            d = Decision(now, "add", desired - current, desired, why)
        elif desired < current:
            k = current - desired
            d = Decision(now, "remove", k, desired, why, tuple(w.worker_id for w in snap.workers[-k:]))
        else:
            return None
        self.decisions.append(d)
        log.info("cpu-target %s %d -> %d workers: %s", d.action, d.count, d.workers, d.reason)
        return d


class OraclePolicy:
    """A fixed worker count, chosen with hindsight: the yardstick for worker-seconds."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.decisions: list[Decision] = []

    def observe(self, snap: Snapshot) -> Optional[Decision]:
        current = len(snap.workers) + snap.pending_workers
        if current < self.workers:
            d = Decision(snap.time, "add", self.workers - current, self.workers, f"fixed at {self.workers}")
        elif len(snap.workers) > self.workers:
            k = len(snap.workers) - self.workers
            d = Decision(snap.time, "remove", k, self.workers, f"fixed at {self.workers}",
                         tuple(w.worker_id for w in snap.workers[-k:]))
        else:
            return None
        self.decisions.append(d)
        return d
