"""The autoscaler inside a master: saved policy state, the decision log, carrying out decisions.

A real ``MasterService`` fed worker heartbeats through ``handle``, a fake launcher and
a hand-driven clock: no processes, no sockets.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import pytest

from remoteloader.master.autoscale import (AutoscaleConfig, AutoscalePolicy, Autoscaler, CpuTargetConfig,
                                           CpuTargetPolicy, Decision, Observation)
from remoteloader.master.service import MasterConfig, MasterService
from tests.wire_helpers import ask


class FakeLauncher:
    def __init__(self) -> None:
        self.started: list[int] = []
        self.count = 0

    def start(self, n: int) -> None:
        self.started.append(n)
        self.count += n

    def running(self) -> int:
        return self.count

    def reap(self) -> int:
        return 0

    def stop_all(self) -> None:
        self.count = 0


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Fleet:
    """Workers registered with the service, heartbeating at their own rates (rows/s)."""

    def __init__(self, service: MasterService, rates: list[float]) -> None:
        self.service, self.rates = service, rates
        fingerprint = ""  # no job: workers of any job may register
        self.ids = [ask(service, {"t": "register", "addr": f"tcp://127.0.0.1:{7000 + i}", "pid": 100 + i,
                                    "fingerprint": fingerprint})[1]["worker_id"] for i in range(len(rates))]
        self.rows = [0.0] * len(rates)

    def heartbeat(self, wobble: float = 0.0) -> None:
        for i, wid in enumerate(self.ids):
            self.rows[i] += self.rates[i] * (1 + wobble)
            t, _ = ask(self.service, {"t": "heartbeat", "worker_id": wid, "token": self.service.keys.worker_token(wid),
                                        "buffered": 0,
                                        "stats": {"rows": round(self.rows[i]), "capacity": 8, "cpu": 0.5}})  # a count
            assert t == "heartbeat_ok"


def make(tmp_path: Path, state_path: Optional[str] = "default", policy=None, workers=(1000.0, 2000.0)):
    clock = Clock()
    service = MasterService(MasterConfig(), clock=clock)
    launcher = FakeLauncher()
    config = AutoscaleConfig(min_workers=len(workers), max_workers=4)
    path = str(tmp_path / "autoscale.json") if state_path == "default" else state_path
    scaler = Autoscaler(service, launcher, config, policy, clock=clock, state_path=path)
    scaler.start()
    return clock, service, scaler, Fleet(service, list(workers))


def run(clock: Clock, scaler: Autoscaler, fleet: Fleet, seconds: int) -> None:
    for _ in range(seconds):
        fleet.heartbeat(wobble=0.02 * ((int(clock.t) % 3) - 1))   # rates move a little: the state keeps changing
        scaler.tick()
        clock.t += 1.0


def saved(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "autoscale.json").read_text())


# ----------------------------------------------------------------------------- state file

def test_state_is_saved_at_most_every_30_s_and_restored(tmp_path: Path) -> None:
    clock, service, scaler, fleet = make(tmp_path)
    start = clock.t
    run(clock, scaler, fleet, 1)
    assert saved(tmp_path)["capacity"] == {}        # nothing learned yet at the first check
    run(clock, scaler, fleet, 29)
    learned = scaler.policy.state_dict()
    assert set(learned["capacity"]) == set(fleet.ids)
    assert saved(tmp_path)["capacity"] == {}, "no save within 30 s of the last one"
    run(clock, scaler, fleet, 1)                    # the tick at start + 30 s saves what changed
    assert clock.t - 1 == start + 30
    assert saved(tmp_path) == json.loads(json.dumps(scaler.policy.state_dict()))
    run(clock, scaler, fleet, 10)
    assert saved(tmp_path) != scaler.policy.state_dict()
    scaler.stop()                                   # shutdown saves whatever changed since
    state = scaler.policy.state_dict()
    assert saved(tmp_path) == state
    caps = state["capacity"]
    assert caps[fleet.ids[0]] == pytest.approx(1000, rel=0.05) and caps[fleet.ids[1]] == pytest.approx(2000, rel=0.05)
    assert [p.name for p in tmp_path.iterdir()] == ["autoscale.json"], "no temporary file left behind"

    # A restarted master (same journal directory) starts from what was learned.
    _, _, again, _ = make(tmp_path)
    assert again.policy.state_dict() == state
    assert again.policy.state_dict() != AutoscalePolicy().state_dict()


def test_nothing_is_saved_without_a_path_or_for_a_stateless_policy(tmp_path: Path) -> None:
    clock, _, scaler, fleet = make(tmp_path, state_path=None)
    run(clock, scaler, fleet, 40)
    scaler.stop()
    cpu = CpuTargetPolicy(CpuTargetConfig(min_workers=2, max_workers=4))
    clock, _, scaler, fleet = make(tmp_path, policy=cpu)
    assert scaler.state_path is None
    run(clock, scaler, fleet, 40)
    scaler.stop()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", [
    "{not json",
    '{"version": 99, "capacity": {}}',
    "[1, 2]",
    '{"version": 1, "capacity": {"w-1": 1500.0}, "plateau": [3]}',   # valid start, bad later: nothing applied
    '{"version": 1, "capacity": {"w-1": "fast"}}',
], ids=["not-json", "version", "not-a-map", "bad-plateau", "bad-capacity"])
def test_a_corrupt_or_unsupported_state_file_is_ignored(tmp_path: Path, content: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "autoscale.json").write_text(content)
    with caplog.at_level(logging.WARNING, logger="remoteloader.master.autoscale"):
        clock, _, scaler, fleet = make(tmp_path)
    assert scaler.policy.state_dict() == AutoscalePolicy().state_dict()
    assert any("ignoring the saved state" in r.getMessage() and "autoscale.json" in r.getMessage()
               for r in caplog.records)
    run(clock, scaler, fleet, 10)                   # the master carries on, and replaces the file
    scaler.stop()
    assert saved(tmp_path) == scaler.policy.state_dict()


# ----------------------------------------------------------------------------- decision log

def test_recent_decisions_are_the_policys_and_status_shows_them(tmp_path: Path) -> None:
    clock, service, scaler, fleet = make(tmp_path, state_path=None)
    assert ask(service, {"t": "status"})[1]["status"]["autoscaler"] == []    # no autoscaler attached
    service.decision_log = scaler.recent_decisions                            # as the master's main does
    run(clock, scaler, fleet, 30)
    policy = scaler.policy
    assert policy.decisions, "a clean window yields at least a hold saying why"
    last = policy.decisions[-1]
    assert scaler.recent_decisions()[-1] == {"time": last.time, "action": last.action, "count": last.count,
                                             "workers": last.workers, "reason": last.reason, "remove": []}
    t, reply = ask(service, {"t": "status"})
    assert t == "status_reply" and reply["status"]["autoscaler"] == scaler.recent_decisions()
    json.dumps(reply["status"]["autoscaler"])       # plain data for the wire

    # Ten at most, oldest first; a repeat of the previous reason is left out.
    policy.decisions[:] = [Decision(float(i), "hold", 0, 2, f"reason {i // 2}") for i in range(30)]
    policy.decisions.append(Decision(30.0, "remove", 1, 1, "fewer will do", ("w-a",)))
    recent = scaler.recent_decisions()
    assert [d["reason"] for d in recent] == [f"reason {i}" for i in range(6, 15)] + ["fewer will do"]
    assert [d["time"] for d in recent][:2] == [12.0, 14.0], "the first of a repeated reason is kept"
    assert recent[-1]["remove"] == ["w-a"]
    assert [d["reason"] for d in scaler.recent_decisions(3)] == ["reason 13", "reason 14", "fewer will do"]
    assert ask(service, {"t": "status"})[1]["status"]["autoscaler"] == recent


# ----------------------------------------------------------------------------- acting

class Scripted:
    """A policy that answers each tick with the next decision of a script."""

    def __init__(self, script: list[Optional[Decision]]) -> None:
        self.script, self.decisions = list(script), []
        self.observations: list[Observation] = []

    def observe(self, obs: Observation) -> Optional[Decision]:
        self.observations.append(obs)
        d = self.script.pop(0) if self.script else None
        if d is not None:
            self.decisions.append(d)
        return d


def test_adds_through_the_launcher_and_drains_removed_workers(tmp_path: Path) -> None:
    policy = Scripted([None, Decision(0, "hold", 0, 2, "why not"), Decision(0, "add", 5, 7, "more"), None])
    clock, service, scaler, fleet = make(tmp_path, policy=policy)
    assert scaler.state_path is None                # a policy without state_dict saves nothing
    run(clock, scaler, fleet, 4)
    assert scaler.launcher.started == [2, 2], "min_workers at start, then the add capped at max_workers"
    assert policy.observations[-1].pending_workers == 2 and len(policy.observations[-1].workers) == 2
    victim = fleet.ids[0]
    policy.script = [Decision(0, "remove", 2, 2, "fewer", ("w-gone", victim))]
    run(clock, scaler, fleet, 1)
    assert service.state.workers[victim].draining and not service.state.workers[fleet.ids[1]].draining
    run(clock, scaler, fleet, 1)
    assert [w.worker_id for w in policy.observations[-1].workers] == [fleet.ids[1]], "draining workers are left out"


def test_start_counts_the_workers_the_launcher_already_has() -> None:
    """A restarted master that adopted running workers tops up to min_workers, no more."""
    clock = Clock()
    service = MasterService(MasterConfig(), clock=clock)
    launcher = FakeLauncher()
    launcher.count = 2  # adopted
    Autoscaler(service, launcher, AutoscaleConfig(min_workers=3, max_workers=4), clock=clock).start()
    assert launcher.started == [1] and launcher.running() == 3
