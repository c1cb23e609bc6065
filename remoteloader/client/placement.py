"""Which master a loader talks to, and what closing the loader means for it.

A loader given a master address uses it. Without one, rank 0 starts the embedded master
and workers (``embedded.py``) and publishes them in torch.distributed's store; the other
ranks find them there (``ranks.py``). At close every rank counts itself out; the owner
of the embedded master stops it only once every rank's loader has closed (bounded), so
no rank loses its master while it still finishes an epoch.
"""
from __future__ import annotations

import logging
import os
import sys
import weakref
from typing import Any, Optional

from ..core.cache.location import ENV_CACHE, user_cache_dir
from ..core.procs import kernels_cached
from ..core.redact import redact
from ..spec import DatasetSpec
from .embedded import ENV_MASTER, EmbeddedCluster, new_log_file
from .ranks import Published, RankStore, default_store, find_master

log = logging.getLogger(__name__)


class MasterPlacement:
    """The master's address and key directory for one loader of one rank."""

    def __init__(self, addr: str, auth_dir: Optional[str], ranks: Optional[RankStore] = None,
                 published: Optional[Published] = None, cluster: Optional[EmbeddedCluster] = None) -> None:
        self.addr, self.auth_dir = addr, auth_dir
        self.ranks, self.published, self.cluster = ranks, published, cluster
        self._finalizer: Optional[weakref.finalize] = None

    @classmethod
    def resolve(cls, owner: Any, spec: DatasetSpec, rank: int, master: Optional[str], num_workers: Optional[int],
                auth_dir: Optional[str], connect_timeout: float) -> "MasterPlacement":
        """``master`` if given; else rank 0's embedded cluster (started here on rank 0, found on
        the others). The embedded cluster never outlives ``owner`` (garbage collection, exit)."""
        if master is not None:
            return cls(master, auth_dir)
        store = default_store()
        ranks = RankStore(store) if store is not None else None  # held: the store outlives a destroyed group
        fingerprint = spec.fingerprint()
        if rank != 0:
            published = find_master(ranks, fingerprint, rank, connect_timeout)
            return cls(published.addr, published.auth or auth_dir, ranks, published)
        if os.environ.get(ENV_MASTER):
            return cls(os.environ[ENV_MASTER], auth_dir)
        cluster = _start_embedded(spec, num_workers, auth_dir)
        published = ranks.publish_master(cluster.addr, fingerprint, cluster.auth_dir) if ranks is not None else None
        placement = cls(cluster.addr, cluster.auth_dir, ranks, published, cluster)
        placement._finalizer = weakref.finalize(owner, cluster.close)
        return placement

    def close(self, world_size: int) -> None:
        """After this rank's goodbye: count it out; the owner waits for every rank, then stops the cluster."""
        token = self.published.token if self.published is not None else None
        if self.ranks is not None and token is not None:
            try:
                self.ranks.count_closed(token)
                if self.cluster is not None:
                    self.ranks.wait_closed(token, world_size)
            except RuntimeError as e:  # the store went away (its host exited): nobody left to wait for
                log.warning("could not count this rank's loader out in the torch.distributed store: %s", e)
        if self._finalizer is not None:
            self._finalizer()


def _start_embedded(spec: DatasetSpec, num_workers: Optional[int], auth_dir: Optional[str]) -> EmbeddedCluster:
    scaling = spec.autoscale
    extra = () if scaling is None else ("--autoscale", "--min-workers", str(scaling.get("min_workers", 1)),
                                       "--max-workers", str(scaling.get("max_workers", os.cpu_count() or 1)))
    workers = num_workers or os.cpu_count() or 1
    log_file = new_log_file()
    if not os.environ.get("REMOTELOADER_QUIET"):
        # One line rather than seconds of silence, saying why when a first start compiles the kernels.
        compiling = "" if kernels_cached() else "; a first start on this machine compiles the transform kernels"
        print(f"remoteloader: starting an embedded master and {workers} local workers for "
              f"{redact(spec.table.path)}{compiling}" + (f" (their log: {log_file})" if log_file else ""),
              file=sys.stderr, flush=True)
    # The embedded master serves this table only (told in its environment, off the command line).
    return EmbeddedCluster(workers, extra_args=extra, auth_dir=auth_dir, allowed_tables=[spec.table.path],
                           cache=_embedded_cache(spec), log_file=log_file)


def _embedded_cache(spec: DatasetSpec) -> Optional[str]:
    """The block cache of an embedded cluster: ``$REMOTELOADER_CACHE`` if set, else this
    user's cache directory for a spec that asks for a cache (a ``cache`` section, mode not off)."""
    if os.environ.get(ENV_CACHE):
        return os.environ[ENV_CACHE]
    if spec.cache is not None and spec.cache_mode != "off":
        return user_cache_dir()
    return None
