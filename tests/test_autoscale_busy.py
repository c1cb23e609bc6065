"""Scale-down on what the fleet does: busy share, consumption and starvation, with jittered ticks.

Hand-made observations as a live master builds them under credit streaming: worker
buffers look empty (pieces wait in the clients' windows), clients always report the
starved part of their stall and the rows they consumed.
"""
from __future__ import annotations

import random
from typing import Callable, Optional

import pytest

from remoteloader.master.autoscale import AutoscaleConfig, AutoscalePolicy, ClientSignal, Decision, Observation, WorkerSignal

CAP = 2_000.0  # rows/s a worker makes flat out


def run(policy: AutoscalePolicy, workers: list[str], seconds: float, demand: Callable[[float], float],
        start: float = 0.0, jitter: float = 0.0, drift: float = 0.0, seed: int = 0,
        starved: Optional[float] = None) -> tuple[float, list[Decision]]:
    """Tick the policy for ``seconds`` at "at least 1 s after the last tick" (plus jitter and
    drift), carrying out its decisions at once; the trainer takes ``demand(t)`` rows/s when
    the fleet can make it and is starved for the rest."""
    rng, t, acted = random.Random(seed), start, []
    next_id = len(workers)
    while t < start + seconds:
        want = demand(t)
        supply = CAP * len(workers)
        got = min(want, supply)
        share = got / max(len(workers), 1)
        busy = share / CAP
        lacking = 0.0 if want <= supply else 1.0 - supply / want
        obs = Observation(t, tuple(WorkerSignal(w, share, 0, 16, busy, busy) for w in workers),
                          (ClientSignal("c", lacking, got / 64, lacking if starved is None else starved, got),))
        d = policy.observe(obs)
        if d is not None and d.action == "add":
            for _ in range(d.count):
                workers.append(f"w{next_id}")
                next_id += 1
        elif d is not None and d.action == "remove":
            for w in d.remove[: d.count]:
                workers.remove(w)
        if d is not None and d.action != "hold":
            acted.append(d)
        t += 1.0 + rng.uniform(0.0, jitter) + drift
    return t, acted


def slow(t: float) -> float:
    return 128.0


@pytest.mark.parametrize("jitter,drift", [(0.0, 0.0), (0.01, 0.0), (0.0, 0.002), (0.01, 0.002)])
def test_an_idle_fleet_shrinks_to_one_within_a_minute_whatever_the_ticks(jitter: float, drift: float) -> None:
    policy = AutoscalePolicy(AutoscaleConfig(min_workers=1, max_workers=3))
    workers = ["w0", "w1", "w2"]
    t, _ = run(policy, workers, 60, lambda t: 10 * CAP, jitter=jitter, drift=drift)  # flat out: learn capacity
    assert len(workers) == 3
    slowed = t
    t, acted = run(policy, workers, 60, slow, start=t, jitter=jitter, drift=drift)
    removals = [d for d in acted if d.action == "remove"]
    assert workers and len(workers) == 1, [d.reason for d in policy.decisions[-5:]]
    assert removals[-1].time - slowed <= 60
    assert "busy" in removals[0].reason


def test_capacity_is_learned_from_rows_over_busy_share() -> None:
    policy = AutoscalePolicy(AutoscaleConfig(min_workers=1, max_workers=3))
    run(policy, ["w0"], 30, lambda t: 500.0)  # a quarter busy all along
    caps = policy._estimates()
    assert caps is not None and caps[0] == pytest.approx(CAP, rel=0.01)


def test_a_fleet_whose_trainer_starves_now_and_then_keeps_its_workers() -> None:
    policy = AutoscalePolicy(AutoscaleConfig(min_workers=1, max_workers=3))
    workers = ["w0", "w1", "w2"]
    run(policy, workers, 60, lambda t: 10 * CAP)
    _, acted = run(policy, workers, 120, slow, start=60, starved=0.01)
    assert len(workers) == 3 and not [d for d in acted if d.action == "remove"]


def test_a_busy_fleet_is_not_shrunk_below_what_it_does() -> None:
    """Trainers take 2.1 workers' worth: 3 stay (2 would run 105% busy)."""
    policy = AutoscalePolicy(AutoscaleConfig(min_workers=1, max_workers=3))
    workers = ["w0", "w1", "w2"]
    run(policy, workers, 60, lambda t: 10 * CAP)
    run(policy, workers, 120, lambda t: 2.1 * CAP, start=60, jitter=0.01)
    assert len(workers) == 3


def test_half_a_fleet_is_shed_when_it_does_half_the_work() -> None:
    """Six workers doing 2.4 workers' worth: down to the count whose capacity covers it, with headroom."""
    policy = AutoscalePolicy(AutoscaleConfig(min_workers=1, max_workers=8))
    workers = [f"w{i}" for i in range(6)]
    run(policy, workers, 60, lambda t: 12 * CAP)
    run(policy, workers, 150, lambda t: 2.4 * CAP, start=60, jitter=0.01, drift=0.002)
    assert 3 <= len(workers) <= 4, [d.reason for d in policy.decisions if d.action != "hold"]
