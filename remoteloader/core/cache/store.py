"""Blocks on storage: segments of each split under a directory of any pyarrow filesystem.

Layout under the cache root (a local directory, ``file://``, ``slow+...`` or ``s3://``)::

    v1/<split_key[:2]>/<split_key>/<unix-ms>-<random hex>.seg   one segment per write, never rewritten
    v1/<split_key[:2]>/<split_key>/used                          touched on use: least-recent-use GC
    v1/<split_key[:2]>/<split_key>/.tmp-...                      a local write in progress (or killed)

A cache is an optimisation, so a lookup never fails: a missing directory, a segment
deleted mid-read, a bad footer or MAC, or storage slower than ``timeout_s`` make misses,
counted, and the caller computes the blocks. Writes are atomic (temp + rename on a local
filesystem, one complete object on an object store), so a reader sees a whole segment or
none; a killed writer leaves at most a temp file, which readers skip and ``gc`` removes.
"""
from __future__ import annotations

import concurrent.futures
import logging
import posixpath
import queue
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Callable, Collection, Mapping, Optional, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from ...columns import Column
from ...formats import DEFAULT_COALESCE_GAP, IOStats, open_filesystem
from ...formats.fs import target
from ...formats.prefetch import PrefetchedFile, merge_ranges
from .segments import (BlockSigner, CorruptBlock, Footer, Unverifiable, check_key, decode_block, encode_segment,
                       footer_length, read_footer)

log = logging.getLogger(__name__)

LAYOUT = "v1"
SUFFIX = ".seg"
TEMP_PREFIX = ".tmp-"
USED = "used"
TAIL_GUESS = 64 << 10  # one request reads the footer of a segment of up to ~1000 blocks
TOUCH_INTERVAL_S = 3600.0  # a split's `used` marker is rewritten at most this often per process
TEMP_MAX_AGE_S = 3600.0  # older temp files are a killed writer's: gc deletes them
_FOOTER_CACHE_BYTES = 32 << 20
_LOOKUP_THREADS = 4

T = TypeVar("T")


@dataclass
class CacheCounters:
    """What a process's cache did, for status and metrics. Thread-safe: lookups, writes
    and the background writer all add to it."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_bytes: int = 0
    corrupt: int = 0
    unverifiable: int = 0
    faults: int = 0
    dropped: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def to_dict(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


@dataclass
class Lookup:
    """The verified blocks of one lookup and what it cost. ``found`` and ``missing``
    partition the keys asked for; ``corrupt`` / ``unverifiable`` count blocks (or whole
    segments, for a bad footer) set aside, ``faults`` storage failures and timeouts."""

    found: dict[str, Column] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    unverifiable: int = 0
    faults: int = 0
    bytes_read: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class SplitEntry:
    split_key: str
    segments: int
    blocks: int
    bytes: int  # everything under the split's directory (segments, marker, temp files)
    last_used: float  # unix seconds: the `used` marker or the newest segment, the later


@dataclass(frozen=True)
class GcResult:
    deleted_splits: int
    deleted_bytes: int
    deleted_temps: int
    remaining_bytes: int


@dataclass(frozen=True)
class VerifyResult:
    segments: int
    blocks: int
    corrupt: list[tuple[str, str]]  # (segment path, reason)
    unverifiable: list[tuple[str, str]]
    deleted: list[str]


@dataclass
class _Split:
    """One split directory as a listing shows it (no file read)."""

    directory: str
    segments: list[pafs.FileInfo] = field(default_factory=list)
    temps: list[pafs.FileInfo] = field(default_factory=list)
    used: Optional[float] = None  # marker mtime
    nbytes: int = 0

    @property
    def last_used(self) -> float:
        return max([self.used or 0.0, *(_mtime(s) for s in self.segments)])


class _FooterCache:
    """Parsed footers by segment path, least recently used out past a byte budget.
    Segments are immutable and never renamed, so a path's footer never changes."""

    def __init__(self, budget: int):
        self._budget = budget
        self._used = 0
        self._items: OrderedDict[tuple[str, str], Footer] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> Optional[Footer]:
        with self._lock:
            footer = self._items.get(key)
            if footer is not None:
                self._items.move_to_end(key)
            return footer

    def put(self, key: tuple[str, str], footer: Footer) -> None:
        with self._lock:
            if key in self._items:
                return
            self._items[key] = footer
            self._used += footer.nbytes
            while self._used > self._budget and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self._used -= old.nbytes


FOOTERS = _FooterCache(_FOOTER_CACHE_BYTES)


class _Deadline:
    """Runs calls on a few daemon threads so the caller waits at most a timeout: a hung
    storage request then costs a split ``timeout_s``, never the epoch, and never blocks
    the process's exit (the executor of ``concurrent.futures`` would)."""

    def __init__(self, threads: int):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name="cache-io", daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def run(self, call: Callable[[], T], timeout: float) -> T:
        """``call()``'s result; ``concurrent.futures.TimeoutError`` past ``timeout``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, call))
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # not started yet (threads busy with hung calls): never run it
            raise

    def close(self) -> None:
        for _ in self._threads:
            self._calls.put(None)

    def _work(self) -> None:
        while (item := self._calls.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as e:  # handed to the waiting caller
                future.set_exception(e)


class BlockStore:
    """Segments of blocks under ``uri``, checked with ``signer`` (see the module docstring)."""

    def __init__(self, uri: str, signer: BlockSigner, *, timeout_s: float = 10.0,
                 coalesce_gap: int = DEFAULT_COALESCE_GAP):
        self.uri = uri
        self.signer = signer
        self.timeout_s = timeout_s
        self.coalesce_gap = coalesce_gap
        self.counters = CacheCounters()
        self._fs, root = open_filesystem(uri)
        self._local = target(uri).local  # temp + rename; an object store needs neither directories nor renames
        self._base = posixpath.join(root.rstrip("/") or "/", LAYOUT)
        self._deadline = _Deadline(_LOOKUP_THREADS)
        self._touched: dict[str, float] = {}
        self._touch_lock = threading.Lock()

    def close(self) -> None:
        """Stop the lookup threads (a hung one ends with its request)."""
        self._deadline.close()

    def split_directory(self, split_key: str) -> str:
        check_key(split_key, "split key")
        return posixpath.join(self._base, split_key[:2], split_key)

    # -- lookup -----------------------------------------------------------------------

    def lookup(self, split_key: str, keys: Collection[str], io: Optional[IOStats] = None) -> Lookup:
        """The verified blocks of ``split_key`` among ``keys``; every other key missing.
        Never raises for a cache fault: each is a miss, counted in the result and in
        ``counters`` (an invalid ``split_key`` is the caller's bug: ``ValueError``).
        ``io`` (if given) gets the storage requests' counts."""
        directory = self.split_directory(split_key)
        wanted = set(keys)
        if not wanted:
            return Lookup()
        start = time.perf_counter()
        stats = IOStats()  # the read's own: a timed-out read may still be running
        try:
            result = self._deadline.run(lambda: self._lookup(directory, split_key, wanted, stats), self.timeout_s)
        except concurrent.futures.TimeoutError:
            log.warning("cache lookup of split %s timed out after %.1f s: computing its blocks", split_key,
                        self.timeout_s)
            result = Lookup(faults=1)
        except Exception:  # a cache must never fail a split; say why, count it, compute
            log.warning("cache lookup of split %s failed: computing its blocks", split_key, exc_info=True)
            result = Lookup(faults=1)
        else:
            result.bytes_read = stats.bytes_requested
            if io is not None:
                io.add(stats)
        result.missing = wanted - result.found.keys()
        result.hits, result.misses = len(result.found), len(result.missing)
        result.seconds = time.perf_counter() - start
        self.counters.add(hits=result.hits, misses=result.misses, corrupt=result.corrupt,
                          unverifiable=result.unverifiable, faults=result.faults, bytes_read=result.bytes_read,
                          read_seconds=result.seconds)
        return result

    def _lookup(self, directory: str, split_key: str, wanted: set[str], stats: IOStats) -> Lookup:
        result = Lookup()
        segments = self._list(directory).segments
        if segments:
            self._touch(split_key, directory)
        for info in sorted(segments, key=lambda i: posixpath.basename(i.path), reverse=True):  # newest first
            todo = wanted - result.found.keys()
            if not todo:
                break
            try:
                self._read_segment(info, split_key, todo, stats, result)
            except (CorruptBlock, Unverifiable, OSError, ValueError, pa.ArrowException) as e:
                _count(result, e)
                log.info("cache segment %s set aside: %s", info.path, e)
        return result

    def _read_segment(self, info: pafs.FileInfo, split_key: str, todo: set[str], stats: IOStats,
                      result: Lookup) -> None:
        """Adds to ``result`` the blocks of ``todo`` this segment holds and that verify."""
        cache_key = (self.uri, info.path)
        footer = FOOTERS.get(cache_key)
        with self._fs.open_input_file(info.path) as source:
            file = PrefetchedFile(source, info.size, stats)
            if footer is None:
                footer = _fetch_footer(file, info.path)
                FOOTERS.put(cache_key, footer)
            if footer.split_key != split_key:
                raise CorruptBlock(f"{info.path}: a segment of split {footer.split_key!r} in {split_key!r}'s directory")
            keys = sorted(todo & footer.blocks.keys())
            if not keys:
                return
            try:
                self.signer.check(footer)  # before fetching anything it could not vouch for
            except (CorruptBlock, Unverifiable) as e:
                _count(result, e, len(keys))
                return
            spans = [(footer.blocks[k].start, footer.blocks[k].end) for k in keys]
            stats.bytes_needed += sum(e - s for s, e in spans)
            file.fetch(merge_ranges(spans, self.coalesce_gap))
            for key, (s, e) in zip(keys, spans):
                try:
                    result.found[key] = decode_block(footer, key, file.view(s, e), self.signer)
                except CorruptBlock as err:  # an older segment may still hold a good copy
                    result.corrupt += 1
                    log.info("cache block set aside: %s", err)

    def _touch(self, split_key: str, directory: str) -> None:
        """Marks the split used (a tiny write at most once per ``TOUCH_INTERVAL_S`` per
        process), so ``gc`` keeps what jobs read, not only what they wrote lately."""
        now = time.monotonic()
        with self._touch_lock:
            if now - self._touched.get(split_key, -TOUCH_INTERVAL_S) < TOUCH_INTERVAL_S:
                return
            self._touched[split_key] = now
            if len(self._touched) > 100_000:  # forget splits whose interval has passed
                self._touched = {k: t for k, t in self._touched.items() if now - t < TOUCH_INTERVAL_S}
        try:
            with self._fs.open_output_stream(posixpath.join(directory, USED)) as out:
                out.write(b"")
        except (OSError, pa.ArrowException) as e:
            log.info("cache: cannot mark split %s used: %s", split_key, e)

    # -- write ------------------------------------------------------------------------

    def write(self, split_key: str, blocks: Mapping[str, Column]) -> int:
        """Writes ``blocks`` as one new segment of ``split_key``, atomically; the bytes
        written. Raises on a write failure (the background writer counts it)."""
        directory = self.split_directory(split_key)
        start = time.perf_counter()  # encoding and checksums count: they are what a put costs a worker
        pieces = encode_segment(split_key, blocks, self.signer)
        name = f"{time.time_ns() // 1_000_000:015d}-{secrets.token_hex(8)}{SUFFIX}"
        final = posixpath.join(directory, name)
        if self._local:
            self._fs.create_dir(directory, recursive=True)
            temp = posixpath.join(directory, TEMP_PREFIX + name)
            try:
                nbytes = self._write_object(temp, pieces)
                self._fs.move(temp, final)
            except BaseException:
                _delete_quietly(self._fs, temp)
                raise
        else:
            nbytes = self._write_object(final, pieces)
        self.counters.add(puts=1, put_bytes=nbytes, write_seconds=time.perf_counter() - start)
        return nbytes

    def _write_object(self, path: str, pieces: list) -> int:
        with self._fs.open_output_stream(path) as out:
            for piece in pieces:
                out.write(piece)
        return sum(memoryview(p).nbytes for p in pieces)

    # -- operations -------------------------------------------------------------------

    def entries(self) -> list[SplitEntry]:
        """Every split in the cache (reads each segment's footer for its block count; a
        segment whose footer cannot be read counts no blocks)."""
        out = []
        for split_key, split in sorted(self._scan().items()):
            blocks = 0
            for info in split.segments:
                try:
                    blocks += len(self._footer(info).blocks)
                except (CorruptBlock, OSError, ValueError, pa.ArrowException):
                    pass
            out.append(SplitEntry(split_key, len(split.segments), blocks, split.nbytes, split.last_used))
        return out

    def remove(self, split_key: str) -> None:
        """Deletes every segment of ``split_key`` (the master's rate probe cleans up after itself)."""
        try:
            self._fs.delete_dir(self.split_directory(split_key))
        except FileNotFoundError:
            pass

    def gc(self, max_bytes: int) -> GcResult:
        """Deletes whole splits, least recently used first, until the cache holds at most
        ``max_bytes``; first the temp files of writers killed over an hour ago, and
        directories left with no segment (only a `used` marker)."""
        splits = self._scan()
        now = time.time()
        temps = 0
        for split in splits.values():
            stale = [t for t in split.temps if now - _mtime(t) > TEMP_MAX_AGE_S]
            for info in stale:
                _delete_quietly(self._fs, info.path)
                split.nbytes -= info.size
            split.temps = [t for t in split.temps if t not in stale]
            temps += len(stale)
        total = sum(s.nbytes for s in splits.values())
        deleted = deleted_bytes = 0
        for split in sorted(splits.values(), key=lambda s: s.last_used):
            if total <= max_bytes and (split.segments or split.temps):  # a bare marker goes anyway
                continue
            nbytes = split.nbytes
            try:
                self._fs.delete_dir(split.directory)
            except FileNotFoundError:  # another gc got there first
                pass
            total -= nbytes
            deleted += 1
            deleted_bytes += nbytes
        return GcResult(deleted, deleted_bytes, temps, total)

    def verify(self, delete: bool = False) -> VerifyResult:
        """Reads and checks every block of every segment (the footer parsed afresh, not
        from the per-process cache); deletes corrupt segments if ``delete``. Unverifiable
        segments (keyed with a key not held here) are reported, never deleted."""
        segments = blocks = 0
        corrupt: list[tuple[str, str]] = []
        unverifiable: list[tuple[str, str]] = []
        deleted: list[str] = []
        for split_key, split in sorted(self._scan().items()):
            for info in split.segments:
                segments += 1
                try:
                    blocks += self._verify_segment(info, split_key)
                except Unverifiable as e:
                    unverifiable.append((info.path, str(e)))
                except (CorruptBlock, OSError, ValueError, pa.ArrowException) as e:
                    corrupt.append((info.path, str(e)))
                    if delete:
                        _delete_quietly(self._fs, info.path)
                        deleted.append(info.path)
        return VerifyResult(segments, blocks, corrupt, unverifiable, deleted)

    def _verify_segment(self, info: pafs.FileInfo, split_key: str) -> int:
        with self._fs.open_input_file(info.path) as source:
            data = source.read_at(info.size, 0)
        footer = read_footer(data, info.size, info.path)
        if footer.split_key != split_key:
            raise CorruptBlock(f"{info.path}: a segment of split {footer.split_key!r} in {split_key!r}'s directory")
        self.signer.check(footer)
        for key, desc in footer.blocks.items():
            decode_block(footer, key, memoryview(data)[desc.start:desc.end], self.signer)
        return len(footer.blocks)

    def _footer(self, info: pafs.FileInfo) -> Footer:
        footer = FOOTERS.get((self.uri, info.path))
        if footer is None:
            with self._fs.open_input_file(info.path) as source:
                footer = _fetch_footer(PrefetchedFile(source, info.size, IOStats()), info.path)
            FOOTERS.put((self.uri, info.path), footer)
        return footer

    # -- listing ----------------------------------------------------------------------

    def _list(self, directory: str) -> _Split:
        split = _Split(directory)
        for info in self._fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True)):
            _classify(split, info)
        return split

    def _scan(self) -> dict[str, _Split]:
        """Every split directory with its files, from one recursive listing."""
        splits: dict[str, _Split] = {}
        prefix = self._base.rstrip("/") + "/"
        for info in self._fs.get_file_info(pafs.FileSelector(self._base, allow_not_found=True, recursive=True)):
            parts = info.path[len(prefix):].split("/") if info.path.startswith(prefix) else []
            if len(parts) != 3 or info.type != pafs.FileType.File:
                continue
            split_key = parts[1]
            split = splits.setdefault(split_key, _Split(posixpath.dirname(info.path)))
            _classify(split, info)
        return splits


def _classify(split: _Split, info: pafs.FileInfo) -> None:
    if info.type != pafs.FileType.File:
        return
    name = info.base_name
    split.nbytes += info.size
    if name.startswith(TEMP_PREFIX):
        split.temps.append(info)
    elif name.endswith(SUFFIX):
        split.segments.append(info)
    elif name == USED:
        split.used = _mtime(info)


def _fetch_footer(file: PrefetchedFile, path: str) -> Footer:
    """The footer, with one request for a footer within ``TAIL_GUESS`` bytes, two otherwise."""
    size = file.size
    first = min(size, TAIL_GUESS)
    file.fetch([(size - first, size)])
    length = footer_length(file.view(size - first, size), size, path)
    if length > first:
        file.fetch([(size - length, size - first)])
    file.stats.bytes_needed += length
    return read_footer(file.view(size - length, size), size, path)


def _count(result: Lookup, error: BaseException, blocks: int = 1) -> None:
    """Counts ``blocks`` set aside for ``error`` (a whole segment's footer or read: one)."""
    if isinstance(error, CorruptBlock):
        result.corrupt += blocks
    elif isinstance(error, Unverifiable):
        result.unverifiable += blocks
    else:
        result.faults += blocks


def _mtime(info: pafs.FileInfo) -> float:
    return info.mtime.timestamp() if info.mtime is not None else 0.0


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except (OSError, pa.ArrowException):
        pass
