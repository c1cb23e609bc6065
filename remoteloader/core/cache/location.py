"""Where the block cache lives: the operator's choice (``--cache``), checked against
``--allow-cache`` on every process that opens it. A spec never names a location."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from ...protocol.auth import Credentials
from ..allowlist import TableAllowlist
from .segments import BlockSigner
from .store import BlockStore

ENV_CACHE = "REMOTELOADER_CACHE"  # a worker's --cache, as its master passes it on
ENV_ALLOW_CACHE = "REMOTELOADER_ALLOW_CACHE"
ENV_CACHE_MAX_BYTES = "REMOTELOADER_CACHE_MAX_BYTES"


class CacheRefused(ValueError):
    """A cache location outside the allowed prefixes."""


def allowed_caches(from_args: Optional[Sequence[str]]) -> Optional[tuple[str, ...]]:
    """--allow-cache and $REMOTELOADER_ALLOW_CACHE (``:``-separated) together; None
    (any location the operator names) when neither is given."""
    env = os.environ.get(ENV_ALLOW_CACHE)
    if from_args is None and env is None:
        return None
    return (*(from_args or []), *(p for p in (env or "").split(os.pathsep) if p))


def open_cache(uri: str, allowed: Optional[Sequence[str]], credentials: Optional[Credentials],
               timeout_s: float = 10.0) -> BlockStore:
    """The store at ``uri``; with cluster keys its blocks carry a MAC under the cluster
    secret, and blocks without it are refused. Raises CacheRefused outside ``allowed``."""
    if allowed is not None and not TableAllowlist(allowed).allows(uri):
        raise CacheRefused(f"--cache {uri!r} is outside the allowed cache prefixes "
                           f"(--allow-cache / ${ENV_ALLOW_CACHE}: {', '.join(allowed) or 'none'})")
    return BlockStore(uri, BlockSigner.for_credentials(credentials), timeout_s=timeout_s)


def user_cache_dir() -> str:
    """The embedded default's location: this user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "remoteloader", "blocks")
