"""How workers come and go. ``LocalLauncher`` runs them as processes on this machine.

A launcher only starts and stops worker processes; workers then register with the
master like any other. The interface is small on purpose (``start``, ``stop``,
``running``, ``reap``, ``stop_all``; scale-down goes through the master's drain) so another engine (Ray actors, a Kubernetes Deployment) can
stand in for it.
"""
from __future__ import annotations

import logging
import subprocess
import sys
from typing import Sequence


log = logging.getLogger(__name__)


class LocalLauncher:
    def __init__(self, master_addr: str, worker_args: Sequence[str] = ()) -> None:
        self.master_addr = master_addr
        self.worker_args = list(worker_args)
        self.procs: list[subprocess.Popen] = []

    def start(self, n: int = 1) -> None:
        for _ in range(n):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "remoteloader.worker", "--master", self.master_addr, "--die-with-parent",
                 *self.worker_args]))

    def running(self) -> int:
        return len(self.procs)

    def reap(self) -> list[int]:
        """Forget workers that exited; returns their exit codes."""
        exited = [p for p in self.procs if p.poll() is not None]
        for p in exited:
            log.warning("local worker pid %d exited with code %s", p.pid, p.returncode)
            self.procs.remove(p)
        return [p.returncode for p in exited]

    def stop_all(self) -> None:
        """Master shutdown: workers are stateless, so there is nothing to drain."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self.procs.clear()
