"""Where the block cache lives: the operator's choice (``--cache``), checked against
``--allow-cache`` on every process that opens it. A spec never names a location.

A local location is held to the key directory's rules (``fs.open_location``): this
user's (or root's) and writable by nobody else. A cache shared between users is an
explicit choice (``--cache-shared``, ``$REMOTELOADER_CACHE_SHARED=1``) and only with
``--auth``, so that only key holders can put blocks that verify."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from ...formats.fs import target
from ...protocol.auth import Credentials
from ..allowlist import TableAllowlist
from .fs import LocationRefused
from .segments import BlockSigner
from .store import BlockStore

ENV_CACHE = "REMOTELOADER_CACHE"  # a worker's --cache, as its master passes it on
ENV_ALLOW_CACHE = "REMOTELOADER_ALLOW_CACHE"
ENV_CACHE_MAX_BYTES = "REMOTELOADER_CACHE_MAX_BYTES"
ENV_CACHE_SHARED = "REMOTELOADER_CACHE_SHARED"  # "1": --cache-shared (masters pass it on to their workers)


class CacheRefused(ValueError):
    """A cache location outside the allowed prefixes, or one others could write (see
    ``fs.open_location``), or a shared one without ``--auth``."""


def shared_from_env() -> bool:
    """``$REMOTELOADER_CACHE_SHARED``: the default of ``--cache-shared`` (and of the embedded
    and local paths, which have no command line)."""
    return os.environ.get(ENV_CACHE_SHARED, "").strip().lower() in ("1", "true", "yes")


def allowed_caches(from_args: Optional[Sequence[str]]) -> Optional[tuple[str, ...]]:
    """--allow-cache and $REMOTELOADER_ALLOW_CACHE (``:``-separated) together; None
    (any location the operator names) when neither is given."""
    env = os.environ.get(ENV_ALLOW_CACHE)
    if from_args is None and env is None:
        return None
    return (*(from_args or []), *(p for p in (env or "").split(os.pathsep) if p))


def open_cache(uri: str, allowed: Optional[Sequence[str]], credentials: Optional[Credentials],
               timeout_s: float = 10.0, *, shared: Optional[bool] = None,
               max_bytes: Optional[int] = None) -> BlockStore:
    """The store at ``uri``; with cluster keys its blocks carry a MAC under the cluster
    secret, and blocks without it are refused. Raises CacheRefused outside ``allowed``, for
    a local location another user owns or others may write (unless ``shared``), and for
    ``shared`` without ``credentials``. ``shared`` None: ``$REMOTELOADER_CACHE_SHARED``.
    ``max_bytes``: the bound every write keeps (``--cache-max-bytes``)."""
    if allowed is not None and not TableAllowlist(allowed).allows(uri):
        raise CacheRefused(f"--cache {uri!r} is outside the allowed cache prefixes "
                           f"(--allow-cache / ${ENV_ALLOW_CACHE}: {', '.join(allowed) or 'none'})")
    shared = shared_from_env() if shared is None else shared
    if shared and credentials is None:
        raise CacheRefused(f"--cache-shared (${ENV_CACHE_SHARED}) needs --auth: in a cache that other users "
                           "write, only blocks under the cluster key can be told from planted ones "
                           "(docs/security.md, 'The block cache')")
    where = target(uri)
    default = where.local and os.path.abspath(where.path) == user_cache_dir()
    # The embedded default's own directories, made by older versions under the umask: this user's, 0700.
    levels = (os.path.dirname(where.path), where.path) if default else ()
    try:
        return BlockStore(uri, BlockSigner.for_credentials(credentials), timeout_s=timeout_s, shared=shared,
                          max_bytes=max_bytes, private_levels=levels)
    except LocationRefused as e:
        raise CacheRefused(str(e)) from None


def user_cache_dir() -> str:
    """The embedded default's location: this user's cache directory (made 0700, with any
    missing level above it, when first opened)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "remoteloader", "blocks"))
