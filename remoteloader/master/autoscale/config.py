"""Settings of ``AutoscalePolicy`` (see docs/autoscaling.md, "Defaults and why")."""
from __future__ import annotations

from dataclasses import dataclass


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
    # Scale-down: no trainer waited on the workers (or, for workers that do not report how busy
    # they are, buffers persistently full), and the learned throughput of fewer workers covers
    # demand plus its uncertainty. Demand is tracked in blocks across worker changes (what the
    # trainers want does not depend on the worker count), so trims get finer the longer it runs.
    high_fill: float = 0.7          # mean buffer fill over `down_window_s` needed to scale down
    demand_block_s: float = 10.0    # demand block length; the spread of block means gives its error
    max_down_fraction: float = 0.5  # remove at most half the workers per step (rounded up: 3 -> 1)
    headroom: float = 0.02          # spare supply kept: this fraction of demand ...
    headroom_workers: float = 1.0   # ... capped at this many workers' worth (1000 workers need not keep 20 spare)
    jitter_margin: float = 7.0      # ... raised so demand jitter empties the buffers ~exp(-7) of the time
    hysteresis: float = 0.1         # demand must move this much before a remembered limit is forgotten
    # Learning per-worker throughput: rows/s over busy share for workers that report it and were
    # busy at least `min_busy` of the window (below, the ratio is mostly noise); else the rate of
    # workers whose buffer is at most `saturated_fill` full.
    min_busy: float = 0.2
    saturated_fill: float = 0.5
    learn_tau_s: float = 30.0       # EWMA time constant
    hold_log_s: float = 300.0       # repeat an unchanged "hold" at most this often

