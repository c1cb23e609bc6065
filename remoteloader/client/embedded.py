"""The embedded default: a master and local workers owned by the training process.

``RemoteDataLoader(spec)`` with no master address starts ``remoteloader-master
--workers N`` as a child process. The chain never outlives its owner: the loader stops
it on ``close()``, garbage collection and interpreter exit, and Linux's parent-death
signal stops the master (and the master's workers) even if the owner is SIGKILLed.

With several ranks (e.g. under ``torchrun``), rank 0 starts the cluster and publishes
its address; the other ranks find it in torch.distributed's default store when a
process group is initialized, else in the ``REMOTELOADER_MASTER`` environment variable
(``ranks.py``). A job across several nodes binds the master to TCP instead, with keys
(``placement.py``); what follows is the one-node default.

One host, so the kernel is the lock: the master listens on ``ipc://DIR/master`` and its
workers on ``ipc://DIR/worker-<random>``, Unix sockets in a private directory ``DIR`` (mode
0700, this user's; under ``$XDG_RUNTIME_DIR`` or ``/tmp``) that the loader makes before its
name is on any command line (a name another user made first is never adopted: another fresh
name is taken) and hands over to the master, which removes it when it exits, also on its
parent-death signal; ``close`` removes it too, if the master could not. Another local user
cannot connect (the directory's permissions), nothing goes on the network, and there is no
CURVE: no keys at all, and no encryption cost on the data path. Only with a key directory
of the user's (``auth=DIR`` or ``REMOTELOADER_AUTH``) do the same ipc sockets run CURVE too,
with those keys, which the master hands on to its workers in their environment; rank 0
publishes the path (never the keys) beside the address for ranks on this machine. The table
the master may serve goes in its environment too (``REMOTELOADER_ALLOW_TABLE``): a table URI
may hold a credential, and any local user can read a process's command line.
"""
from __future__ import annotations

import os
import secrets
import select
import shutil
import stat
import subprocess
import sys
import time
from typing import Optional, Sequence

from ..core.cache.location import ENV_CACHE
from ..core.procs import stop as stop_process
from ..core.redact import allowlist_env
from ..protocol.address import ENV_IPC_HANDOVER, make_ipc_directory
from ..protocol.auth import ENV_AUTH

ENV_MASTER = "REMOTELOADER_MASTER"
# Where the embedded master and its workers write their logs: "stderr" keeps them on the
# trainer's console; else a directory (default $XDG_STATE_HOME/remoteloader/logs, 0700).
ENV_EMBEDDED_LOG = "REMOTELOADER_EMBEDDED_LOG"
LOGS_KEPT = 20  # the newest embedded clusters' log files kept in that directory


def new_log_file() -> Optional[str]:
    """A fresh private log file (0600, in a 0700 directory of this user's) for an embedded
    cluster, the oldest beyond ``LOGS_KEPT`` removed; None: logs stay on stderr."""
    setting = os.environ.get(ENV_EMBEDDED_LOG, "")
    if setting == "stderr":
        return None
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    directory = setting or os.path.join(base, "remoteloader", "logs")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise RuntimeError(f"log directory {directory} must be a directory of this user's with mode 0700 "
                           f"(set {ENV_EMBEDDED_LOG} to another, or to 'stderr')")
    old = sorted(n for n in os.listdir(directory) if n.startswith("embedded-") and n.endswith(".log"))
    for name in old[:max(0, len(old) - LOGS_KEPT + 1)]:
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
    path = os.path.join(directory, f"embedded-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}.log")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    return path


class EmbeddedCluster:
    def __init__(self, num_workers: int, start_timeout: float = 60.0, extra_args: tuple = (),
                 auth_dir: Optional[str] = None, allowed_tables: Sequence[str] = (), cache: Optional[str] = None,
                 log_file: Optional[str] = None, bind: Optional[str] = None) -> None:
        """``auth_dir``: the user's key directory (CURVE on the ipc sockets too); without it, no keys.
        ``allowed_tables``: the prefixes the master may serve (none: no client spec). ``cache``:
        the block cache of the master and its workers (told in the environment, like the table).
        ``log_file``: where the master and its workers log (``new_log_file``; None: stderr),
        so the trainer's console shows only what the loader raises or warns about. ``bind``:
        a ``tcp://HOST:0`` the master listens on instead of the private ipc directory (rank 0
        of a multi-node job, with keys: ``placement.py``)."""
        self.log_file = log_file
        self.auth_dir = os.path.abspath(auth_dir) if auth_dir is not None else None
        # Made here (0700, checked) before its name is published on the master's command
        # line, where any local user could read it and make it first; the master takes it
        # over (ENV_IPC_HANDOVER) and so removes it when it exits.
        self.proc = None
        self.ipc_dir = make_ipc_directory() if bind is None else None
        env = {k: v for k, v in os.environ.items() if k != ENV_AUTH}  # no stray keys: the argument decides
        env.update(allowlist_env(allowed_tables), **({ENV_AUTH: self.auth_dir} if self.auth_dir else {}))
        if self.ipc_dir is not None:
            env[ENV_IPC_HANDOVER] = self.ipc_dir
        env.pop(ENV_CACHE, None)
        if cache is not None:
            env[ENV_CACHE] = cache
        try:
            log = open(log_file, "a") if log_file is not None else None  # its workers inherit it
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "remoteloader.master", "--bind", bind or f"ipc://{self.ipc_dir}/master",
                     "--workers", str(num_workers), "--die-with-parent", *extra_args],
                    stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            finally:
                if log is not None:
                    log.close()
            self.addr = self._read_address(start_timeout)
        except BaseException:
            self.close()
            raise

    def _read_address(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the embedded remoteloader master exited with code {self.proc.returncode} at "
                                   f"start{self._log_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline()
                if "listening on " in line:
                    self.proc.stdout.close()
                    return line.rsplit("listening on ", 1)[1].strip()
        raise TimeoutError(f"the embedded remoteloader master did not start within {timeout:g} s")

    def _log_tail(self, lines: int = 12) -> str:
        if self.log_file is None:
            return ""
        try:
            with open(self.log_file, errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError:
            return f" (log: {self.log_file})"
        return f"; the end of its log ({self.log_file}):\n" + "".join(tail).rstrip()

    def close(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=10)
        # The master removes it as it exits; it stays only if the master was killed (SIGKILL).
        if self.ipc_dir is None:
            return
        try:
            st = os.lstat(self.ipc_dir)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():  # never through a link, never another's
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


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
