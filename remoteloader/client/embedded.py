"""The embedded default: a master and local workers owned by the training process.

``RemoteDataLoader(spec)`` with no master address starts ``remoteloader-master
--workers N`` as a child process. The chain never outlives its owner: the loader stops
it on ``close()``, garbage collection and interpreter exit, and Linux's parent-death
signal stops the master (and the master's workers) even if the owner is SIGKILLed.

With several ranks (e.g. under ``torchrun``), rank 0 starts the cluster and publishes
its address; the other ranks find it in torch.distributed's default store when a
process group is initialized, else in the ``REMOTELOADER_MASTER`` environment variable
(``ranks.py``).

The embedded cluster is always authenticated (CURVE, ``protocol/auth.py``): without a
key directory of the user's, it makes ephemeral keys in a private temporary directory
(0700) that it removes at ``close``. The master gets the directory's path in
``REMOTELOADER_AUTH`` and hands it on to its workers the same way; rank 0 publishes the
path (never the keys) beside the address, for ranks on this machine (the master binds
loopback only) to read. The table the master may serve goes in its environment too
(``REMOTELOADER_ALLOW_TABLE``): a table URI may hold a credential, and any local user can
read a process's command line.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from typing import Optional, Sequence

from ..core.procs import stop as stop_process
from ..core.redact import allowlist_env
from ..protocol.auth import ENV_AUTH, EphemeralKeys

ENV_MASTER = "REMOTELOADER_MASTER"


class EmbeddedCluster:
    def __init__(self, num_workers: int, start_timeout: float = 60.0, extra_args: tuple = (),
                 auth_dir: Optional[str] = None, allowed_tables: Sequence[str] = ()) -> None:
        """``auth_dir``: the user's key directory; without it, ephemeral keys made here.
        ``allowed_tables``: the prefixes the master may serve (none: no client spec)."""
        self._keys = EphemeralKeys() if auth_dir is None else None
        self.auth_dir = os.path.abspath(auth_dir) if auth_dir is not None else self._keys.directory
        self.proc = None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                 "--workers", str(num_workers), "--die-with-parent", *extra_args],
                stdout=subprocess.PIPE, text=True,
                env=dict(os.environ, **{ENV_AUTH: self.auth_dir}, **allowlist_env(allowed_tables)))
            self.addr = self._read_address(start_timeout)
        except BaseException:
            self.close()
            raise

    def _read_address(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the embedded remoteloader master exited with code {self.proc.returncode} at start")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline()
                if "listening on " in line:
                    self.proc.stdout.close()
                    return line.rsplit("listening on ", 1)[1].strip()
        raise TimeoutError(f"the embedded remoteloader master did not start within {timeout:g} s")

    def close(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=10)
        if self._keys is not None:
            self._keys.close()


def resolve_rank(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    """torch.distributed when initialized, else RANK / WORLD_SIZE, else 0 / 1."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        else:
            r, w = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    return rank, world_size
