"""``AutoscalePolicy``: how many workers a job needs, decided from what trainers feel.

``observe`` keeps the measurement window (samples, demand, learned capacity); once a
clean window exists, ``_decide`` runs the rules of docs/autoscaling.md as phases:
0. ceiling bookkeeping, 1. judge the last addition, 2. forget or re-check a plateau,
3. scale up, 4. scale down, or, with no trainer connected at all, 6. trim to
``min_workers`` once none has been for ``down_window_s``. The first phase that
concludes returns the decision.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from typing import NamedTuple, Optional, Union

import numpy as np

from .config import AutoscaleConfig
from .estimators import CapacityEstimator, _DemandTracker, _Mark, _Sample, _se, _Trial
from .signals import Decision, Observation

log = logging.getLogger(__name__)


class _Window(NamedTuple):
    """The measurements of one decision, over the last `window_s`."""
    rows: float                   # rows/s produced by all workers
    batches: float                # batches/s consumed by all clients
    batches_se: float             # its standard error
    stall: float                  # mean client stall fraction
    fill: float                   # mean buffer fill
    fill_min: float               # lowest buffer fill in the window
    starved: Optional[float]      # mean client stall with no batch held for it (None: not reported)
    busy: float                   # mean share of time the workers spent producing (nan: not reported)
    demand: float                 # rows/s the trainers would take if never blocked (inf: unknown)
    worker_bound: bool            # trainers stall for want of batches at the workers
    caps: Optional[np.ndarray]    # estimated flat-out rows/s of each worker
    mean_cap: float               # their mean (0 when unknown)
    numbers: str                  # the above, for reasons and logs


class _Hold(NamedTuple):
    """A phase's conclusion to do nothing, and why (reported rate-limited by ``_hold``)."""
    kind: str
    reason: str


_Verdict = Union[Decision, _Hold]


class AutoscalePolicy:
    def __init__(self, config: Optional[AutoscaleConfig] = None) -> None:
        self.config = config or AutoscaleConfig()
        self.decisions: list[Decision] = []
        self._estimator = CapacityEstimator(self.config)  # learned per-worker throughput
        self._rates = self._fill = self._cpu = self._busy = self._buffered = self._capacity = np.empty(0)
        self._rpb: Optional[float] = None       # rows per batch, to convert buffered batches to rows
        self._samples: deque[_Sample] = deque()
        self._stable_since = -math.inf
        self._pending_since: Optional[float] = None
        self._last_action = -math.inf
        self._trial: Optional[_Trial] = None
        self._plateau: Optional[_Mark] = None   # adding beyond this count did not pay
        self._floor: Optional[_Mark] = None     # this count was too few at this demand
        self._ceiling: Optional[_Mark] = None   # trainers stalled with full buffers at this rate
        self._probe = 0.0                       # > 0 while re-checking a plateau (its interval)
        self._demand = _DemandTracker(self.config.demand_block_s, self.config.confidence_z)
        self._last_hold: tuple[str, float] = ("", -math.inf)
        self._alone_since: Optional[float] = None  # no client session live since then (None: one is)

    # ------------------------------------------------------------------ public

    def observe(self, obs: Observation) -> Optional[Decision]:
        """One control tick. `obs.workers` are the live workers that take new splits (not
        the draining ones); `pending_workers` those launched but not reporting yet. Returns
        the action to carry out ("add" n, "remove" the named workers) or, now and then, a
        "hold" saying why not; None otherwise. Never acts within `cooldown_s` of an action."""
        c, now = self.config, obs.time
        self._sync(obs)
        if obs.clients:
            self._alone_since = None
        elif self._alone_since is None:
            self._alone_since = now
        self._estimator.learn(now, self._rates, self._fill, self._busy)
        n, pending = len(obs.workers), obs.pending_workers

        if pending:
            self._pending_since = now if self._pending_since is None else self._pending_since
        else:
            self._pending_since = None
        waiting = bool(pending) and now - self._pending_since < c.pending_timeout_s
        if waiting:
            self._reset_window(now)     # rates while workers are joining are not representative
        if not waiting and now >= self._stable_since + c.settle_s:
            sample = self._track_demand(self._sample(now, obs))
            self._samples.append(sample)
            # Kept a window longer than the longest rule needs: ticks land "at least a tick
            # after the last one", with jitter and drift, so a window that must be exactly
            # `down_window_s` old when pruned at exactly that age would practically never exist.
            horizon = now - max(c.window_s, c.down_window_s) - c.window_s
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
        self._estimator.store()
        return {
            "version": 1,
            "capacity": dict(self._estimator.caps),
            "mean_capacity": self._estimator.mean,
            "plateau": None if self._plateau is None else [self._plateau.count, self._plateau.level],
            "floor": None if self._floor is None else [self._floor.count, self._floor.level],
            "ceiling": None if self._ceiling is None else [self._ceiling.count, self._ceiling.level],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned. Raises ValueError (or TypeError) on state
        it cannot use, before changing anything."""
        if not isinstance(state, dict) or state.get("version") != 1:
            version = state.get("version") if isinstance(state, dict) else state
            raise ValueError(f"unsupported autoscale state version {version!r}")
        caps = {str(k): float(v) for k, v in (state.get("capacity") or {}).items()}
        mean = state.get("mean_capacity")
        mean = None if mean is None else float(mean)

        def mark(key: str) -> Optional[tuple[int, float]]:
            value = state.get(key)
            if value is None:
                return None
            count, level = value            # [count, level]
            return int(count), float(level)

        plateau, floor, ceiling = mark("plateau"), mark("floor"), mark("ceiling")
        self._estimator.load(caps, mean)
        self._plateau = None if plateau is None else _Mark(*plateau, time=math.nan, interval=self.config.recheck_s)
        self._floor = None if floor is None else _Mark(*floor)
        self._ceiling = None if ceiling is None else _Mark(*ceiling)
        self._stable_since = -math.inf
        self._last_action = -math.inf

    # ------------------------------------------------------------------ bookkeeping

    def _sync(self, obs: Observation) -> None:
        """Align per-worker arrays with the observation; a changed set restarts the window."""
        if self._estimator.align(tuple(w.worker_id for w in obs.workers), obs.time):
            self._reset_window(obs.time)
        ws, n = obs.workers, len(obs.workers)
        self._rates = np.fromiter((w.rows_per_s for w in ws), float, n)
        buffered = np.fromiter((w.buffered for w in ws), float, n)
        capacity = np.fromiter((w.capacity for w in ws), float, n)
        self._fill = np.divide(buffered, capacity, out=np.ones(n), where=capacity > 0)
        self._buffered, self._capacity = buffered, capacity
        self._cpu = np.fromiter((w.cpu for w in ws), float, n)
        self._busy = np.fromiter((math.nan if w.busy is None else w.busy for w in ws), float, n)

    def _reset_window(self, now: float) -> None:
        self._stable_since = now
        self._samples.clear()

    def _sample(self, now: float, obs: Observation) -> _Sample:
        stall = np.fromiter((cl.stall_fraction for cl in obs.clients), float, len(obs.clients))
        bps = np.fromiter((cl.batches_per_s for cl in obs.clients), float, len(obs.clients))
        # A trainer blocked a fraction s of the time would consume b / (1 - s) if never blocked.
        demand = float((bps / (1.0 - np.clip(stall, 0.0, 0.99))).sum())
        fill = float(self._fill.mean()) if len(self._fill) else 0.0
        starved = None
        if any(cl.starved_fraction is not None for cl in obs.clients):
            # A client that does not say counts as starved while the buffers are drained.
            drained = fill < self.config.low_fill
            starved = float(np.mean([cl.starved_fraction if cl.starved_fraction is not None
                                     else cl.stall_fraction * drained for cl in obs.clients]))
        rows = [cl.rows_per_s for cl in obs.clients]
        consumed = float(sum(rows)) if rows and None not in rows else None
        return _Sample(now, float(self._rates.sum()), float(bps.sum()), demand,
                       float(stall.mean()) if len(stall) else 0.0, fill, int(self._buffered.sum()), starved,
                       float(self._busy.sum()), consumed, sessions=len(obs.clients))

    def _drained(self, s: _Sample) -> bool:
        """Trainers wait on the workers in this sample: clients say no worker held a batch
        for them, or (clients that do not say) the buffers are drained."""
        if s.starved is not None:
            return s.starved >= self.config.stall_threshold
        return s.fill < self.config.low_fill

    def _track_demand(self, s: _Sample) -> _Sample:
        """Feed the long demand estimate with what trainers would consume, in rows/s, and
        return the sample with that rate (``wanted``) filled in where it can be known.

        Clients that report rows say what they consumed. Otherwise workers report rows,
        trainers batches: production minus the growth of the buffers is consumption.
        Scaled by the trainers' demand/consumption ratio it is demand. Every sample counts
        (selecting, say, full-buffer moments would pick the moments of low demand and bias
        the estimate low). With no trainer connected there is no demand to measure, and
        what the last trainers wanted says nothing of the next ones: the tracker starts over."""
        if s.sessions == 0:
            self._demand.reset()
            return s
        if s.batches > 0:
            ratio = s.rows / s.batches
            self._rpb = ratio if self._rpb is None else self._rpb + 0.05 * (ratio - self._rpb)
        prev = self._samples[-1] if self._samples else None
        if s.consumed is not None:
            consumed = s.consumed
        elif prev is None:                      # no buffer delta yet
            return s
        else:
            consumed = s.rows - (self._rpb or 0.0) * (s.buffered - prev.buffered) / max(s.t - prev.t, 1e-9)
        if self._drained(s):
            # Trainers wait on workers, who must supply what trainers would take unblocked.
            # With batches held for them, a stall is not the workers' to fix.
            if s.stall > 0.25 or s.batches <= 0:
                return s                        # extrapolating from a mostly blocked trainer is too wild
            consumed *= s.demand / s.batches
        self._demand.add(s.t, consumed)
        return s._replace(wanted=consumed)

    # ------------------------------------------------------------------ estimates

    def _estimates(self) -> Optional[np.ndarray]:
        return self._estimator.estimates(self._rates, self._cpu)

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
        return self._estimator.least_useful(k, self._rates, self._fill, self._cpu)

    # ------------------------------------------------------------------ decision

    def _decide(self, now: float, n: int) -> Optional[Decision]:
        """The rules in order; the first phase that concludes decides."""
        w = self._measure(now, n)
        self._track_ceiling(now, n, w)                          # 0. ceiling bookkeeping
        verdict = self._judge_addition(now, n, w)               # 1. did the last addition pay?
        if verdict is None:
            self._revisit_plateau(now, w)                       # 2. forget or re-check a plateau
            if self._alone_since is not None:
                verdict = self._no_trainer(now, n, w)           # 6. nobody to serve: min_workers
            elif w.worker_bound:
                verdict = self._scale_up(now, n, w)             # 3. trainers stall, workers drained
            else:
                verdict = self._scale_down(now, n, w)           # 4. fewer workers would do (or hold)
        if isinstance(verdict, _Hold):
            return self._hold(now, verdict.kind, n, verdict.reason)
        return verdict

    def _measure(self, now: float, n: int) -> _Window:
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
        # Clients that report it say whether they waited with no batch held for them at any
        # worker (more workers would help); the buffer fill only stands in for that: a
        # worker filling its buffer in bursts looks half full while its trainer waits.
        said = [s.starved for s in up if s.starved is not None]
        starved = float(np.mean(said)) if said else None
        if starved is not None:
            worker_bound = starved >= c.stall_threshold
        else:
            worker_bound = stall >= c.stall_threshold and fill < c.low_fill
        busy = float(np.mean([s.busy for s in up])) / n if n else math.nan
        caps = self._estimates()
        mean_cap = float(caps.mean()) if caps is not None and len(caps) else 0.0
        numbers = (f"stall {stall:.1%}" + ("" if starved is None else f" ({starved:.1%} with nothing held)")
                   + ("" if math.isnan(busy) else f", workers busy {busy:.0%}")
                   + f", buffers {fill:.0%} full, {rows:,.0f} rows/s from {n} workers")
        return _Window(rows, batches, batches_se, stall, fill, fill_min, starved, busy, demand, worker_bound, caps,
                       mean_cap, numbers)

    def _track_ceiling(self, now: float, n: int, w: _Window) -> None:
        """0. Trainers stall although worker buffers are full: the limit is past the workers.
        Remember the rate they reach (a ceiling), so that buffers draining later do not
        trigger an addition sized for what only the GPUs could consume."""
        c = self.config
        if w.stall >= c.stall_threshold and w.fill_min >= c.high_fill and not w.worker_bound:  # persistently full
            self._ceiling = _Mark(n, w.rows, now)
        elif self._ceiling is not None and (w.stall < c.stall_threshold or (
                w.worker_bound and w.rows > self._ceiling.level * (1 + c.hysteresis / 2))):
            log.info("autoscale: forget ceiling %.0f rows/s (%s)", self._ceiling.level, w.numbers)
            self._ceiling = None

    def _judge_addition(self, now: float, n: int, w: _Window) -> Optional[_Verdict]:
        """1. Judge the last addition (Cachew): did it pay? None: no verdict, go on."""
        c = self.config
        trial, self._trial = self._trial, None
        if trial is None:
            return None
        new = np.fromiter((i not in trial.ids_before for i in self._estimator.ids), bool, n)
        added_rows = float(self._rates[new].sum())
        if not (w.worker_bound and trial.batches_before > 0 and added_rows > 0):
            return None
        # What the added workers produce should reach the trainers: with drained buffers
        # everything produced is consumed, unless something past the workers caps it (or
        # the newcomers only slowed the others down, as on a shared storage).
        expected = added_rows / trial.rows_before
        measured = w.batches / trial.batches_before - 1.0
        gain = measured / expected
        shortfall = (expected - measured) * trial.batches_before
        noise = math.hypot(w.batches_se, trial.batches_se)
        # Judge only what noise can resolve: a few workers among hundreds are within the jitter.
        conclusive = expected * trial.batches_before > 2 * c.confidence_z * noise
        if conclusive and gain < c.gain_threshold and shortfall > c.confidence_z * noise:
            # In workers as they ran before (the newcomers' own rate is depressed by the contention).
            useful = max(0.0, measured * trial.n_before)
            keep = min(n, trial.n_before + math.floor(useful + 1 - c.gain_threshold))
            # Each re-check that confirms the plateau doubles the wait for the next one.
            interval = min(2 * trial.probe_interval, 8 * c.recheck_s) if trial.probe_interval else c.recheck_s
            self._plateau = _Mark(keep, w.rows, now, interval)
            why = (f"adding {trial.added} workers raised client consumption {measured:+.1%}, "
                   f"{gain:.0%} of the expected {expected:+.1%} (< {c.gain_threshold:.0%}): "
                   f"plateau at {keep} workers; {w.numbers}")
            if keep < n:
                return self._act(now, "remove", n - keep, keep, "step back: " + why, self._least_useful(n - keep))
            return _Hold("plateau", why)
        if trial.probe_interval:
            self._probe = trial.probe_interval  # a re-check that paid: keep probing in small steps
        return None

    def _revisit_plateau(self, now: float, w: _Window) -> None:
        """2. Forget a plateau when the situation changed or it is time to re-check."""
        c = self.config
        if self._plateau is None:
            return
        if math.isnan(self._plateau.time):      # restored from state_dict: start its clock now
            self._plateau.time = now
        if w.stall < c.stall_threshold or w.rows > self._plateau.level * (1 + c.hysteresis):
            log.info("autoscale: forget plateau at %d workers (%s)", self._plateau.count, w.numbers)
            self._plateau = None
        elif now - self._plateau.time >= self._plateau.interval:
            log.info("autoscale: re-checking plateau at %d workers", self._plateau.count)
            self._plateau, self._probe = None, self._plateau.interval

    def _scale_up(self, now: float, n: int, w: _Window) -> _Verdict:
        """3. Scale up: trainers stall and the workers hold no batch for them."""
        c, caps, demand = self.config, w.caps, w.demand
        if n >= c.max_workers:
            return _Hold("max", f"trainers stall but at max_workers {c.max_workers}; {w.numbers}")
        if self._ceiling is not None:
            demand = min(demand, self._ceiling.level * (1 + c.hysteresis))
        if caps is None or n == 0:
            target = max(c.min_workers, 1, n + 1)
        else:
            target = self._estimator.needed(demand + self._headroom(demand, w.mean_cap), caps)
        target = max(target, n + 1)
        cap_step = max(n + 1, math.ceil(n * c.max_up_factor))
        if self._probe:
            cap_step = n + max(1, math.ceil(0.05 * n))
        target = min(target, cap_step, c.max_workers)
        if self._plateau is not None and target > self._plateau.count:
            target = self._plateau.count
            if target <= n:
                return _Hold("plateau", f"trainers stall but more than {self._plateau.count} workers did not pay "
                                        f"(re-check in {self._plateau.time + self._plateau.interval - now:.0f} s); "
                                        f"{w.numbers}")
        probe, self._probe = self._probe, 0.0
        k = target - n
        if caps is not None and n > 0 and w.rows > 0:
            self._trial = _Trial(n, k, frozenset(self._estimator.ids), w.rows, w.batches, w.batches_se, probe)
            self._floor = _Mark(n, min(demand, float(caps.sum()) + k * w.mean_cap), now)
        est = f"demand ~{demand:,.0f} rows/s" if math.isfinite(demand) else "demand unknown"
        return self._act(now, "add", k, target,
                         f"trainers stall and workers hold no batch for them: {w.numbers}; {est}, "
                         f"~{w.mean_cap:,.0f} rows/s per worker -> {target} workers")

    def _scale_down(self, now: float, n: int, w: _Window) -> _Verdict:
        """4. Scale down: for `down_window_s` the fleet did well under what it can, with no
        trainer waiting on it, and fewer workers cover demand with confidence. Otherwise
        hold, saying whether the trainers stall past the workers or all is balanced."""
        c, caps = self.config, w.caps
        if w.stall >= c.stall_threshold:
            why = ("downstream", f"trainers stall while workers hold batches for them: the bottleneck is past "
                                 f"the workers (client, network), more workers would not help; {w.numbers}")
        else:
            why = ("balanced", f"balanced; {w.numbers}")
        # The window must span `down_window_s`; samples are kept longer than that, so jittered
        # ticks do not miss it by a hair (see ``observe``).
        if now - self._samples[0].t < c.down_window_s - 1e-9 or caps is None:
            return _Hold(*why)
        down = [s for s in self._samples if s.t > now - c.down_window_s - 1e-9]
        if not self._idle(down):
            return _Hold(*why)
        level, upper = self._demand_bounds(down)
        if not math.isfinite(upper):
            return _Hold(*why)
        target = self._estimator.needed(upper + self._headroom(level, w.mean_cap), caps)
        if target < n and self._falling(down, level, target, caps, w.mean_cap,
                                        max(c.min_workers, n - math.ceil(n * c.max_down_fraction))):
            return _Hold("falling", f"{why[1]}; demand still falling ({level:,.0f} rows/s over the window): "
                                 "trimming once it settles")
        if self._floor is not None:
            if level > self._floor.level * (1 - c.hysteresis):
                if target <= self._floor.count:
                    why = (why[0], f"{why[1]}; kept above {self._floor.count} workers, too few at "
                                   f"{self._floor.level:,.0f} rows/s")
                target = max(target, self._floor.count + 1)
            else:
                self._floor = None          # demand fell well below: the old limit no longer applies
        target = max(target, c.min_workers, n - math.ceil(n * c.max_down_fraction))
        if target >= n:
            return _Hold(*why)
        return self._act(now, "remove", n - target, target,
                         f"idle for {now - down[0].t:.0f} s; demand {level:,.0f} rows/s "
                         f"(+{upper - level:,.0f} at {c.confidence_z:g} se) is covered by {target} "
                         f"workers at ~{w.mean_cap:,.0f} rows/s each (utilization "
                         f"{level / float(caps.sum()):.0%} of {n}); {w.numbers}",
                         self._least_useful(n - target))

    def _no_trainer(self, now: float, n: int, w: _Window) -> _Verdict:
        """6. No client session is live: no trainer is there to be served, and none says what
        the next one will want (the demand the other rules size a trim by). Once none has been
        for `down_window_s` (the scale-down's own patience: a trainer restarting, or the next
        job of a sequence, reconnects well within it), trim straight to `min_workers`, in one
        step: no estimate can be wrong by much, and a trainer that comes back is grown for
        as after any start. Until then, and at `min_workers`, hold and say so."""
        c = self.config
        alone = now - self._alone_since
        where = f"no trainer connected for {alone:.0f} s"
        if n <= c.min_workers:
            return _Hold("no-trainer", f"{where}; at min_workers {c.min_workers}; {w.numbers}")
        if alone < c.down_window_s - 1e-9:
            return _Hold("no-trainer", f"{where}: trimming to min_workers {c.min_workers} once none has been "
                                       f"for {c.down_window_s:.0f} s; {w.numbers}")
        return self._act(now, "remove", n - c.min_workers, c.min_workers,
                         f"{where}: trimming to min_workers {c.min_workers}; {w.numbers}",
                         self._least_useful(n - c.min_workers))

    def _idle(self, down: list[_Sample]) -> bool:
        """No trainer waited on the workers over the window. Where workers report how busy
        they are, that is all it takes (how much less they could do is then measured); else
        the old stand-in: buffers persistently full (a poor one under credit streaming: a
        burst waits in the clients' windows, and pieces held ahead do not count)."""
        c = self.config
        if all(not math.isnan(s.busy) for s in down):
            starved = [s.starved if s.starved is not None else s.stall * (s.fill < c.low_fill) for s in down]
            return float(np.mean(starved)) < c.stall_threshold
        return float(np.mean([s.fill for s in down])) >= c.high_fill and min(s.fill for s in down) >= c.low_fill

    def _falling(self, down: list[_Sample], level: float, target: int, caps: np.ndarray, mean_cap: float,
                 lowest: int) -> bool:
        """Demand fell inside the window, so far that the latest rate window alone would
        trim deeper than ``target`` (within one step's limit ``lowest``), which the whole
        window's bound sets: that bound is widened by the fall itself, and the next trim
        would wait a whole window more. Holding until the fall has left the window trims
        once, to the end. (Noise that trips this only delays a trim, never deepens one.)"""
        c = self.config
        now_level, now_upper = _bound([s.wanted for s in down if s.t > down[-1].t - c.window_s - 1e-9],
                                      c.confidence_z)
        if not now_upper < level:
            return False
        deeper = self._estimator.needed(now_upper + self._headroom(now_level, mean_cap), caps)
        return max(deeper, lowest) < max(target, lowest)

    def _demand_bounds(self, down: list[_Sample]) -> tuple[float, float]:
        """Demand (rows/s) and its upper confidence bound: from the long demand tracker once it
        has enough blocks, else from this window's own samples (so a fleet need not wait
        for three fresh blocks after demand fell before it can shrink). A window whose upper
        bound lies below the tracker's mean says demand fell while the tracker's blocks were
        too noisy to notice (a ramp-up inflates their spread): those blocks are stale."""
        c = self.config
        # The window's latest `down_window_s - window_s` only: rates are averages over the
        # master's rate window (as long as `window_s`), so after demand fell the window's first
        # samples still carry the old level, while the window (no trainer starved) may have
        # begun before the fall.
        fresh = [s.wanted for s in down if s.t > down[-1].t - (c.down_window_s - c.window_s) - 1e-9]
        level, upper = _bound(fresh, c.confidence_z)
        if math.isfinite(self._demand.upper()):
            if upper < self._demand.mean:
                log.debug("autoscale: demand fell to %.0f rows/s, below the tracked %.0f: tracking it afresh",
                          level, self._demand.mean)
                self._demand.reset()
            else:
                return self._demand.mean, self._demand.upper()
        return level, upper

    def _act(self, now: float, action: str, count: int, target: int, reason: str,
             remove: tuple[str, ...] = ()) -> Decision:
        d = Decision(now, action, count, target, reason, remove)
        self._estimator.selected = self._estimator.selected or action == "remove"
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


def _bound(wanted: list[Optional[float]], z: float) -> tuple[float, float]:
    """Mean of the known values and its upper confidence bound (nan, inf: too few known)."""
    known = np.array([w for w in wanted if w is not None])
    if len(known) < 3 or len(known) < len(wanted) // 2:
        return math.nan, math.inf
    level = float(known.mean())
    return level, level + z * _se(known)
