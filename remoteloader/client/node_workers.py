"""The workers of one node of a multi-node torchrun job, owned by that node's first rank.

Rank 0's embedded master starts the workers of its own node (``--workers``). On every other
node, the node's first rank starts ``remoteloader-worker`` processes that register with that
master over the network, with the job's keys (``jobkeys.py``), data sockets bound to this
node's reachable address, and the node's name, so the master gives them to this node's ranks
first. They never outlive their owner: ``close()`` stops them (after every rank of the job has
closed: ``placement.py``), and Linux's parent-death signal (``--die-with-parent``) ends them
if the owner dies without closing. Table and cache reach them in their environment, as for
the embedded master's own workers: a URI may hold a credential, and command lines are public.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional, Sequence

from ..core.cache.location import ENV_CACHE
from ..core.procs import stop as stop_process
from ..core.redact import allowlist_env
from ..protocol.auth import ENV_AUTH

STOP_S = 10.0  # a worker's bounded stop


class NodeWorkers:
    """``count`` local worker processes of the master at ``master``."""

    def __init__(self, master: str, count: int, bind_host: str, node: str, auth_dir: str,
                 allowed_tables: Sequence[str], cache: Optional[str] = None, log_file: Optional[str] = None) -> None:
        env = {k: v for k, v in os.environ.items() if k not in (ENV_AUTH, ENV_CACHE)}
        env.update(allowlist_env(allowed_tables), **{ENV_AUTH: auth_dir}, **({ENV_CACHE: cache} if cache else {}))
        argv = [sys.executable, "-m", "remoteloader.worker", "--master", master, "--bind-host", bind_host,
                "--node", node, "--die-with-parent"]
        self.procs: list[subprocess.Popen] = []
        log = open(log_file, "a") if log_file is not None else None
        try:
            for _ in range(count):
                self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env))
        except BaseException:
            self.close()
            raise
        finally:
            if log is not None:
                log.close()

    def close(self) -> None:
        """Stop every worker (idempotent). Called once no rank reads any more, so a worker's
        drain (SIGTERM) has nothing to wait for: it leaves at its next heartbeat, saying bye, or
        at once while it is still starting; killed if it has not gone within ``STOP_S``."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            stop_process(proc, timeout=STOP_S)
