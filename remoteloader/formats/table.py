"""Listing a table: its files, their partitions and read units, its schema.

A table is a directory of Hive-style partitions (nested allowed: ``ds=.../hr=...``) or a
single file. Files are described from their footers only (no data is read), several at a
time, since on an object store each footer costs a round trip.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Iterable, Optional, Sequence, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from . import orc, parquet
from .convert import column_kind
from .fs import child_name, open_filesystem, table_root, target
from .types import DataFile, TableError

FORMATS: dict[str, ModuleType] = {"orc": orc, "parquet": parquet}
SUFFIXES = {".orc": "orc", ".parquet": "parquet", ".pq": "parquet"}
# Footer reads are I/O bound (object-store round trips): overlap them.
_METADATA_THREADS = 16
TAIL_DIGEST_BYTES = 64 << 10  # a file's identity covers its footer (DataFile.tail_digest)
_LIST_ATTEMPTS = 3  # a local file that changes while it is described is described again

T = TypeVar("T")
R = TypeVar("R")


def format_module(fmt: str, where: str) -> ModuleType:
    try:
        return FORMATS[fmt]
    except KeyError:
        raise TableError(f"{where}: unknown format {fmt!r} (orc | parquet)") from None


@dataclass
class Skipped:
    """What a listing left out, each entry ``PATH: why``: ``unreadable`` data files (a
    dangling symlink, a file this user may not read: local paths) and ``ignored`` files
    that are not of the table's format."""

    unreadable: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def list_table(path: str, format: Optional[str] = None, partitions: Optional[Sequence[str]] = None,
               skipped: Optional[Skipped] = None) -> list[DataFile]:
    """The table's data files sorted by path (the canonical row order), each with its
    units read from the footer. ``partitions`` keeps the files whose partition dir equals
    an entry or lies under it; an entry that matches nothing is an error. Nothing is left
    out in silence: an unreadable data file is a ``TableError`` naming it, unless
    ``skipped`` is given, which then receives it (and the files of another format)."""
    if format is not None:
        format_module(format, f"table {path}")
    if isinstance(partitions, str):
        partitions = [partitions]
    fs, root = open_filesystem(path)
    local = target(path).local
    try:
        info = fs.get_file_info(root)
    except (OSError, pa.ArrowException) as e:
        raise TableError(f"cannot access table path {path}: {e}") from e
    if info.type == pafs.FileType.NotFound:
        raise TableError(f"table path {path} does not exist")
    if info.type == pafs.FileType.File:
        if partitions is not None:
            raise TableError(f"table {path} is a single file: it has no partitions to select {list(partitions)}")
        fmt = format or SUFFIXES.get(posixpath.splitext(root)[1].lower())
        if fmt is None:
            raise TableError(f"cannot tell the format of {path} from its suffix: give the format (orc | parquet)")
        found = [("", info)]
    else:
        report = Skipped()
        fmt, found = _find_files(fs, root, path, format, report, local)
        if partitions is not None:
            found = _select_partitions(found, partitions, path)
            wanted = [p.strip("/") for p in partitions]
            report.unreadable = [u for u in report.unreadable if _in_partitions(u, wanted)]
            report.ignored = [u for u in report.ignored if _in_partitions(u, wanted)]
        if skipped is not None:
            skipped.unreadable += [f"{path.rstrip('/')}/{u}" for u in report.unreadable]
            skipped.ignored += [f"{path.rstrip('/')}/{u}" for u in report.ignored]
        elif report.unreadable:
            more = f" (and {len(report.unreadable) - 1} more)" if len(report.unreadable) > 1 else ""
            raise TableError(f"table {path}: data file {report.unreadable[0]}{more}: fix or remove it (a spec's "
                             "on_error: skip leaves it out, reported)")
    root_name = table_root(path)

    def describe(item: tuple[str, pafs.FileInfo]) -> DataFile:
        relative, info = item
        name = child_name(root_name, relative) if relative else root_name
        return _describe(fs, info, name, fmt, posixpath.dirname(relative), local)

    return _parallel(describe, found)


def read_schema(file: DataFile) -> dict[str, str]:
    """Column name -> 'float' | 'int' | 'id_list' | 'float_list' | 'other:<arrow type>'."""
    module = format_module(file.format, file.path)
    fs, path = open_filesystem(file.path)
    try:
        with fs.open_input_file(path) as source:
            schema = module.Reader(source).schema
    except module.READ_ERRORS as e:
        raise TableError(f"cannot read the schema of {file.path}: {e}") from e
    return {field.name: column_kind(field.type) for field in schema}


def table_schema(files: Sequence[DataFile]) -> dict[str, str]:
    """The schema every file shares; files must have the same columns with the same kinds
    (a column missing from one file would fail reading its splits later)."""
    if not files:
        raise TableError("the table has no files")
    schemas = _parallel(read_schema, files)
    first, expected = files[0], schemas[0]
    for file, schema in zip(files[1:], schemas[1:]):
        for column in expected.keys() | schema.keys():
            if column not in schema:
                raise TableError(f"column {column!r} of {first.path} is missing from {file.path}")
            if column not in expected:
                raise TableError(f"column {column!r} of {file.path} is missing from {first.path}")
            if schema[column] != expected[column]:
                raise TableError(
                    f"column {column!r} is {expected[column]} in {first.path} but {schema[column]} in {file.path}"
                )
    return expected


def _in_partitions(entry: str, wanted: Sequence[str]) -> bool:
    directory = posixpath.dirname(entry.split(": ", 1)[0])
    return any(directory == w or directory.startswith(w + "/") for w in wanted)


def _is_data_name(relative: str, format: str) -> bool:
    """A name a table of ``format`` reads: its suffix, or none (Hive's ``000000_0``)."""
    return SUFFIXES.get(posixpath.splitext(relative)[1].lower()) == format or "." not in posixpath.basename(relative)


def _unreadable(root: str, format: str) -> list[str]:
    """Local data files pyarrow's listing does not show or cannot open: dangling symlinks
    (it leaves them out of a listing without a word) and files this user may not read."""
    out = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d[:1] not in (".", "_"))
        for name in sorted(names):
            full = os.path.join(directory, name)
            relative = os.path.relpath(full, root).replace(os.sep, "/")
            if name[:1] in (".", "_") or not _is_data_name(relative, format):
                continue
            if os.path.islink(full) and not os.path.exists(full):
                out.append(f"{relative}: a dangling symlink (to {os.readlink(full)!r})")
            elif os.path.isfile(full) and not os.access(full, os.R_OK):
                out.append(f"{relative}: not readable by this user")
    return out


def _find_files(fs: pafs.FileSystem, root: str, path: str, format: Optional[str], report: Skipped,
                local: bool) -> tuple[str, list[tuple[str, pafs.FileInfo]]]:
    """(format, [(path relative to root, info)]) of the data files under a directory,
    sorted. Names starting with '.' or '_' (``_SUCCESS``, ``.crc``, ``_temporary/``) are
    writer bookkeeping, as in Hive and Spark, and skipped; files of another format and
    (local paths) unreadable data files go to ``report``."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    except (OSError, pa.ArrowException) as e:
        raise TableError(f"cannot list table path {path}: {e}") from e
    prefix = root.rstrip("/") + "/"
    files = []
    for info in infos:
        relative = info.path[len(prefix):]
        if info.type == pafs.FileType.File and not any(p[:1] in (".", "_") for p in relative.split("/")):
            files.append((relative, info))
    if format is None:
        found = {SUFFIXES[s] for s in (posixpath.splitext(r)[1].lower() for r, _ in files) if s in SUFFIXES}
        if len(found) > 1:
            raise TableError(f"table path {path} holds both ORC and Parquet files: give the format")
        if not found:
            raise TableError(f"no .orc, .parquet or .pq files under table path {path}")
        format = found.pop()
    # Hive writes data files without a suffix (``000000_0``): with a known format they count.
    report.ignored += [f"{r}: not a {format} file (suffix {posixpath.splitext(r)[1]!r})" for r, _ in files
                       if not _is_data_name(r, format)]
    files = [(r, i) for r, i in files if _is_data_name(r, format)]
    if local:
        report.unreadable += _unreadable(root, format)
    if not files:
        raise TableError(f"no {format} files under table path {path}")
    files.sort(key=lambda item: item[0])
    return format, files


def _select_partitions(files: list[tuple[str, pafs.FileInfo]], partitions: Sequence[str], path: str) -> list[tuple[str, pafs.FileInfo]]:
    if not partitions:
        raise TableError(f"table {path}: the partition list is empty (leave it out to read all partitions)")
    wanted = [p.strip("/") for p in partitions]
    matched = set()
    kept = []
    for relative, info in files:
        directory = posixpath.dirname(relative)
        hits = [w for w in wanted if directory == w or directory.startswith(w + "/")]
        matched.update(hits)
        if hits:
            kept.append((relative, info))
    missing = [p for p, w in zip(partitions, wanted) if w not in matched]
    if missing:
        raise TableError(f"table {path} has no partition {missing[0]!r}" + (f" (nor {missing[1:]})" if missing[1:] else ""))
    return kept


def posix_identity(st: os.stat_result) -> str:
    """``DataFile.identity`` of a file on a POSIX filesystem, from its ``stat``."""
    return f"posix:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def file_identity(info: pafs.FileInfo, local: bool) -> tuple[str, int]:
    """What the filesystem says of this version of the file (``DataFile.identity``) and its
    size. On a local disk (a path, ``file://``, ``slow+file://``: a POSIX filesystem, NFS
    included) ``posix:<inode>:<mtime ns>:<ctime ns>`` from ``stat``: a rewrite in place
    changes the times, a replacement the inode, and a change time cannot be set back
    (``utime`` restores a modification time, not it). Elsewhere (object stores) the
    modification time pyarrow's ``FileInfo`` gives (an S3 object's Last-Modified, in
    seconds): pyarrow 26 exposes no ETag, version or generation."""
    if local:
        st = os.stat(info.path)  # the file the reader opens (a symlinked table file: its target)
        return posix_identity(st), st.st_size
    mtime = info.mtime_ns
    return f"mtime_ns:{'unknown' if mtime is None else mtime}", info.size


def _describe(fs: pafs.FileSystem, info: pafs.FileInfo, name: str, fmt: str, partition: str,
              local: bool = False) -> DataFile:
    """The file from its footer, with its identity taken once here (workers get it with
    every split task; nothing is stat'ed per split read). A local file is stat'ed before
    and after its footer and tail are read; if it changed meanwhile, it is described again."""
    module = FORMATS[fmt]
    for _ in range(_LIST_ATTEMPTS):
        try:
            identity, size = file_identity(info, local)
            with fs.open_input_file(info.path) as source:
                num_rows, units = module.units(source)
                tail = source.read_at(min(size, TAIL_DIGEST_BYTES), size - min(size, TAIL_DIGEST_BYTES))
            if not local or file_identity(info, local) == (identity, size):
                break
        except (OSError, *module.READ_ERRORS) as e:  # OSError: stat of a file gone meanwhile
            raise TableError(f"cannot read the {fmt} footer of {name}: {e}") from e
    else:
        raise TableError(f"{name} changed while it was being listed ({_LIST_ATTEMPTS} times): list it when it is written")
    return DataFile(name, fmt, partition, num_rows, size, units, hashlib.blake2b(tail, digest_size=16).hexdigest(),
                    identity)


def _parallel(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(min(_METADATA_THREADS, len(items))) as pool:
        return list(pool.map(fn, items))


@dataclass
class Relisting:
    """What listing a table again found against the files listed before (``relist``)."""

    new: list[DataFile]  # files not listed before, described from their footers, sorted by path
    changed: list[str]  # listed files whose size or identity changed since: ``PATH: what``
    removed: list[str]  # listed files gone
    skipped: Skipped  # unreadable data files, files of another format (all of them, as list_table)


def relist(path: str, format: str, partitions: Optional[Sequence[str]], known: dict[str, DataFile],
           keep: Callable[[str], bool] = lambda partition: True) -> Relisting:
    """List the table at ``path`` again: one recursive listing, the identity of each file
    listed before (``known``, by path) compared with what the filesystem says now, and
    footers read only for new files whose partition ``keep`` accepts. A file is never
    described twice: a changed one is reported, not listed anew (its rows were planned from
    the old footer)."""
    fs, root = open_filesystem(path)
    local = target(path).local
    report = Skipped()
    _, found = _find_files(fs, root, path, format, report, local)
    if partitions is not None:
        found = _select_partitions(found, partitions, path)
    root_name = table_root(path)
    new, changed, seen = [], [], set()
    for relative, info in found:
        name = child_name(root_name, relative)
        seen.add(name)
        before = known.get(name)
        if before is None:
            if keep(posixpath.dirname(relative)):
                new.append((relative, info))
            continue
        try:
            identity, size = file_identity(info, local)
        except OSError as e:  # gone between the listing and the stat
            changed.append(f"{name}: cannot stat it ({e})")
            continue
        if before.identity and (identity, size) != (before.identity, before.nbytes):
            # Said of the version listed only: a file rewritten again and again is one problem
            # (told once), not one per listing.
            changed.append(f"{name}: changed after it was listed (listed with size {before.nbytes}, "
                           f"identity {before.identity})")
    removed = [f"{name}: removed after it was listed" for name in sorted(set(known) - seen)]

    def describe(item: tuple[str, pafs.FileInfo]) -> DataFile:
        relative, info = item
        return _describe(fs, info, child_name(root_name, relative), format, posixpath.dirname(relative), local)

    return Relisting(_parallel(describe, new), changed, removed, report)


def _parts(path: str) -> tuple[str, ...]:
    return tuple(p for p in path.split("/") if p)


def in_stream(partition: str, until: Optional[str]) -> bool:
    """Whether a following job reads files of ``partition``: every partition up to and
    including ``until`` (``table.follow.until``), compared path component by component
    (``ds=2026-01-03`` takes every ``ds=2026-01-03/hr=..``; Hive's zero-padded values sort
    as they read); every partition when ``until`` is None."""
    if until is None:
        return True
    wanted = _parts(until)
    return _parts(partition)[:len(wanted)] <= wanted


def reaches(partition: str, until: Optional[str]) -> bool:
    """Whether ``partition`` is (or lies under) ``until``: once it is listed, the stream ends."""
    return until is not None and _parts(partition)[:len(_parts(until))] == _parts(until)
