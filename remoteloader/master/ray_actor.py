"""The master as a Ray actor that Ray restarts when it dies (``remoteloader-master --ray-actor NAME``).

A detached, named actor runs ``remoteloader-master`` as its child process with the
operator's arguments, on the node that owns the ``--bind`` address (pinned there, so a
restarted master binds the same address and clients and workers find it again). When
the child dies unasked (a crash, the OOM killer, SIGKILL) the actor exits with it, and
Ray restarts the actor, up to ``max_restarts`` times; the new child replays the
journal and serves on. Clients and workers reconnect as after any master restart
(docs/guarantees.md). Ray's control store decides where and whether the actor runs:
no leader election of our own.

The master's workers are detached actors too (``--ray-detached-workers``): they outlive
a master that died, keep serving trainers from what they hold while it is away, and
the restarted master adopts them by name instead of starting a second pool.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Optional, Sequence

from ..core.procs import stop

STARTUP_TIMEOUT_S = 120.0


class MasterProcessActor:
    """The body of the Ray actor: one ``remoteloader-master`` process, exiting with it."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.stopping = False
        self.proc = subprocess.Popen([sys.executable, "-m", "remoteloader.master", *argv, "--die-with-parent"],
                                     stdout=subprocess.PIPE, text=True)
        first = self.proc.stdout.readline()  # "remoteloader-master listening on ADDR", or nothing if it failed
        if not first.startswith("remoteloader-master listening on "):
            code = self.proc.wait()
            # A constructor that raises ends the actor for good: a bad configuration is not retried.
            raise RuntimeError(f"remoteloader-master exited with code {code} before listening: see its stderr")
        self.addr = first.rsplit(" ", 1)[1].strip()
        threading.Thread(target=self._watch, daemon=True, name="master-watch").start()

    def _watch(self) -> None:
        for line in self.proc.stdout:  # keep the pipe drained; the master prints little
            sys.stdout.write(line)
        self.proc.wait()
        if not self.stopping:
            os._exit(1)  # the actor dies with its master, so that Ray restarts both

    def address(self) -> str:
        return self.addr

    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> Optional[int]:
        """End the master as SIGTERM does (it stops its workers); the caller then kills the actor."""
        self.stopping = True
        stop(self.proc, timeout=30)
        return self.proc.returncode


def _ray(address: str, token_file: Optional[str]):
    from .launcher import connect_ray
    return connect_ray(address, token_file)


def _node_of(ray, host: str) -> str:
    """The id of the live Ray node whose address is ``host`` (where the master must bind)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if host in ("*", "0.0.0.0", "::"):
        return ray.get_runtime_context().get_node_id()  # every interface: this driver's node
    for n in nodes:
        if n.get("NodeManagerAddress") == host:
            return n["NodeID"]
    raise ValueError(f"--bind host {host!r} is not the address of a live Ray node "
                     f"({', '.join(sorted(n.get('NodeManagerAddress', '?') for n in nodes))})")


def submit(name: str, host: str, argv: Sequence[str], address: str, token_file: Optional[str],
           max_restarts: int) -> str:
    """Start the named master actor (or find it running) and return the address it serves."""
    ray = _ray(address, token_file)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        actor = ray.get_actor(name)
    except ValueError:  # not running yet
        actor_cls = ray.remote(num_cpus=1, max_restarts=max_restarts, lifetime="detached", name=name,
                               max_concurrency=4,  # address() answers while stop() waits
                               scheduling_strategy=NodeAffinitySchedulingStrategy(_node_of(ray, host), soft=False))(
            MasterProcessActor)
        actor = actor_cls.remote(list(argv))
    return ray.get(actor.address.remote(), timeout=STARTUP_TIMEOUT_S)


def stop_actor(name: str, address: str, token_file: Optional[str]) -> bool:
    """Stop the named master (and its workers) for good; False if it was not running."""
    ray = _ray(address, token_file)
    try:
        actor = ray.get_actor(name)
    except ValueError:
        return False
    ray.get(actor.stop.remote(), timeout=60)
    ray.kill(actor, no_restart=True)
    return True
