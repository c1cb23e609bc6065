"""Which tables a master (and its workers) may read for clients: path or URI prefixes (``--allow-table``).

A client's spec names a table; the master (and through it every worker) would read
whatever it names. The allowlist confines that to the prefixes an operator chose. Local
paths are compared after resolving symlinks and ``..``, component by component, so
``/data/ads`` allows ``/data/ads/ds=1`` but not ``/data/ads-private``. A URI (``s3://``,
``slow+file://``) must have an allowed prefix's scheme and bucket, lie under its path
(component by component) and carry exactly its query options (``endpoint_override``
and the like), so a spec cannot point the master at another endpoint.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional
from urllib.parse import parse_qs, urlsplit


def _is_uri(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return os.path.realpath(path[len("file://"):] if path.startswith("file://") else path)


class TableAllowlist:
    def __init__(self, prefixes: Optional[Iterable[str]]) -> None:
        """``None``: every table (in-process use and tests); empty: none at all."""
        self.prefixes = None if prefixes is None else tuple(prefixes)

    def allows(self, path: str) -> bool:
        if self.prefixes is None:
            return True
        for prefix in self.prefixes:
            if _is_uri(path) or _is_uri(prefix):
                if _is_uri(path) and _is_uri(prefix) and _uri_under(path, prefix):
                    return True
            elif _under(_local(path), _local(prefix), os.sep):
                return True
        return False


def _under(path: str, root: str, sep: str) -> bool:
    return path == root or path.startswith(root.rstrip(sep) + sep)


def _uri_under(uri: str, prefix: str) -> bool:
    u, p = urlsplit(uri), urlsplit(prefix)
    return ((u.scheme, u.netloc) == (p.scheme, p.netloc) and parse_qs(u.query) == parse_qs(p.query)
            and ".." not in u.path.split("/") and _under(u.path, p.path or "/", "/"))
