"""How workers come and go: a small interface, and its local and Ray implementations.

A launcher only starts worker processes and notices when they end; workers then
fetch the spec and register with the master like any other worker. Scale-down never
goes through the launcher: the master drains a worker (``MasterService.drain``), the
worker leaves by itself once clients consumed what it holds, and ``reap`` notices.

To add an engine (e.g. a Kubernetes Deployment: ``start`` raises the replica count
and ``reap`` counts pods that terminated), implement the four methods of ``Launcher``
and register it in ``make_launcher``.
"""
from __future__ import annotations

import logging
import subprocess
import sys
from typing import Optional, Protocol, Sequence

log = logging.getLogger(__name__)


class Launcher(Protocol):
    def start(self, n: int) -> None:
        """Launch ``n`` more workers pointed at the master."""

    def running(self) -> int:
        """Workers launched and not known to have ended (some may still be starting)."""

    def reap(self) -> int:
        """Forget workers that ended; returns how many ended without being asked to."""

    def stop_all(self) -> None:
        """Master shutdown: end every worker now (they are stateless: nothing to drain)."""


class LocalLauncher:
    """Worker processes on this machine, tied to the master's lifetime."""

    def __init__(self, master_addr: str, worker_args: Sequence[str] = ()) -> None:
        self.master_addr = master_addr
        self.worker_args = list(worker_args)
        self.procs: list[subprocess.Popen] = []

    def start(self, n: int) -> None:
        for _ in range(n):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "remoteloader.worker", "--master", self.master_addr, "--die-with-parent",
                 *self.worker_args]))

    def running(self) -> int:
        return len(self.procs)

    def reap(self) -> int:
        exited = [p for p in self.procs if p.poll() is not None]
        for p in exited:
            self.procs.remove(p)
            if p.returncode != 0:
                log.warning("local worker pid %d exited with code %s", p.pid, p.returncode)
        return sum(1 for p in exited if p.returncode != 0)

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self.procs.clear()


class RayLauncher:
    """Workers as Ray actors (one CPU each by default) on an existing Ray cluster.

    Ray places the actors, and its autoscaler adds nodes when they do not fit. Each
    actor runs an ordinary ``Worker`` bound to its node's IP address. The actors belong
    to the master's Ray job, so Ray ends them if the master dies.
    """

    def __init__(self, master_addr: str, address: str, num_cpus: float = 1.0, buffer_batches: int = 16) -> None:
        import ray

        from ..worker.ray_actor import RayWorker

        if not ray.is_initialized():
            ray.init(address=address, namespace="remoteloader", log_to_driver=False, ignore_reinit_error=True)
        self._ray = ray
        self._actor_cls = ray.remote(num_cpus=num_cpus)(RayWorker)
        self.master_addr = master_addr
        self.buffer_batches = buffer_batches
        self.actors: list[tuple] = []  # (actor handle, ObjectRef of its run())

    def start(self, n: int) -> None:
        for _ in range(n):
            actor = self._actor_cls.remote()
            self.actors.append((actor, actor.run.remote(self.master_addr, self.buffer_batches)))

    def running(self) -> int:
        return len(self.actors)

    def reap(self) -> int:
        if not self.actors:
            return 0
        refs = [ref for _, ref in self.actors]
        done, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        failed = 0
        for actor, ref in [a for a in self.actors if a[1] in done]:
            self.actors.remove((actor, ref))
            try:
                self._ray.get(ref)
            except Exception as e:  # the actor died (node lost, OOM, killed)
                log.warning("ray worker ended: %s", e)
                failed += 1
            self._ray.kill(actor)
        return failed

    def stop_all(self) -> None:
        for actor, _ in self.actors:
            self._ray.kill(actor)
        self.actors.clear()


def make_launcher(kind: str, master_addr: str, *, ray_address: Optional[str] = None,
                  worker_args: Sequence[str] = (), buffer_batches: int = 16) -> Launcher:
    if kind == "local":
        return LocalLauncher(master_addr, ["--buffer-batches", str(buffer_batches), *worker_args])
    if kind == "ray":
        if not ray_address:
            raise ValueError("--launcher ray needs --ray-address (e.g. 127.0.0.1:6379, or 'auto')")
        return RayLauncher(master_addr, ray_address, buffer_batches=buffer_batches)
    raise ValueError(f"unknown launcher {kind!r} (local, ray)")
