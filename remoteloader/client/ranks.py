"""torchrun lifecycle: the ranks of a job meet in torch.distributed's store.

Rank 0 starts the embedded master and publishes where it listens and its key directory's
path if it has one. On one node that is a Unix socket in its private directory
(``embedded.py``), with no keys. A multi-node job's master listens on TCP at an address the
other nodes reach, and without a key directory of the user's rank 0 publishes the job's key
set itself (``jobkeys.py``: the store is the job's trust root, though not authenticated),
its node, and how many other nodes start workers (``placement.py``). The other ranks read it.
At close, every rank counts itself out after its goodbye; the first rank of every other node
waits (bounded) until all have before it stops its node's workers, and counts that; and the
owner of the embedded master waits for both, so a rank still finishing its epoch is never
stranded by a master or a worker stopping under it.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from .embedded import ENV_MASTER

log = logging.getLogger(__name__)
STORE_KEY = "remoteloader/master/{fingerprint}"
CLOSED_KEY = "remoteloader/closed/{token}"  # one per embedded master: ports are reused, tokens not
NODES_DONE_KEY = "remoteloader/nodes_done/{token}"  # other nodes whose workers have stopped
PART_KEY = "remoteloader/state/{fingerprint}/{seq}/{rank}"  # one rank's part at one state_dict() call
GATHER_TIMEOUT_S = 120.0  # every rank's state_dict() call within this of the first one's
CLOSE_WAIT_S = 60.0  # the owner's bound on waiting for the other ranks' goodbyes
CLOSE_POLL_S = 0.05
WAIT_LOG_S = 10.0


def default_store() -> Optional[Any]:
    """The default process group's store, or None without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    return None


@dataclass(frozen=True)
class Published:
    """Rank 0's embedded master as published: address, key directory path, the token naming
    this master's close count, and for a multi-node job the job's key set (None: a key
    directory of the user's, or one node), rank 0's node, and the other nodes that start workers."""

    addr: str
    auth: Optional[str]
    token: Optional[str]
    keys: Optional[dict] = None
    node: Optional[str] = None  # None: one node
    worker_nodes: int = 0


class RankStore:
    """One job's meeting point in a torch.distributed store (held from construction on, so the
    close barrier works even after the training script destroyed its process group)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def publish_master(self, addr: str, fingerprint: str, auth_dir: Optional[str], keys: Optional[dict] = None,
                       node: Optional[str] = None, worker_nodes: int = 0) -> Published:
        published = Published(addr, auth_dir, uuid.uuid4().hex, keys, node, worker_nodes)
        value = {"addr": addr, "auth": auth_dir, "token": published.token, "keys": keys, "node": node,
                 "worker_nodes": worker_nodes}
        self.store.set(STORE_KEY.format(fingerprint=fingerprint), json.dumps(value))
        return published

    def discover_master(self, fingerprint: str, timeout: float) -> Published:
        """Rank 0's embedded master, for ranks > 0."""
        key = STORE_KEY.format(fingerprint=fingerprint)
        self.store.wait([key], timedelta(seconds=timeout))
        published = json.loads(self.store.get(key).decode())
        return Published(published["addr"], published.get("auth"), published.get("token"), published.get("keys"),
                         published.get("node"), int(published.get("worker_nodes") or 0))

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

    def count_node_done(self, token: str) -> None:
        """This node's workers of the embedded master ``token`` have stopped (another node's first rank)."""
        self.store.add(NODES_DONE_KEY.format(token=token), 1)

    def wait_closed(self, token: str, world_size: int, timeout: float = CLOSE_WAIT_S) -> bool:
        """Wait until every rank's loader of master ``token`` has closed (or ``timeout``); True when all did."""
        return self._wait_count(CLOSED_KEY.format(token=token), world_size, timeout, "ranks' loaders have closed",
                                "the others lose their master and workers")

    def wait_nodes_done(self, token: str, nodes: int, timeout: float = CLOSE_WAIT_S) -> bool:
        """Wait until the other ``nodes`` nodes have stopped their workers (or ``timeout``), so that
        they say bye to a master still there; True when all did."""
        return self._wait_count(NODES_DONE_KEY.format(token=token), nodes, timeout,
                                "other nodes have stopped their workers", "the others find no master to say bye to")

    def _wait_count(self, key: str, wanted: int, timeout: float, what: str, otherwise: str) -> bool:
        started = last_log = time.monotonic()
        while True:
            done = self.store.add(key, 0)
            now = time.monotonic()
            if done >= wanted:
                return True
            if now - started >= timeout:
                log.warning("stopping the embedded remoteloader cluster after %.0f s although only %d of %d %s: %s",
                            now - started, done, wanted, what, otherwise)
                return False
            if now - last_log >= WAIT_LOG_S:
                last_log = now
                log.warning("the embedded remoteloader cluster stays up until every rank has closed its loader: "
                            "%d of %d %s after %.0f s (bounded at %.0f s)", done, wanted, what, now - started, timeout)
            time.sleep(CLOSE_POLL_S)


def find_master(store: Optional[RankStore], fingerprint: str, timeout: float) -> Published:
    """Where rank 0's embedded master listens and its keys, for ranks > 0."""
    if store is None:
        raise RuntimeError(
            f"rank > 0 with no master address: initialize torch.distributed before creating the loader "
            f"(rank 0 publishes its embedded master in the process group's store), set {ENV_MASTER}, "
            "or pass master=...")
    return store.discover_master(fingerprint, timeout)
