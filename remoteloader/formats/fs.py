"""Local paths and pyarrow filesystem URIs behind one interface.

Files are identified by a string that any process can reopen (workers get files from the
master over the wire), so a file inside a URI table keeps the table URI's scheme, host and
query (e.g. ``s3://bucket/t/ds=1/part-0.orc?endpoint_override=host:9000``), and a local
file keeps its absolute path. A ``slow+`` URI (``slow+file:///t?profile=hdd``) wraps the
filesystem in a simulated slow storage (``slowfs``).

``target`` says what ``open_filesystem`` will open (the filesystem and the decoded path)
without opening anything, so the table allowlist checks exactly what is read. A URI whose
path carries a percent-encoded ``.``, ``/``, ``\\`` or NUL, or a ``.``/``..`` segment once
decoded, is refused outright: pyarrow decodes the path after any check made on the
encoded text, and only these turn a path under a prefix into one outside it.
"""
from __future__ import annotations

import os
import posixpath
import re
from typing import NamedTuple
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs

from . import slowfs
from .types import TableError


def _is_uri(path: str) -> bool:
    # A Windows drive letter ("C:\\") is not a scheme; URIs here always carry "://".
    return "://" in path


_ENCODED_ESCAPE = re.compile(r"%(2e|2f|5c|00)", re.IGNORECASE)  # . / \ NUL
LOCAL = ("", "", ())  # the filesystem of local paths and file:// URIs


class Target(NamedTuple):
    """What ``open_filesystem`` opens for a path or URI, before anything is opened."""

    filesystem: tuple[str, str, tuple[tuple[str, str], ...]]  # scheme, host, sorted query; LOCAL
    path: str  # decoded, as the filesystem is asked for it
    local: bool  # on this machine's disk (a local path, file:// or slow+file://): symlinks apply


def target(path_or_uri: str) -> Target:
    """The filesystem and decoded path ``path_or_uri`` names; ``TableError`` for a URI
    that could name something else once decoded (see the module's docstring)."""
    if not _is_uri(path_or_uri):
        return Target(LOCAL, os.path.abspath(path_or_uri), True)
    try:
        parts = urlsplit(path_or_uri)
    except ValueError as e:
        raise TableError(f"{path_or_uri!r} is not a valid URI: {e}") from None
    filesystem = (parts.scheme, parts.netloc, tuple(sorted(parse_qsl(parts.query, keep_blank_values=True))))
    if slowfs.is_slow_uri(path_or_uri):
        inner = target(slowfs.split_slow_uri(path_or_uri)[0])
        return Target(filesystem, inner.path, inner.local)
    if _ENCODED_ESCAPE.search(parts.path):
        raise TableError(f"{path_or_uri!r}: a percent-encoded '.', '/', '\\' or NUL in a table path is refused; "
                         "write the path plainly")
    path = unquote(parts.path)
    if {".", ".."} & set(path.split("/")):
        raise TableError(f"{path_or_uri!r}: a '.' or '..' segment in a table URI is refused")
    if parts.scheme != "file":
        return Target(filesystem, path, False)
    if parts.netloc:  # pyarrow refuses a host here too
        raise TableError(f"{path_or_uri!r}: a file:// URI names no host (file:///path)")
    return Target(LOCAL, path, True)


def open_filesystem(path_or_uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem holding ``path_or_uri`` and the path to use with it."""
    where = target(path_or_uri)  # refuses an escaping URI before anything is opened
    if slowfs.is_slow_uri(path_or_uri):
        inner_uri, slowness = slowfs.split_slow_uri(path_or_uri)
        inner, path = open_filesystem(inner_uri)
        return slowfs.slow_filesystem(inner, slowness), path
    if where.local:  # the very path the allowlist resolved, not pyarrow's own decoding of it
        return pafs.LocalFileSystem(), where.path
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
