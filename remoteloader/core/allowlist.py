"""Which tables a master (and its workers) may read for clients: path or URI prefixes (``--allow-table``).

A client's spec names a table; the master (and through it every worker) would read
whatever it names. The allowlist confines that to the prefixes an operator chose.

A table and each prefix go through ``formats.fs.target``, the function
``open_filesystem`` opens through, so what is checked is what is read: the filesystem
(scheme, host or bucket, and exactly the query options, so a spec cannot point the master
at another endpoint) and the decoded path. On a local disk (a path, ``file://``,
``slow+file://``) both paths are resolved (symlinks, ``..``) before they are compared;
elsewhere the path is compared as decoded. Paths are compared component by component, so
``/data/ads`` allows ``/data/ads/ds=1`` but not ``/data/ads-private``. A URI that
``target`` refuses (percent-encoded dots or separators, ``.``/``..`` segments) is refused
here too, with no file system call: a refused table looks the same whether or not it exists.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

from ..formats.fs import target
from ..formats.types import TableError

_Resolved = tuple[tuple, tuple[str, ...]]  # (the filesystem, the path's components)


class TableAllowlist:
    def __init__(self, prefixes: Optional[Iterable[str]]) -> None:
        """``None``: every table (in-process use and tests); empty: none at all."""
        self.prefixes = None if prefixes is None else tuple(prefixes)

    def allows(self, path: str) -> bool:
        if self.prefixes is None:
            return True
        table = _resolve(path)
        if table is None:
            return False
        return any(prefix is not None and _under(table, prefix) for prefix in map(_resolve, self.prefixes))


def _resolve(path: str) -> Optional[_Resolved]:
    """Where ``path`` leads once opened; ``None`` for a path that would not be opened."""
    try:
        where = target(path)
        real = os.path.realpath(where.path) if where.local else where.path
    except (TableError, ValueError, OSError):  # ValueError: a NUL in a local path
        return None
    sep = os.sep if where.local else "/"
    # Only the ends are stripped: inside a key, "a//b" is not "a/b" on an object store.
    stripped = real.strip(sep)
    return where.filesystem, tuple(stripped.split(sep)) if stripped else ()


def _under(table: _Resolved, prefix: _Resolved) -> bool:
    return table[0] == prefix[0] and table[1][:len(prefix[1])] == prefix[1]
