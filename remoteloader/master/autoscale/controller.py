"""The autoscaler in a running master: signals in, launcher and drain out.

Each second it turns the master's view (heartbeat rates, buffers, client stall) into a
``Observation``, asks the policy (``rules.py``), and acts: ``add`` launches workers,
``remove`` drains the workers the policy names (they leave by themselves once clients
have consumed what they hold, so nothing is lost). In a master the launcher is a
``LauncherThread``: starting, counting and reaping workers never block the loop, and a
start shows in ``running()`` at once, so no tick asks twice for the same workers. The
policy's ``decisions`` are the log of what it did and why; ``recent_decisions`` shows
them in ``remoteloader status``.

With a ``state_path`` (the master's journal directory), a policy that has
``state_dict`` (``AutoscalePolicy``) is restored from that file when the autoscaler is
created and saved to it, atomically, at most every ``save_interval_s`` when it changed
and at ``stop``: a restarted master keeps the learned worker throughput and limits.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from typing import TYPE_CHECKING, Callable, Optional

from .config import AutoscaleConfig
from .rules import AutoscalePolicy
from .signals import ClientSignal, Observation, Policy, WorkerSignal

if TYPE_CHECKING:  # types only: the policy and the simulator import this package without the master
    from ..launcher import Launcher
    from ..service import MasterService

log = logging.getLogger(__name__)


class Autoscaler:
    save_interval_s = 30.0

    def __init__(self, service: MasterService, launcher: Launcher, config: AutoscaleConfig,
                 policy: Optional[Policy] = None, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = 1.0, state_path: Optional[str] = None) -> None:
        self.service, self.launcher, self.config = service, launcher, config
        self.policy = policy or AutoscalePolicy(config)
        self.clock, self.interval_s = clock, interval_s
        self._next = 0.0
        # Only policies with learned state persist it (not the CPU-target or fixed baselines).
        stateful = hasattr(self.policy, "state_dict") and hasattr(self.policy, "load_state_dict")
        self.state_path = state_path if stateful else None
        self._saved: Optional[dict] = None      # what the file holds, as far as we know
        self._next_save = -float("inf")
        if self.state_path is not None:
            self._load_state()

    def start(self) -> None:
        """Begin at ``min_workers``, counting workers the launcher already has (a restarted
        master adopts its detached Ray workers)."""
        self.launcher.start(max(0, self.config.min_workers - self.launcher.running()))

    def stop(self) -> None:
        """Master shutdown: save the policy's state if it changed since the last save."""
        self._save_state(self.clock(), force=True)

    def tick(self) -> None:
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.interval_s
        self.launcher.reap()
        observation = self.observation(now)
        decision = self.policy.observe(observation)
        self._save_state(now)
        if decision is None or decision.action == "hold":
            return
        if decision.action == "add":
            room = self.config.max_workers - self.launcher.running()
            self.launcher.start(max(0, min(decision.count, room)))
        elif decision.action == "remove":
            for worker_id in decision.remove[: decision.count]:
                if worker_id in self.service.fleet.workers:
                    self.service.drain(worker_id)

    def observation(self, now: float) -> Observation:
        fleet, rates = self.service.fleet, self.service.rates
        # Only workers that report count: one that registered and never heartbeated (a
        # registration flood, or a worker dying at start) must not make the pool look full.
        active = [w for w in fleet.workers.values() if not w.draining and w.stats]
        # Pieces prefetched for a next epoch serve no trainer now: they do not make a buffer full.
        workers = tuple(WorkerSignal(w.worker_id, rates.rate("w:" + w.worker_id, "rows"),
                                     max(0, w.buffered - int(w.stats.get("ahead", 0))),
                                     int(w.stats.get("capacity", 1)), float(w.stats.get("cpu", 0.0)),
                                     self.service.worker_busy(w.worker_id))
                        for w in active)
        # The trainers of every job: the fleet is sized for the sum of their demands.
        clients = tuple(ClientSignal(cid, self.service.client_stall(cid), rates.rate("c:" + cid, "batches"),
                                     self.service.client_starved(cid),
                                     rates.rate("c:" + cid, "rows") if "rows" in st.client_stats.get(cid, {}) else None)
                        for st in fleet.jobs.values() for cid in st.clients)
        draining = sum(1 for w in fleet.workers.values() if w.draining)
        pending = max(0, self.launcher.running() - len(active) - draining)
        return Observation(now, workers, clients, pending)

    def recent_decisions(self, n: int = 10) -> list[dict]:
        """The policy's last `n` decisions as plain data (for ``remoteloader status``),
        oldest first; a decision repeating the previous one's reason is left out."""
        decisions = self.policy.decisions
        picked = []
        for i in range(len(decisions) - 1, -1, -1):
            if len(picked) == n:
                break
            if i > 0 and decisions[i - 1].reason == decisions[i].reason:
                continue
            picked.append(decisions[i])
        out = []
        for d in reversed(picked):
            entry = dataclasses.asdict(d)
            entry["remove"] = list(entry["remove"])
            out.append(entry)
        return out

    # ------------------------------------------------------------------ state file

    def _load_state(self) -> None:
        try:
            with open(self.state_path, encoding="utf-8") as f:
                state = json.load(f)
            self.policy.load_state_dict(state)
        except FileNotFoundError:
            return
        except Exception as e:  # a damaged or foreign file must not stop the master
            log.warning("autoscaler: ignoring the saved state in %s: %s", self.state_path, e)
            return
        self._saved = state
        log.info("autoscaler: restored learned capacity and limits from %s", self.state_path)

    def _save_state(self, now: float, force: bool = False) -> None:
        """Write the policy's state if it changed, checking at most every `save_interval_s`
        (`force`: now). Atomic: a temporary file in the same directory, then a rename."""
        if self.state_path is None or (now < self._next_save and not force):
            return
        self._next_save = now + self.save_interval_s
        state = self.policy.state_dict()
        if state == self._saved:
            return
        try:
            fd, tmp = tempfile.mkstemp(prefix=".autoscale-", suffix=".tmp",
                                       dir=os.path.dirname(self.state_path) or ".")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.state_path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            log.warning("autoscaler: could not save its state to %s: %s", self.state_path, e)
            return
        self._saved = state
