"""Which master a loader talks to, and what closing the loader means for it.

A loader given a master address uses it. Without one, rank 0 starts the embedded master
and workers (``embedded.py``) and publishes them in torch.distributed's store; the other
ranks find them there (``ranks.py``).

On one node that is all: ipc sockets in a private directory, no keys. A job that spans
several nodes (``nodes.py``) gets a master on TCP at rank 0's node's reachable address,
CURVE-authenticated with a per-job key set (``jobkeys.py``) unless the user gave a key
directory; the master starts rank 0's node's workers, and the first rank of every other node
starts that node's (``node_workers.py``), each naming its node so that ranks read from their
own node's workers first.

At close every rank counts itself out. The first rank of another node stops its workers only
once every rank's loader has closed (a rank of any node may read from them), and counts that;
the owner of the embedded master stops it only after both (bounded), so no rank loses its
master or workers while it still finishes an epoch, and every worker says bye to a live master.
"""
from __future__ import annotations

import logging
import os
import shlex
import sys
import weakref
from typing import Any, Callable, Optional

from ..core.cache.location import ENV_CACHE, user_cache_dir
from ..core.procs import kernels_cached
from ..core.redact import redact
from ..spec import DatasetSpec
from .embedded import ENV_MASTER, EmbeddedCluster, new_log_file
from .jobkeys import JobKeys
from .node_workers import NodeWorkers
from .nodes import ONE_NODE, NodeLayout, detect_layout, endpoint_host, node_address, rendezvous_host, tcp_endpoint
from .ranks import Published, RankStore, default_store, find_master

log = logging.getLogger(__name__)


class MasterPlacement:
    """The master's address and key directory for one loader of one rank, the node it declares
    (``hello.node``; "" on one node), and what it owns: rank 0 the embedded cluster, another
    node's first rank that node's workers, every rank of a multi-node job its copy of the job's keys."""

    def __init__(self, addr: str, auth_dir: Optional[str], ranks: Optional[RankStore] = None,
                 published: Optional[Published] = None, cluster: Optional[EmbeddedCluster] = None,
                 node: str = "", keys: Optional[JobKeys] = None) -> None:
        self.addr, self.auth_dir, self.node = addr, auth_dir, node
        self.ranks, self.published, self.cluster, self.keys = ranks, published, cluster, keys
        self.workers: Optional[NodeWorkers] = None
        self._finalizers: list[weakref.finalize] = []

    def _own(self, owner: Any, stop: Callable[[], None]) -> None:
        """``stop`` runs at close, or when ``owner`` is collected or the interpreter exits first."""
        self._finalizers.append(weakref.finalize(owner, stop))

    @classmethod
    def resolve(cls, owner: Any, spec: DatasetSpec, rank: int, world_size: int, master: Optional[str],
                num_workers: Optional[int], auth_dir: Optional[str], connect_timeout: float) -> "MasterPlacement":
        """``master`` if given; else rank 0's embedded cluster (started here on rank 0, found on
        the others). What this rank starts never outlives ``owner`` (garbage collection, exit)."""
        if master is not None:
            return cls(master, auth_dir)
        if os.environ.get(ENV_MASTER):
            return cls(os.environ[ENV_MASTER], auth_dir)
        store = default_store()
        ranks = RankStore(store) if store is not None else None  # held: the store outlives a destroyed group
        fingerprint = spec.fingerprint()
        layout = ONE_NODE if store is None else detect_layout(store, fingerprint, rank, world_size, connect_timeout)
        if rank != 0:
            return cls._join(owner, spec, ranks, fingerprint, layout, num_workers, auth_dir, connect_timeout)
        if layout.multi_node:
            return cls._start_across_nodes(owner, spec, ranks, fingerprint, layout, num_workers, auth_dir)
        cluster = _start_embedded(spec, num_workers, auth_dir)
        published = ranks.publish_master(cluster.addr, fingerprint, cluster.auth_dir) if ranks is not None else None
        placement = cls(cluster.addr, cluster.auth_dir, ranks, published, cluster)
        placement._own(owner, cluster.close)
        return placement

    @classmethod
    def _start_across_nodes(cls, owner: Any, spec: DatasetSpec, ranks: RankStore, fingerprint: str,
                            layout: NodeLayout, num_workers: Optional[int],
                            auth_dir: Optional[str]) -> "MasterPlacement":
        """Rank 0 of a multi-node job: the master on TCP where the other nodes reach it, keyed."""
        address = node_address(rendezvous_host(ranks.store))
        keys = None if auth_dir else JobKeys.create()  # a key directory of the user's takes precedence
        worker_args = ("--worker-args", shlex.join(["--bind-host", address, "--node", layout.node]))
        cluster = _start_embedded(spec, num_workers, auth_dir or keys.directory, bind=tcp_endpoint(address),
                                  extra=worker_args)
        placement = cls(cluster.addr, cluster.auth_dir, ranks, None, cluster, layout.node, keys)
        placement._own(owner, cluster.close)
        if keys is not None:  # after the cluster: its processes stop before their keys go
            placement._own(owner, keys.close)
        placement.published = ranks.publish_master(cluster.addr, fingerprint, auth_dir,
                                                   keys.published() if keys else None, layout.node, layout.nodes - 1)
        return placement

    @classmethod
    def _join(cls, owner: Any, spec: DatasetSpec, ranks: Optional[RankStore], fingerprint: str, layout: NodeLayout,
              num_workers: Optional[int], auth_dir: Optional[str], connect_timeout: float) -> "MasterPlacement":
        """A rank > 0: rank 0's master and keys; the first rank of another node starts its workers."""
        published = find_master(ranks, fingerprint, connect_timeout)
        keys = JobKeys.received(published.keys) if published.keys is not None else None
        across_nodes = published.node is not None
        placement = cls(published.addr, keys.directory if keys else published.auth or auth_dir, ranks, published,
                        node=layout.node if across_nodes else "", keys=keys)
        if across_nodes and layout.first_on_node and layout.node != published.node:
            workers = _start_node_workers(spec, published.addr, layout.node, num_workers, placement.auth_dir)
            placement.workers = workers
            placement._own(owner, workers.close)
        if keys is not None:  # after the workers: they stop before their keys go
            placement._own(owner, keys.close)
        return placement

    def close(self, world_size: int) -> None:
        """After this rank's goodbye: count it out. The first rank of another node waits for
        every rank, then stops its node's workers; the owner waits for every rank and those
        nodes, then stops the cluster. What this rank holds goes with it (keys last)."""
        token = self.published.token if self.published is not None else None
        if self.ranks is not None and token is not None:
            try:
                self.ranks.count_closed(token)
                if self.cluster is not None or self.workers is not None:
                    self.ranks.wait_closed(token, world_size)
                if self.workers is not None:
                    self.workers.close()
                    self.ranks.count_node_done(token)
                if self.cluster is not None and self.published.worker_nodes:
                    self.ranks.wait_nodes_done(token, self.published.worker_nodes)
            except RuntimeError as e:  # the store went away (its host exited): nobody left to wait for
                log.warning("could not count this rank's loader out in the torch.distributed store: %s", e)
        for finalizer in self._finalizers:
            finalizer()


def _start_node_workers(spec: DatasetSpec, master: str, node: str, num_workers: Optional[int],
                        auth_dir: str) -> NodeWorkers:
    """This node's workers for rank 0's master, bound to the address that reaches it."""
    workers = num_workers or os.cpu_count() or 1
    address = node_address(endpoint_host(master))
    log_file = new_log_file()
    if not os.environ.get("REMOTELOADER_QUIET"):
        print(f"remoteloader: starting {workers} workers on {node} ({address}) for the embedded master at {master}"
              + (f" (their log: {log_file})" if log_file else ""), file=sys.stderr, flush=True)
    tables = [path for _, path in spec.table_paths]
    return NodeWorkers(master, workers, address, node, auth_dir, tables, _embedded_cache(spec), log_file)


def _start_embedded(spec: DatasetSpec, num_workers: Optional[int], auth_dir: Optional[str],
                    bind: Optional[str] = None, extra: tuple = ()) -> EmbeddedCluster:
    scaling = spec.autoscale
    extra += () if scaling is None else ("--autoscale", "--min-workers", str(scaling.get("min_workers", 1)),
                                        "--max-workers", str(scaling.get("max_workers", os.cpu_count() or 1)))
    workers = num_workers or os.cpu_count() or 1
    log_file = new_log_file()
    if not os.environ.get("REMOTELOADER_QUIET"):
        # One line rather than seconds of silence, saying why when a first start compiles the kernels.
        compiling = "" if kernels_cached() else "; a first start on this machine compiles the transform kernels"
        where = "" if bind is None else f" on {endpoint_host(bind)} for a multi-node job, keyed,"
        print(f"remoteloader: starting an embedded master{where} and {workers} local workers for "
              f"{redact(spec.table.path)}{_more_tables(spec)}{compiling}" + (f" (their log: {log_file})" if log_file else ""),
              file=sys.stderr, flush=True)
    # The embedded master serves this spec's tables only (told in its environment, off the command line).
    tables = [path for _, path in spec.table_paths]
    return EmbeddedCluster(workers, extra_args=extra, auth_dir=auth_dir, allowed_tables=tables,
                           cache=_embedded_cache(spec), log_file=log_file, bind=bind)


def _more_tables(spec: DatasetSpec) -> str:
    """How many tables a mix reads besides its first, for the banner."""
    more = len(spec.tables) - 1
    return "" if more < 1 else f" and {more} more table{'s' if more > 1 else ''}"


def _embedded_cache(spec: DatasetSpec) -> Optional[str]:
    """The block cache of an embedded cluster: ``$REMOTELOADER_CACHE`` if set, else this
    user's cache directory for a spec that asks for a cache (a ``cache`` section, mode not off)."""
    if os.environ.get(ENV_CACHE):
        return os.environ[ENV_CACHE]
    if spec.cache is not None and spec.cache_mode != "off":
        return user_cache_dir()
    return None
