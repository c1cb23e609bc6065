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
PART_KEY = "remoteloader/state/{fingerprint}/{seq}/{rank}"  # one rank's part at one state_dict() call
GATHER_TIMEOUT_S = 120.0  # every rank's state_dict() call within this of the first one's
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

    def gather_parts(self, fingerprint: str, seq: int, rank: int, world_size: int, part: dict,
                     timeout: Optional[float] = None) -> dict[int, dict]:
        """Every rank's part of ``state_dict()`` call number ``seq`` of this process's loaders
        of spec ``fingerprint``, as JSON through the store (never pickle: the store is not
        authenticated). Every rank must call it, as for a collective, but it waits at most
        ``timeout``: a rank that calls alone (``if rank == 0: torch.save(loader.state_dict())``)
        gets an error naming the trap instead of a hang, and its part is withdrawn, so no
        later call reads it."""
        timeout = GATHER_TIMEOUT_S if timeout is None else timeout
        keys = [PART_KEY.format(fingerprint=fingerprint, seq=seq, rank=r) for r in range(world_size)]
        self.store.set(keys[rank], json.dumps(part))
        started = last_log = time.monotonic()
        while True:
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            now = time.monotonic()
            if not missing:
                return {r: json.loads(self.store.get(key).decode()) for r, key in enumerate(keys)}
            if now - started >= timeout:
                self.store.delete_key(keys[rank])
                raise RuntimeError(
                    f"rank {rank}: state_dict() of a RemoteDataLoader under torch.distributed is a collective (it "
                    f"returns the job's position, the same on every rank): ranks {missing} did not call it within "
                    f"{timeout:.0f} s. Call it on every rank (dcp.save does), e.g. `state = loader.state_dict()` "
                    f"on all ranks and then `if rank == 0: torch.save(state, ...)`")
            if now - last_log >= WAIT_LOG_S:
                last_log = now
                log.warning("rank %d: state_dict() waits for ranks %s to call it too (a collective under "
                            "torch.distributed; an error after %.0f s)", rank, missing, timeout)
            time.sleep(CLOSE_POLL_S)

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
