"""torchrun lifecycle: the ranks of a job meet in torch.distributed's store.

Rank 0 starts the embedded master and publishes where it listens (a Unix socket in its
private directory, ``embedded.py``), on which host, and its key directory's path if it has
one (never key material: the store is not authenticated). The other ranks read it; a rank
on another host cannot reach that socket, so it refuses at construction, saying what to set. At close, every rank counts itself out after its
goodbye, and the owner of the embedded master waits (bounded) until all have, so a rank
still finishing its epoch is never stranded by rank 0 stopping the master under it.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from ..protocol.auth import ENV_AUTH
from .embedded import ENV_MASTER

log = logging.getLogger(__name__)
STORE_KEY = "remoteloader/master/{fingerprint}"
CLOSED_KEY = "remoteloader/closed/{token}"  # one per embedded master: ports are reused, tokens not
CLOSE_WAIT_S = 60.0  # the owner's bound on waiting for the other ranks' goodbyes
CLOSE_POLL_S = 0.05
WAIT_LOG_S = 10.0


class MultiHostError(RuntimeError):
    """A rank on another host than rank 0's embedded (one-host, ipc) master."""


def default_store() -> Optional[Any]:
    """The default process group's store, or None without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    return None


@dataclass(frozen=True)
class Published:
    """Rank 0's embedded master as published: address, key directory path, and the token
    naming this master's close count."""

    addr: str
    auth: Optional[str]
    token: Optional[str]


class RankStore:
    """One job's meeting point in a torch.distributed store (held from construction on, so the
    close barrier works even after the training script destroyed its process group)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def publish_master(self, addr: str, fingerprint: str, auth_dir: Optional[str]) -> Published:
        published = Published(addr, auth_dir, uuid.uuid4().hex)
        value = {"addr": addr, "auth": auth_dir, "token": published.token, "host": socket.gethostname()}
        self.store.set(STORE_KEY.format(fingerprint=fingerprint), json.dumps(value))
        return published

    def discover_master(self, fingerprint: str, rank: int, timeout: float) -> Published:
        """Rank 0's embedded master for rank ``rank`` > 0."""
        key = STORE_KEY.format(fingerprint=fingerprint)
        self.store.wait([key], timedelta(seconds=timeout))
        published = json.loads(self.store.get(key).decode())
        host, here = published.get("host"), socket.gethostname()
        if host is not None and host != here:
            raise MultiHostError(
                f"rank {rank} runs on host {here!r} but rank 0's embedded remoteloader master listens on "
                f"{published['addr']} on host {host!r}, which no other host can reach: for a multi-host job run "
                f"'remoteloader keygen DIR' once, copy DIR to every host, start 'remoteloader-master --bind "
                f"tcp://0.0.0.0:PORT --auth DIR --workers N' and set {ENV_MASTER}=tcp://<that host>:PORT and "
                f"{ENV_AUTH}=DIR (or pass master=..., auth=...) on every rank")
        return Published(published["addr"], published.get("auth"), published.get("token"))

    def count_closed(self, token: str) -> None:
        """This rank's loader of the embedded master ``token`` has said goodbye."""
        self.store.add(CLOSED_KEY.format(token=token), 1)

    def wait_closed(self, token: str, world_size: int, timeout: float = CLOSE_WAIT_S) -> bool:
        """Wait until every rank's loader of master ``token`` has closed (or ``timeout``); True when all did."""
        key = CLOSED_KEY.format(token=token)
        started = last_log = time.monotonic()
        while True:
            closed = self.store.add(key, 0)
            now = time.monotonic()
            if closed >= world_size:
                return True
            if now - started >= timeout:
                log.warning("closing the embedded master after %.0f s although only %d of %d ranks' loaders "
                            "closed: the others lose their master", now - started, closed, world_size)
                return False
            if now - last_log >= WAIT_LOG_S:
                last_log = now
                log.warning("rank 0 keeps the embedded master up until every rank's loader closes: "
                            "%d of %d closed after %.0f s (bounded at %.0f s)", closed, world_size,
                            now - started, timeout)
            time.sleep(CLOSE_POLL_S)


def find_master(store: Optional[RankStore], fingerprint: str, rank: int, timeout: float) -> Published:
    """Where rank 0's embedded master listens and its key directory (None: the caller's), for ranks > 0."""
    if os.environ.get(ENV_MASTER):
        return Published(os.environ[ENV_MASTER], None, None)
    if store is None:
        raise RuntimeError(
            f"rank > 0 with no master address: initialize torch.distributed before creating the loader "
            f"(rank 0 publishes its embedded master in the process group's store), set {ENV_MASTER}, "
            "or pass master=...")
    return store.discover_master(fingerprint, rank, timeout)
