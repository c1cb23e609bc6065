"""The autoscaler in a running master: signals in, launcher and drain out.

Each second it turns the master's view (heartbeat rates, buffers, client stall) into a
``Snapshot``, asks the policy (``autoscale.py``), and acts: ``add`` launches workers,
``remove`` drains the workers the policy names (they leave by themselves once clients
have consumed what they hold, so nothing is lost). Every decision is logged with its
reason and shown by ``remoteloader status``.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional

from .autoscale import AutoscaleConfig, AutoscalePolicy, ClientSignal, Policy, Snapshot, WorkerSignal
from .launcher import Launcher
from .service import MasterService

log = logging.getLogger(__name__)


class Autoscaler:
    def __init__(self, service: MasterService, launcher: Launcher, config: AutoscaleConfig,
                 policy: Optional[Policy] = None, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = 1.0) -> None:
        self.service, self.launcher, self.config = service, launcher, config
        self.policy = policy or AutoscalePolicy(config)
        self.clock, self.interval_s = clock, interval_s
        self._next = 0.0

    def start(self) -> None:
        """Begin at ``min_workers``."""
        self.launcher.start(self.config.min_workers)

    def tick(self) -> None:
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.interval_s
        self.launcher.reap()
        snapshot = self.snapshot(now)
        decision = self.policy.observe(snapshot)
        if decision is None or decision.action == "hold":
            if decision is not None:
                self._record(decision)
            return
        self._record(decision)
        if decision.action == "add":
            room = self.config.max_workers - self.launcher.running()
            self.launcher.start(max(0, min(decision.count, room)))
        elif decision.action == "remove":
            for worker_id in decision.remove[: decision.count]:
                if worker_id in self.service.state.workers:
                    self.service.drain(worker_id)

    def snapshot(self, now: float) -> Snapshot:
        st, rates = self.service.state, self.service.rates
        active = [w for w in st.workers.values() if not w.draining]
        workers = tuple(WorkerSignal(w.worker_id, rates.rate("w:" + w.worker_id, "rows"), w.buffered,
                                     int(w.stats.get("capacity", 1)), float(w.stats.get("cpu", 0.0)))
                        for w in active)
        clients = tuple(ClientSignal(cid, self.service.client_stall(cid), rates.rate("c:" + cid, "batches"))
                        for cid in st.clients)
        draining = sum(1 for w in st.workers.values() if w.draining)
        pending = max(0, self.launcher.running() - len(active) - draining)
        return Snapshot(now, workers, clients, pending)

    def _record(self, decision) -> None:
        entry = dataclasses.asdict(decision)
        entry["remove"] = list(entry["remove"])
        if not self.service.decisions or self.service.decisions[-1]["reason"] != entry["reason"]:
            log.info("autoscaler: %s %d -> %d workers: %s", decision.action, decision.count, decision.workers,
                     decision.reason)
            self.service.decisions.append(entry)
            del self.service.decisions[:-50]
