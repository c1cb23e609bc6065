"""Yardsticks for ``AutoscalePolicy``: a CPU-target rule and a fixed count.

CPU is deliberately not a scaling signal: an I/O-bound worker is saturated at 30%
CPU. ``CpuTargetPolicy`` (the Kubernetes HPA rule) shows why, and ``OraclePolicy``
is the fixed-count yardstick for worker-seconds.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

from .signals import Decision, Observation

log = logging.getLogger(__name__)


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

    def observe(self, obs: Observation) -> Optional[Decision]:
        c, now = self.config, obs.time
        if now < self._next:
            return None
        self._next = now + c.period_s
        ready, pending = len(obs.workers), obs.pending_workers
        current = ready + pending
        if ready:
            cpu_sum = float(sum(w.cpu for w in obs.workers))
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
            d = Decision(now, "remove", k, desired, why, tuple(w.worker_id for w in obs.workers[-k:]))
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

    def observe(self, obs: Observation) -> Optional[Decision]:
        current = len(obs.workers) + obs.pending_workers
        if current < self.workers:
            d = Decision(obs.time, "add", self.workers - current, self.workers, f"fixed at {self.workers}")
        elif len(obs.workers) > self.workers:
            k = len(obs.workers) - self.workers
            d = Decision(obs.time, "remove", k, self.workers, f"fixed at {self.workers}",
                         tuple(w.worker_id for w in obs.workers[-k:]))
        else:
            return None
        self.decisions.append(d)
        return d
