"""Every name the block cache touches, through one layer that never follows a symlink.

A cache location may be shared storage that others can write (``--cache-shared``), or a
directory a stranger made before us, so nothing found under it is trusted. On a local
filesystem (a path, ``file://``, ``slow+file://``) the cache root is opened once and held
as a file descriptor; every directory below it is opened relative to its parent with
``O_NOFOLLOW | O_DIRECTORY``, every file with ``O_NOFOLLOW`` (and ``O_NONBLOCK``, so a
planted FIFO cannot hang a read), and every unlink, rmdir, rename and ``utime`` is made
relative to a directory descriptor on a name that was not followed. So:

* a symlink, a FIFO, a device or a socket inside the cache is **skipped and counted**
  (``skipped``): never followed, listed, read, truncated, touched or deleted;
* in a private cache (the default) an entry that another user owns (not this user, not
  root) is skipped and counted the same way: only this user and root can have written a
  trustworthy one;
* a regular file with more than one link is never touched (a ``used`` marker) or
  trusted as a marker: a hard link to a file outside the cache is not the cache's;
* what the cache creates is private whatever the umask: directories 0700, files 0600
  (with ``--cache-shared``: 0770 and 0640, for the location's group, never others).

gc, the janitor (``--cache-max-bytes``), ``remoteloader cache ls``/``verify`` and the
lookups' ``used`` marker all go through ``LocalTree`` (or, on an object store, which has
no symlinks and no owners, ``RemoteTree``). ``open_location`` holds a local location to
the key directory's rules (``protocol/auth.py``): owned by this user (or root) and
writable by nobody else, unless the cache is explicitly shared.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import posixpath
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import pyarrow.fs as pafs

from ...formats.slowfs import Slowness

log = logging.getLogger(__name__)

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600
SHARED_DIR, SHARED_FILE = 0o770, 0o640  # --cache-shared: the location's group may read and write, others nothing
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_POLL_S = 0.01
_LOGGED_SKIPS = 20  # the first skips of a process are logged (a warning each), then only counted


class LocationRefused(ValueError):
    """A cache location others could write or plant in: the message names the path and the fix."""


class Skipped(OSError):
    """A name in the cache that is not ours to use: a symlink, a non-regular file, another
    user's entry in a private cache, a hard-linked marker. Counted, never followed."""


@dataclass(frozen=True)
class Entry:
    """A regular file of the cache, as a listing saw it (no file read)."""

    parts: tuple[str, ...]  # relative to the root
    path: str  # the root's path joined with parts: for messages and reports only, never opened
    size: int
    mtime: float  # unix seconds

    @property
    def name(self) -> str:
        return self.parts[-1]


def _join(root: str, parts: Sequence[str]) -> str:
    return posixpath.join(root.rstrip("/") or "/", *parts)


class _Skips:
    """How many entries a tree set aside, and a log line for each of the first few."""

    def __init__(self, root: str) -> None:
        self._root = root
        self._lock = threading.Lock()
        self.count = 0

    def add(self, parts: Sequence[str], why: str) -> None:
        with self._lock:
            self.count += 1
            first = self.count <= _LOGGED_SKIPS
        if first:
            log.warning("cache %s: skipped %s (%s): never followed, read or deleted", self._root,
                        "/".join(parts), why)


# -- the location -------------------------------------------------------------------------


def _refuse(path: str, what: str, fix: str) -> LocationRefused:
    return LocationRefused(f"cache location {path} {what}: {fix}")


def _shared_fix(path: str) -> str:
    return ("use another location, of this user's own (made with mkdir -m 700), or share this one on purpose "
            "with --cache-shared and --auth (docs/security.md, 'The block cache')")


def _make_dirs(path: str, mode: int) -> None:
    """Every missing level of ``path``, each made with exactly ``mode`` whatever the umask."""
    missing = []
    head = path
    while head and not os.path.lexists(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for level in reversed(missing):
        try:
            os.mkdir(level, mode)
        except FileExistsError:  # made meanwhile: checked as any existing location below
            continue
        fd = os.open(level, _DIR)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


def open_location(path: str, *, shared: bool, create: bool, private_levels: Sequence[str] = ()) -> Optional[int]:
    """A descriptor of the local cache root ``path`` (made 0700 with any missing parent if
    ``create``; None when it does not exist and not ``create``). Unless ``shared`` it must
    belong to this user (or root) and be writable by nobody else, as a key directory
    (``protocol/auth.py``), else ``LocationRefused`` naming the path and the fix; a root
    that group or others may only read is tightened to 0700, since a private cache is
    this user's alone. ``private_levels``: directories of the project's own (the embedded
    default's ``~/.cache/remoteloader``), tightened to 0700 when this user owns them."""
    uid = os.geteuid()
    if not os.path.lexists(path):
        if not create:
            return None
        _make_dirs(path, SHARED_DIR if shared else PRIVATE_DIR)
    for level in private_levels:
        with contextlib.suppress(OSError):
            fd = os.open(level, _DIR)
            try:
                st = os.fstat(fd)
                if st.st_uid == uid and stat.S_IMODE(st.st_mode) & 0o077:
                    os.fchmod(fd, PRIVATE_DIR)
            finally:
                os.close(fd)
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0) and not shared:
        raise _refuse(path, f"is a symlink owned by uid {link.st_uid}, not by this user (uid {uid}) or root",
                      f"remove it, then {_shared_fix(path)}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise _refuse(path, "is not a directory", "name a directory") from None
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not shared:
            if st.st_uid not in (uid, 0):
                raise _refuse(path, f"is owned by uid {st.st_uid}, not by this user (uid {uid}) or root, so its "
                              "owner could plant blocks there or read them", _shared_fix(path))
            if mode & 0o022 and not os.fstatvfs(fd).f_flag & os.ST_RDONLY:
                raise _refuse(path, f"is writable by group or others (mode {mode:04o}), so they could plant "
                              "blocks there or links that gc would follow",
                              f"chmod go-w {path} (and check what others put there), or share it on purpose with "
                              "--cache-shared and --auth")
            if mode & 0o077 and st.st_uid == uid:
                with contextlib.suppress(OSError):  # a read-only mount: nobody writes there anyway
                    os.fchmod(fd, mode & ~0o077)  # a private cache: others read no block either
                    log.info("cache location %s tightened from mode %04o to %04o", path, mode, mode & ~0o077)
        return fd
    except BaseException:
        os.close(fd)
        raise


# -- local trees --------------------------------------------------------------------------


class _LocalFile:
    """A regular file opened without following a link: ``read_at`` as pyarrow's files."""

    def __init__(self, fd: int, size: int, slowness: Optional[Slowness]) -> None:
        self._fd: Optional[int] = fd
        self._size = size
        self._slowness = slowness

    def size(self) -> int:
        return self._size

    def read_at(self, nbytes: int, offset: int) -> bytes:
        if self._slowness is not None:
            self._slowness.wait(nbytes)
        chunks, got = [], 0
        while got < nbytes:
            chunk = os.pread(self._fd, nbytes - got, offset + got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def read_all(self) -> bytes:
        return self.read_at(self._size, 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "_LocalFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalTree:
    """The cache root on this machine's disk, held open; every name relative to it (see
    the module docstring). ``slowness``: a ``slow+file://`` location's simulated latency
    and bandwidth, applied to listings, reads and writes as ``formats.slowfs`` does."""

    local = True

    def __init__(self, path: str, *, shared: bool = False, create: bool = True,
                 slowness: Optional[Slowness] = None, private_levels: Sequence[str] = ()) -> None:
        self.path = path
        self.shared = shared
        self._slowness = slowness
        self._uid = os.geteuid()
        self._dir_mode, self._file_mode = (SHARED_DIR, SHARED_FILE) if shared else (PRIVATE_DIR, PRIVATE_FILE)
        self._skips = _Skips(path)
        self._fd = open_location(path, shared=shared, create=create, private_levels=private_levels)
        self._finalizer = weakref.finalize(self, _close_quietly, self._fd) if self._fd is not None else None

    @property
    def skipped(self) -> int:
        return self._skips.count

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def _root(self) -> int:
        if self._fd is None:
            raise FileNotFoundError(errno.ENOENT, "no cache at this location", self.path)
        return self._fd

    def _ours(self, st: os.stat_result) -> bool:
        """An entry a private cache may use: this user's or root's (a shared one: anyone's)."""
        return self.shared or st.st_uid in (self._uid, 0)

    # -- walking ------------------------------------------------------------------------

    def _open_dir(self, parent: int, name: str, parts: Sequence[str], create: bool = False) -> int:
        try:
            fd = os.open(name, _DIR, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, self._dir_mode, dir_fd=parent)
                made = True
            except FileExistsError:  # another writer made it: checked below as any other
                made = False
            return self._open_dir_made(parent, name, parts, made)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                self._skips.add(parts, "a symlink or not a directory")
                raise Skipped(errno.ELOOP, "not a directory of the cache", "/".join(parts)) from None
            raise
        return self._checked_dir(fd, parts)

    def _open_dir_made(self, parent: int, name: str, parts: Sequence[str], made: bool) -> int:
        try:
            fd = os.open(name, _DIR, dir_fd=parent)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                self._skips.add(parts, "a symlink or not a directory")
                raise Skipped(errno.ELOOP, "not a directory of the cache", "/".join(parts)) from None
            raise
        if made:
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_uid == self._uid:
                    os.fchmod(fd, self._dir_mode)  # exactly, whatever the umask
        return self._checked_dir(fd, parts)

    def _checked_dir(self, fd: int, parts: Sequence[str]) -> int:
        st = os.fstat(fd)
        if not self._ours(st):
            os.close(fd)
            self._skips.add(parts, f"a directory of uid {st.st_uid} in a private cache")
            raise Skipped(errno.EPERM, "another user's directory", "/".join(parts))
        return fd

    def _walk(self, parts: Sequence[str], create: bool = False) -> int:
        """A descriptor of directory ``parts`` (relative to the root), every level opened
        relative to the one above without following a link; the caller closes it."""
        fd = os.dup(self._root())
        try:
            for i, name in enumerate(parts):
                child = self._open_dir(fd, name, parts[:i + 1], create)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def _dir(self, parts: Sequence[str], create: bool = False) -> Iterator[int]:
        fd = self._walk(parts, create)
        try:
            yield fd
        finally:
            os.close(fd)

    def _wait(self) -> None:
        if self._slowness is not None:
            self._slowness.wait(0, metadata=True)

    # -- listing ------------------------------------------------------------------------

    def _files(self, fd: int, parts: tuple[str, ...], skip_dirs: bool = True) -> tuple[list[Entry], list[str]]:
        """The regular files this cache may use in directory ``fd``, and its subdirectories'
        names (not opened); everything else skipped and counted."""
        files, dirs = [], []
        with os.scandir(fd) as it:
            for item in it:
                where = (*parts, item.name)
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:  # deleted since the listing
                    continue
                if stat.S_ISDIR(st.st_mode) and not skip_dirs:
                    dirs.append(item.name)
                elif not stat.S_ISREG(st.st_mode):
                    self._skips.add(where, "a symlink" if stat.S_ISLNK(st.st_mode) else
                                    "a directory where files belong" if stat.S_ISDIR(st.st_mode) else
                                    "not a regular file")
                elif not self._ours(st):
                    self._skips.add(where, f"a file of uid {st.st_uid} in a private cache")
                else:
                    files.append(Entry(where, _join(self.path, where), st.st_size, st.st_mtime))
        return files, dirs

    def list_files(self, parts: Sequence[str]) -> list[Entry]:
        """The regular files of directory ``parts``; [] if it does not exist or is skipped."""
        self._wait()
        try:
            with self._dir(parts) as fd:
                return self._files(fd, tuple(parts))[0]
        except (FileNotFoundError, Skipped):
            return []

    def leaf_dirs(self, parts: Sequence[str], depth: int) -> Iterator[tuple[tuple[str, ...], list[Entry]]]:
        """Every directory exactly ``depth`` levels below ``parts`` with its regular files
        (the cache's split directories: ``v1/<xx>/<split>``), found by opening each level
        without following a link; any other entry skipped and counted."""
        self._wait()
        try:
            top = self._walk(parts)
        except (FileNotFoundError, Skipped):
            return
        except PermissionError:  # a shared cache whose layout another user closed to us
            self._skips.add(parts, "a directory this user may not enter")
            return
        yield from self._below(top, tuple(parts), depth)

    def _below(self, fd: int, parts: tuple[str, ...], depth: int) -> Iterator[tuple[tuple[str, ...], list[Entry]]]:
        try:
            files, dirs = self._files(fd, parts, skip_dirs=depth == 0)
            if depth == 0:
                yield parts, files
                return
            for entry in files:  # a file where only directories belong (the cache's own dot files aside)
                if not entry.name.startswith("."):
                    self._skips.add(entry.parts, "a file where directories belong")
            for name in sorted(dirs):
                try:
                    child = self._open_dir(fd, name, (*parts, name))
                except (FileNotFoundError, Skipped):
                    continue
                except PermissionError:  # a shared cache: another user's directory closed to us
                    self._skips.add((*parts, name), "a directory this user may not enter")
                    continue
                yield from self._below(child, (*parts, name), depth - 1)
        finally:
            os.close(fd)

    # -- files ----------------------------------------------------------------------------

    def _stat_file(self, fd: int, name: str, parts: Sequence[str]) -> os.stat_result:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            self._skips.add(parts, "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file")
            raise Skipped(errno.ELOOP, "not a regular file of the cache", "/".join(parts))
        if not self._ours(st):
            self._skips.add(parts, f"a file of uid {st.st_uid} in a private cache")
            raise Skipped(errno.EPERM, "another user's file", "/".join(parts))
        return st

    def open_read(self, entry: Entry) -> _LocalFile:
        """``entry`` opened for reading: a regular file of the cache's, never a link's target."""
        parts = entry.parts
        with self._dir(parts[:-1]) as d:
            try:
                fd = os.open(parts[-1], _READ, dir_fd=d)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    self._skips.add(parts, "a symlink")
                    raise Skipped(errno.ELOOP, "a symlink in the cache", "/".join(parts)) from None
                raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not self._ours(st):
                self._skips.add(parts, "not a regular file of this user's")
                raise Skipped(errno.EPERM, "not a regular file of the cache", "/".join(parts))
            return _LocalFile(fd, st.st_size, self._slowness)
        except BaseException:
            os.close(fd)
            raise

    def write_new(self, parts: Sequence[str], name: str, temp: str, pieces: Sequence) -> int:
        """Writes ``pieces`` as the new file ``parts/name``, atomically (``temp`` first, then a
        rename in the same directory); missing directories made private. The bytes written."""
        with self._dir(parts, create=True) as d:
            fd = os.open(temp, _CREATE, self._file_mode, dir_fd=d)
            try:
                try:
                    os.fchmod(fd, self._file_mode)  # exactly, whatever the umask
                    if self._slowness is not None:
                        self._slowness.open_for_write()
                    nbytes = 0
                    for piece in pieces:
                        view = memoryview(piece).cast("B")
                        while view:
                            n = os.write(fd, view)
                            view = view[n:]
                            nbytes += n
                        if self._slowness is not None:
                            self._slowness.written(memoryview(piece).nbytes)
                finally:
                    os.close(fd)
                os.rename(temp, name, src_dir_fd=d, dst_dir_fd=d)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=d)
                raise
        return nbytes

    def touch(self, parts: Sequence[str]) -> None:
        """Sets the mtime of marker ``parts`` to now, making it (empty, private) if missing.
        Never opens an existing marker for writing: a link, a non-regular file or a file
        with other links is skipped (``Skipped``), so no file outside the cache changes."""
        with self._dir(parts[:-1]) as d:
            name = parts[-1]
            try:
                st = self._stat_file(d, name, parts)
            except FileNotFoundError:
                try:
                    fd = os.open(name, _CREATE, self._file_mode, dir_fd=d)
                except FileExistsError:
                    return  # another process made it just now: used already
                try:
                    os.fchmod(fd, self._file_mode)
                finally:
                    os.close(fd)
                return
            if st.st_nlink != 1:
                self._skips.add(parts, f"a marker with {st.st_nlink} links")
                raise Skipped(errno.EMLINK, "a hard-linked marker", "/".join(parts))
            os.utime(name, dir_fd=d, follow_symlinks=False)  # a link swapped in meanwhile: the link's own time

    def unlink(self, parts: Sequence[str]) -> None:
        """Deletes regular file ``parts`` (a link or anything else: ``Skipped``, kept)."""
        with self._dir(parts[:-1]) as d:
            self._stat_file(d, parts[-1], parts)
            os.unlink(parts[-1], dir_fd=d)  # unlink never follows: a link swapped in goes, not its target

    def remove_dir(self, parts: Sequence[str]) -> int:
        """Deletes directory ``parts``: its regular files, then the directory if that left it
        empty (a link or another entry inside is skipped, counted, and keeps it). The bytes
        of the files deleted."""
        deleted = 0
        try:
            parent = self._walk(parts[:-1])
        except (FileNotFoundError, Skipped):
            return 0
        try:
            try:
                d = self._open_dir(parent, parts[-1], parts)
            except (FileNotFoundError, Skipped, PermissionError):
                return 0
            try:
                files, _ = self._files(d, tuple(parts))  # subdirectories: skipped and counted
                for entry in files:
                    # Gone meanwhile, or (shared) another user's in a directory closed to us: kept.
                    with contextlib.suppress(FileNotFoundError, PermissionError):
                        os.unlink(entry.name, dir_fd=d)
                        deleted += entry.size
            finally:
                os.close(d)
            try:
                os.rmdir(parts[-1], dir_fd=parent)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR, errno.EACCES,
                                   errno.EPERM):
                    raise
        finally:
            os.close(parent)
        return deleted

    def read_small(self, parts: Sequence[str], limit: int) -> Optional[bytes]:
        """The first ``limit`` bytes of the cache's regular file ``parts``; None if missing or skipped."""
        try:
            with self._dir(parts[:-1]) as d:
                fd = os.open(parts[-1], _READ, dir_fd=d)
        except (FileNotFoundError, Skipped):
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                self._skips.add(parts, "a symlink")
                return None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not self._ours(st):
                self._skips.add(parts, "not a regular file of this user's")
                return None
            return os.pread(fd, limit, 0)
        finally:
            os.close(fd)

    def tighten(self, parts: Sequence[str]) -> None:
        """A private cache's own level (``v1``) made 0700 if this user owns it with looser
        modes (made by an older version under the umask)."""
        if self.shared or self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError, Skipped):
            with self._dir(parts) as fd:
                st = os.fstat(fd)
                if st.st_uid == self._uid and stat.S_IMODE(st.st_mode) & 0o077:
                    os.fchmod(fd, PRIVATE_DIR)

    @contextlib.contextmanager
    def lock(self, timeout: float) -> Iterator[bool]:
        """An exclusive ``flock`` on the root (a descriptor of its own, so threads of one
        process exclude each other too), tried for ``timeout`` seconds: yields whether held.
        Serializes the writers that keep ``--cache-max-bytes`` on this host."""
        if self._fd is None:  # no cache here (and none made): nothing to serialize
            yield False
            return
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._fd)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        held = False
                        break
                    time.sleep(_LOCK_POLL_S)
            yield held
        finally:
            os.close(fd)  # releases the lock


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


# -- object stores ------------------------------------------------------------------------


class RemoteTree:
    """A cache on an object store (or any non-local pyarrow filesystem): no symlinks and no
    owners there, so names are used as listed; only files and directories count."""

    local = False

    def __init__(self, fs: pafs.FileSystem, root: str) -> None:
        self.fs = fs
        self.path = root.rstrip("/") or "/"
        self.shared = False
        self._lock = threading.Lock()
        self._skips = _Skips(self.path)

    @property
    def skipped(self) -> int:
        return self._skips.count

    def close(self) -> None:
        pass

    def _entry(self, info: pafs.FileInfo) -> Entry:
        rel = posixpath.relpath(info.path, self.path)
        return Entry(tuple(rel.split("/")), info.path, info.size,
                     info.mtime.timestamp() if info.mtime is not None else 0.0)

    def list_files(self, parts: Sequence[str]) -> list[Entry]:
        infos = self.fs.get_file_info(pafs.FileSelector(_join(self.path, parts), allow_not_found=True))
        return [self._entry(i) for i in infos if i.type == pafs.FileType.File]

    def leaf_dirs(self, parts: Sequence[str], depth: int) -> Iterator[tuple[tuple[str, ...], list[Entry]]]:
        """Directories ``depth`` levels below ``parts`` with their files, from one recursive listing."""
        base = _join(self.path, parts)
        found: dict[tuple[str, ...], list[Entry]] = {}
        for info in self.fs.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=True)):
            if info.type != pafs.FileType.File or not info.path.startswith(base.rstrip("/") + "/"):
                continue
            entry = self._entry(info)
            if len(entry.parts) == len(parts) + depth + 1:
                found.setdefault(entry.parts[:-1], []).append(entry)
        yield from sorted(found.items())

    def open_read(self, entry: Entry):
        return self.fs.open_input_file(entry.path)

    def write_new(self, parts: Sequence[str], name: str, temp: str, pieces: Sequence) -> int:
        """One upload of the final name: the object appears only once it is whole."""
        with self.fs.open_output_stream(_join(self.path, (*parts, name))) as out:
            for piece in pieces:
                out.write(piece)
        return sum(memoryview(p).nbytes for p in pieces)

    def touch(self, parts: Sequence[str]) -> None:
        with self.fs.open_output_stream(_join(self.path, parts)) as out:
            out.write(b"")

    def unlink(self, parts: Sequence[str]) -> None:
        self.fs.delete_file(_join(self.path, parts))

    def remove_dir(self, parts: Sequence[str]) -> int:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_dir(_join(self.path, parts))
        return 0

    def read_small(self, parts: Sequence[str], limit: int) -> Optional[bytes]:
        return None  # no ledger on an object store: each process counts for itself

    def tighten(self, parts: Sequence[str]) -> None:
        pass

    @contextlib.contextmanager
    def lock(self, timeout: float) -> Iterator[bool]:
        """This process's writers only: an object store has no lock that every writer honours."""
        held = self._lock.acquire(timeout=max(timeout, 0.0))
        try:
            yield held
        finally:
            if held:
                self._lock.release()

