"""Local paths and pyarrow filesystem URIs behind one interface.

Files are identified by a string that any process can reopen (workers get files from the
master over the wire), so a file inside a URI table keeps the table URI's scheme, host and
query (e.g. ``s3://bucket/t/ds=1/part-0.orc?endpoint_override=host:9000``), and a local
file keeps its absolute path. A ``slow+`` URI (``slow+file:///t?profile=hdd``) wraps the
filesystem in a simulated slow storage (``slowfs``).
"""
from __future__ import annotations

import os
import posixpath
from urllib.parse import SplitResult, urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs

from . import slowfs
from .types import TableError


def _is_uri(path: str) -> bool:
    # A Windows drive letter ("C:\\") is not a scheme; URIs here always carry "://".
    return "://" in path


def open_filesystem(path_or_uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem holding ``path_or_uri`` and the path to use with it."""
    if not _is_uri(path_or_uri):
        return pafs.LocalFileSystem(), os.path.abspath(path_or_uri)
    if slowfs.is_slow_uri(path_or_uri):
        inner_uri, slowness = slowfs.split_slow_uri(path_or_uri)
        inner, path = open_filesystem(inner_uri)
        return slowfs.slow_filesystem(inner, slowness), path
    try:
        return pafs.FileSystem.from_uri(path_or_uri)
    except (pa.ArrowException, ValueError, OSError) as e:
        raise TableError(f"cannot open filesystem for {path_or_uri!r}: {e}") from e


def table_root(path_or_uri: str) -> str:
    """The stable name of a table root: absolute for local paths, the URI as given otherwise."""
    return path_or_uri if _is_uri(path_or_uri) else os.path.abspath(path_or_uri)


def child_name(root: str, relative: str) -> str:
    """The reopenable name of ``relative`` (a '/'-separated path) under table root ``root``."""
    if not _is_uri(root):
        return os.path.join(root, *relative.split("/"))
    parts = urlsplit(root)
    return unsplit(parts._replace(path=posixpath.join(parts.path or "/", relative)))


def unsplit(parts: SplitResult) -> str:
    """``urlunsplit`` that keeps ``scheme://`` for every scheme: the standard one drops
    the slashes of an empty host for schemes it does not know (``slow+file:///t``)."""
    uri = urlunsplit(parts)
    prefix = parts.scheme + ":"
    if not uri.startswith(prefix + "//"):
        uri = prefix + "//" + uri[len(prefix):]
    return uri


def relative_name(root: str, name: str) -> str:
    """The '/'-separated path of file ``name`` under table root ``root`` (inverse of
    ``child_name``)."""
    if not _is_uri(root):
        return os.path.relpath(name, root).replace(os.sep, "/")
    return posixpath.relpath(urlsplit(name).path, urlsplit(root).path or "/")
