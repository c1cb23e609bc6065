"""Autoscaling policy: how many workers a job needs, decided from what trainers feel.

The master calls ``AutoscalePolicy.observe(observation)`` every tick with the latest
heartbeat signals; the policy returns a ``Decision`` when it acts (and, rate-limited,
a "hold" that says why it does not). It never launches or drains anything itself:
the caller does that (``Autoscaler`` in a running master), which is also what lets
``benchmarks/simulator.py`` run this exact code against modelled workers.

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

Modules:
* ``signals``: ``WorkerSignal``, ``ClientSignal``, ``Observation``, ``Decision``, ``Policy``.
* ``config``: ``AutoscaleConfig``.
* ``estimators``: per-worker capacity (``CapacityEstimator``), demand tracking and the
  statistics behind them.
* ``rules``: ``AutoscalePolicy``.
* ``baselines``: ``CpuTargetPolicy``, ``OraclePolicy``.
* ``controller``: ``Autoscaler``, the policy at work in a running master.
"""
from __future__ import annotations

from .baselines import CpuTargetConfig, CpuTargetPolicy, OraclePolicy
from .config import AutoscaleConfig
from .controller import Autoscaler
from .rules import AutoscalePolicy
from .signals import ClientSignal, Decision, Observation, Policy, WorkerSignal

__all__ = ["AutoscaleConfig", "AutoscalePolicy", "Autoscaler", "ClientSignal", "CpuTargetConfig", "CpuTargetPolicy",
           "Decision", "Observation", "OraclePolicy", "Policy", "WorkerSignal"]
