"""Issue 38, finding 2: an idle fleet with no trainer connected shrinks to ``min_workers``.

After its trainer exited, a master grown to 3 workers held them for 25 minutes with
``balanced; stall 0.0%, workers busy 0%, buffers 0% full, 0 rows/s from 3 workers``:
with no client, nothing said what the trainers want, so no trim could be sized. With no
live client session for a whole ``down_window_s``, the policy now trims straight to
``min_workers`` and says why ("no trainer connected").
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest

from benchmarks.simulator import simulate
from remoteloader.master.autoscale import (AutoscaleConfig, AutoscalePolicy, Autoscaler, ClientSignal, Decision,
                                           Observation, WorkerSignal)
from tests.test_autoscale_controller import FakeLauncher
from tests.wire_helpers import ask


def _idle_workers(n: int) -> tuple[WorkerSignal, ...]:
    return tuple(WorkerSignal(f"w{i}", 0.0, 0, 8, 0.02, 0.0) for i in range(n))


def _moves(decisions: list[Decision]) -> list[Decision]:
    return [d for d in decisions if d.action in ("add", "remove")]


def test_with_no_trainer_for_a_down_window_the_fleet_trims_to_min_workers() -> None:
    config = AutoscaleConfig(min_workers=1, max_workers=3)
    policy = AutoscalePolicy(config)
    for t in range(80):
        n = 3 - sum(d.count for d in _moves(policy.decisions))
        policy.observe(Observation(float(t), _idle_workers(n), ()))
    (trim,) = _moves(policy.decisions)
    assert (trim.action, trim.count, trim.workers) == ("remove", 2, 1), trim
    assert "no trainer connected" in trim.reason and len(trim.remove) == 2
    # Not before a whole down window without a trainer (none from the first tick), nor later.
    assert config.down_window_s <= trim.time <= config.down_window_s + 1
    # Meanwhile it says what it waits for, naming the same reason.
    holds = [d for d in policy.decisions if d.action == "hold" and d.time < trim.time]
    assert holds and all("no trainer connected" in d.reason for d in holds)
    # At min_workers: a hold that says so, no further trim.
    after = [d for d in policy.decisions if d.time > trim.time]
    assert after and all(d.action == "hold" and "no trainer connected" in d.reason for d in after)


def test_a_trainer_that_connects_inside_the_window_keeps_the_fleet() -> None:
    """A trainer connected (even an idle one, e.g. between epochs) is the normal rules' to
    judge; one seen inside the window restarts the count."""
    policy = AutoscalePolicy(AutoscaleConfig(min_workers=1, max_workers=3))
    idle_trainer = (ClientSignal("c0", 0.0, 0.0, 0.0, 0.0),)
    for t in range(80):
        n = 3 - sum(d.count for d in _moves(policy.decisions))
        policy.observe(Observation(float(t), _idle_workers(n), idle_trainer if 20 <= t < 25 else ()))
    trims = [d for d in _moves(policy.decisions) if "no trainer connected" in d.reason]
    told = [(d.time, d.action, d.reason) for d in policy.decisions]
    # Without the trainer's visit the trim came at 35 s; its last tick (24 s) restarts the count.
    assert trims and 25 + 30 - 1e-9 <= trims[0].time <= 25 + 30 + 2, told
    assert [d for d in _moves(policy.decisions) if d.time < trims[0].time] == [], told


def test_min_workers_zero_trims_everything_and_a_trainer_brings_one_back() -> None:
    policy = AutoscalePolicy(AutoscaleConfig(min_workers=0, max_workers=3))
    n = 2
    for t in range(60):
        policy.observe(Observation(float(t), _idle_workers(n), ()))
        n = 2 - sum(d.count for d in _moves(policy.decisions))
    assert n == 0
    starving = (ClientSignal("c0", 1.0, 0.0, 1.0, 0.0),)
    added = None
    for t in range(60, 120):
        added = added or policy.observe(Observation(float(t), (), starving))
        if added is not None and added.action == "add":
            break
    assert added is not None and added.action == "add" and added.workers >= 1


# -- in a master: a trainer starves 3 workers, then leaves ------------------------------------

def test_the_autoscaler_trims_after_the_trainer_leaves_the_master(service) -> None:
    """The issue's run in a real ``MasterService`` (fake clock, no processes): 3 workers flat
    out for a starving trainer (at ``max_workers``), the trainer says goodbye, the workers
    idle. Before: ``hold ... balanced`` for good. Now: 3 -> 1, drained through the master."""
    now, spec = service.now, service.spec
    call = functools.partial(ask, service)
    launcher = FakeLauncher()
    launcher.count = 3
    config = AutoscaleConfig(min_workers=1, max_workers=3)
    scaler = Autoscaler(service, launcher, config, clock=lambda: now[0])
    ids = [call({"t": "register", "addr": f"tcp://127.0.0.1:{7100 + i}", "pid": 20 + i,
                 "fingerprint": spec.fingerprint()})[1]["worker_id"] for i in range(3)]
    rows, busy = [0] * 3, [0.0] * 3

    def second(producing: bool, trainer: bool) -> None:
        now[0] += 1.0
        for i, wid in enumerate(ids):
            if wid not in service.state.workers:
                continue
            rows[i] += 640 if producing else 0
            busy[i] += 1.0 if producing else 0.0
            call({"t": "heartbeat", "worker_id": wid, "token": service.keys.worker_token(wid), "buffered": 0,
                  "stats": {"rows": rows[i], "batches": rows[i] // 64, "busy_s": busy[i], "cpu": 0.1,
                            "capacity": 8}})
        if trainer:
            k = now[0] - start
            call({"t": "client_heartbeat", "session": session, "seq": 0, "acks": [],
                  "stats": {"wait_s": 0.5 * k, "starved_s": 0.5 * k, "batches": int(30 * k), "rows": int(1920 * k)}})
        service.tick()
        scaler.tick()

    t, reply = call({"t": "hello", "rank": 0, "world_size": 1, "spec": spec.to_dict(),
                     "fingerprint": spec.fingerprint()})
    assert t == "welcome"
    session, start = reply["session"], now[0]
    call({"t": "start_epoch", "session": session, "epoch": 0})
    for _ in range(40):
        second(producing=True, trainer=True)
    assert not _moves(scaler.policy.decisions), "at max_workers while the trainer starves: nothing to do"
    call({"t": "goodbye", "session": session})
    left = now[0]
    for _ in range(60):
        second(producing=False, trainer=False)
    trims = _moves(scaler.policy.decisions)
    told = [f"t={d.time - left:+.0f} {d.action} -> {d.workers}: {d.reason}" for d in scaler.policy.decisions]
    assert len(trims) == 1 and trims[0].action == "remove" and trims[0].workers == 1, told
    assert "no trainer connected" in trims[0].reason, told
    assert trims[0].time - left <= config.down_window_s + config.window_s, told
    # The two it named were drained through the master (holding nothing, they left at once).
    assert set(service.state.workers) == set(ids) - set(trims[0].remove) and len(trims[0].remove) == 2
    assert not any("balanced" in line for line in told[-3:]), told


# -- the simulator's scenario ---------------------------------------------------------------

@pytest.mark.parametrize("exact", [False, True], ids=["jittered", "exact"])
def test_simulated_trainers_leave_and_the_fleet_goes_back_to_min_workers(exact: bool) -> None:
    from benchmarks.autoscale import TRAINERS_LEAVE

    sc = TRAINERS_LEAVE.exact() if exact else TRAINERS_LEAVE
    config = AutoscaleConfig(max_workers=sc.max_workers)
    r = simulate(sc, AutoscalePolicy(config))
    leave = sc.away[0]
    trace = r.trace
    grown = int(trace["active"][trace["t"] < leave][-1])
    assert grown == sc.max_workers, "grown to max_workers while the trainer starved"
    trims = [d for d in r.actions if d.time >= leave]
    assert len(trims) == 1 and trims[0].action == "remove" and "no trainer connected" in trims[0].reason
    # Back to min_workers one down window (plus the settle and a tick) after the trainer left.
    assert trims[0].time - leave <= config.down_window_s + config.settle_s + 2
    assert r.final_workers == config.min_workers


def test_simulated_trainers_come_back_and_the_fleet_grows_again() -> None:
    from benchmarks.autoscale import TRAINERS_LEAVE

    sc = replace(TRAINERS_LEAVE, name="leave-and-return", away=(90.0, 200.0), duration_s=330.0)
    r = simulate(sc, AutoscalePolicy(AutoscaleConfig(max_workers=sc.max_workers)))
    back = [d for d in r.actions if d.time >= 200.0]
    assert back and back[0].action == "add" and back[0].time - 200.0 < 30
    assert int(r.trace["active"][-1]) == sc.max_workers
    away = (r.trace["t"] > 130) & (r.trace["t"] < 200)
    assert math.isclose(float(r.trace["active"][away].max()), 1.0)
