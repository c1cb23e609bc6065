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

Every name is used through ``fs`` (``LocalTree`` on this machine's disk, ``RemoteTree`` on an
object store): relative to the root, never through a symlink, so a link or a non-regular
file planted in the cache is skipped and counted (``skipped``), never followed, listed,
read, touched or deleted; a private cache (the default) also skips another user's entries.
A split's ``used`` marker is touched only once one of its blocks has verified. With
``max_bytes`` (``--cache-max-bytes``) a write first evicts least recently used splits to
fit under the bound, under the root's lock, or is dropped (counted) when it cannot fit.
"""
from __future__ import annotations

import concurrent.futures
import logging
import posixpath
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Collection, Mapping, Optional, Sequence, TypeVar, Union

import pyarrow as pa

from ...columns import Column
from ...formats import DEFAULT_COALESCE_GAP, IOStats, open_filesystem
from ...formats.fs import target
from ...formats.prefetch import PrefetchedFile, merge_ranges
from ...formats.slowfs import is_slow_uri, split_slow_uri
from .fs import Entry, LocalTree, RemoteTree, Skipped
from .segments import (BlockSigner, CorruptBlock, Footer, FooterCache, Unverifiable, check_key, decode_block,
                       encode_segment, footer_length, read_footer)

log = logging.getLogger(__name__)

LAYOUT = "v1"
SUFFIX = ".seg"
TEMP_PREFIX = ".tmp-"
USED = "used"
TAIL_GUESS = 64 << 10  # one request reads the footer of a segment of up to ~1000 blocks
TOUCH_INTERVAL_S = 3600.0  # a split's `used` marker is rewritten at most this often per process
TEMP_MAX_AGE_S = 3600.0  # older temp files are a killed writer's: gc deletes them
USAGE = ".usage"  # v1/.usage: the bytes the cache holds as bounded writers and gc last counted (local)
USAGE_BYTES = 32  # what v1/.usage may take ("<bytes> <unix s>\n"): kept free under the bound
RESCAN_S = 60.0  # a bounded writer trusts that count this long, then lists the cache again
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
    skipped: int = 0  # entries set aside (links, non-regular files, other users' in a private cache): kept


@dataclass(frozen=True)
class VerifyResult:
    segments: int
    blocks: int
    corrupt: list[tuple[str, str]]  # (segment path, reason)
    unverifiable: list[tuple[str, str]]
    deleted: list[str]
    skipped: int = 0  # entries set aside, never read or deleted (see GcResult)


@dataclass
class _Split:
    """One split directory as a listing shows it (no file read)."""

    directory: str
    segments: list[Entry] = field(default_factory=list)
    temps: list[Entry] = field(default_factory=list)
    used: Optional[float] = None  # marker mtime
    nbytes: int = 0

    @property
    def last_used(self) -> float:
        return max([self.used or 0.0, *(s.mtime for s in self.segments)])


# Parsed footers and refused segments, within a budget of the memory they hold (segments.py).
FOOTERS = FooterCache(_FOOTER_CACHE_BYTES)


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
    """Segments of blocks under ``uri``, checked with ``signer`` (see the module docstring).

    ``shared``: the location may be shared with other users (``--cache-shared``): it need
    not be this user's, and others' entries are used (their blocks still verify or not);
    otherwise a local location must be this user's and writable by nobody else
    (``fs.LocationRefused``). ``create``: make a missing local location (0700); without
    it a missing location is an empty cache. ``max_bytes``: every write keeps the cache
    under it (evicting least recently used splits first, or dropping the write).
    ``private_levels``: the project's own directories above the location, tightened."""

    def __init__(self, uri: str, signer: BlockSigner, *, timeout_s: float = 10.0,
                 coalesce_gap: int = DEFAULT_COALESCE_GAP, shared: bool = False, create: bool = True,
                 max_bytes: Optional[int] = None, private_levels: Sequence[str] = ()):
        self.uri = uri
        self.signer = signer
        self.timeout_s = timeout_s
        self.coalesce_gap = coalesce_gap
        self.max_bytes = max_bytes
        self.counters = CacheCounters()
        where = target(uri)
        self._tree: Union[LocalTree, RemoteTree]
        if where.local:  # held open by descriptor; a slow+file:// location keeps its simulated slowness
            self._tree = LocalTree(where.path, shared=shared, create=create, private_levels=private_levels,
                                   slowness=split_slow_uri(uri)[1] if is_slow_uri(uri) else None)
        else:
            fs, root = open_filesystem(uri)
            self._tree = RemoteTree(fs, root)
        self._tree.tighten((LAYOUT,))
        self._base = posixpath.join(self._tree.path, LAYOUT)
        self._deadline = _Deadline(_LOOKUP_THREADS)
        self._touched: dict[str, float] = {}
        self._touch_lock = threading.Lock()
        self._usage: tuple[Optional[int], float] = (None, 0.0)  # bytes held, when last listed (see _make_room)

    @property
    def skipped(self) -> int:
        """Entries set aside so far: links, non-regular files, other users' in a private cache."""
        return self._tree.skipped

    def close(self) -> None:
        """Stop the lookup threads (a hung one ends with its request)."""
        self._deadline.close()

    def split_directory(self, split_key: str) -> str:
        check_key(split_key, "split key")
        return posixpath.join(self._base, split_key[:2], split_key)

    @staticmethod
    def _parts(split_key: str) -> tuple[str, ...]:
        check_key(split_key, "split key")
        return (LAYOUT, split_key[:2], split_key)

    def _parts_of(self, directory: str) -> tuple[str, ...]:
        """The parts under the root of a split directory named by ``split_directory``."""
        prefix = self._base.rstrip("/") + "/"
        if not directory.startswith(prefix):
            raise ValueError(f"{directory!r} is not a split directory of {self._base!r}")
        return (LAYOUT, *directory[len(prefix):].split("/"))

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
        for info in sorted(segments, key=lambda i: posixpath.basename(i.path), reverse=True):  # newest first
            todo = wanted - result.found.keys()
            if not todo:
                break
            try:
                self._read_segment(info, split_key, todo, stats, result)
            except (CorruptBlock, Unverifiable, OSError, ValueError, pa.ArrowException) as e:
                _count(result, e)
                log.info("cache segment %s set aside: %s", info.path, e)
        if result.found:  # only once a block of the split has verified: nothing planted is touched first
            self._touch(split_key, directory)
        return result

    def _read_segment(self, info: Entry, split_key: str, todo: set[str], stats: IOStats,
                      result: Lookup) -> None:
        """Adds to ``result`` the blocks of ``todo`` this segment holds and that verify."""
        cache_key = (self.uri, info.path)
        refused = FOOTERS.refusal(cache_key, self.signer, info.size)
        if refused is not None:  # refused before (bounds, scheme, footer MAC): not read again
            raise refused
        footer = FOOTERS.get(cache_key)
        with self._tree.open_read(info) as source:
            file = PrefetchedFile(source, info.size, stats)
            if footer is None:
                try:
                    footer = _fetch_footer(file, info.path, self.signer)
                except (CorruptBlock, Unverifiable) as e:
                    FOOTERS.refuse(cache_key, self.signer, info.size, e)
                    raise
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
            self._tree.touch((*self._parts_of(directory), USED))
        except (OSError, pa.ArrowException) as e:  # a link or another user's marker: Skipped, counted
            log.info("cache: cannot mark split %s used: %s", split_key, e)

    # -- write ------------------------------------------------------------------------

    def write(self, split_key: str, blocks: Mapping[str, Column]) -> int:
        """Writes ``blocks`` as one new segment of ``split_key``, atomically; the bytes
        written. Raises on a write failure (the background writer counts it). With
        ``max_bytes``, least recently used splits are evicted first so that the cache stays
        under it; a segment that cannot fit (larger than the bound, or the lock not had
        within ``timeout_s``) is not written: 0, counted as ``dropped``."""
        parts = self._parts(split_key)
        start = time.perf_counter()  # encoding and checksums count: they are what a put costs a worker
        pieces = encode_segment(split_key, blocks, self.signer)
        name = f"{time.time_ns() // 1_000_000:015d}-{secrets.token_hex(8)}{SUFFIX}"
        if self.max_bytes is None:
            nbytes = self._tree.write_new(parts, name, TEMP_PREFIX + name, pieces)
        else:
            size = sum(memoryview(p).nbytes for p in pieces)
            with self._tree.lock(self.timeout_s) as held:  # one bounded writer at a time on this host
                room = held and self._make_room(size)
                if room:
                    nbytes = self._tree.write_new(parts, name, TEMP_PREFIX + name, pieces)
                    total, scanned = self._usage
                    self._save_usage(total + nbytes, scanned)
            if not room:
                self.counters.add(dropped=1)
                log.info("cache write of split %s (%d bytes) dropped: %s", split_key, size,
                         "no room under --cache-max-bytes" if held else "the cache's lock was busy")
                return 0
        self.counters.add(puts=1, put_bytes=nbytes, write_seconds=time.perf_counter() - start)
        return nbytes

    def _make_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under ``max_bytes``, after evicting least recently used
        splits if they would not (the caller holds the lock). The bytes held are counted in
        ``v1/.usage``, which every bounded writer and gc on this host updates under the lock,
        and counted afresh (one listing of the cache) when that count is missing, older than
        ``RESCAN_S`` (writers without a bound, deletions by hand) or says the write would
        not fit. Eviction then goes a tenth of the bound further, so that the writes after
        it need no listing."""
        bound = self.max_bytes - (USAGE_BYTES if self._tree.local else 0)
        if nbytes > bound:
            return False
        total, scanned = self._load_usage()
        now = time.time()
        if total is None or not 0 <= now - scanned <= RESCAN_S or total + nbytes > bound:
            target = bound - nbytes
            if total is not None and total + nbytes > bound and target >= bound // 10:
                target -= bound // 10
            total, scanned = self._gc(target).remaining_bytes, now
            self._save_usage(total, scanned)
        return total + nbytes <= bound

    def _load_usage(self) -> tuple[Optional[int], float]:
        """(bytes, when they were last listed) from ``v1/.usage`` on a local cache (else this
        process's own count); (None, 0) when there is none or it does not parse."""
        data = self._tree.read_small((LAYOUT, USAGE), USAGE_BYTES) if self._tree.local else None
        if data is not None:
            try:
                total, scanned = (float(x) for x in data.decode("ascii").split())
                if total >= 0:
                    self._usage = (int(total), scanned)
            except ValueError:
                return None, 0.0
        elif self._tree.local:
            return None, 0.0
        return self._usage

    def _save_usage(self, total: int, scanned: float) -> None:
        self._usage = (total, scanned)
        if self._tree.local:
            try:
                tag = secrets.token_hex(8)
                self._tree.write_new((LAYOUT,), USAGE, f"{USAGE}.{tag}", [f"{total} {int(scanned)}\n".encode()])
            except OSError as e:  # the next bounded write lists the cache again
                log.info("cache: cannot record its size: %s", e)

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
        self._tree.remove_dir(self._parts(split_key))

    def gc(self, max_bytes: int) -> GcResult:
        """Deletes whole splits, least recently used first, until the cache holds at most
        ``max_bytes``; first the temp files of writers killed over an hour ago, and
        directories left with no segment (only a `used` marker). Takes the root's lock
        when it can within ``timeout_s`` (bounded writers wait), and runs anyway otherwise:
        it only ever deletes the cache's own regular files."""
        with self._tree.lock(self.timeout_s) as held:
            # Bounded writers keep v1/.usage on a local cache: room for it too, and its count renewed.
            ledger = self._tree.local and (self.max_bytes is not None or
                                           self._tree.read_small((LAYOUT, USAGE), USAGE_BYTES) is not None)
            result = self._gc(max(0, max_bytes - USAGE_BYTES) if ledger else max_bytes)
            if held and (ledger or self.max_bytes is not None):  # the count bounded writers trust, as of now
                self._save_usage(result.remaining_bytes, time.time())
            return result

    def _gc(self, max_bytes: int) -> GcResult:
        skipped = self._tree.skipped
        splits = self._scan()
        now = time.time()
        temps = 0
        for split in splits.values():
            stale = [t for t in split.temps if now - t.mtime > TEMP_MAX_AGE_S]
            for info in stale:
                self._delete_quietly(info)
                split.nbytes -= info.size
            split.temps = [t for t in split.temps if t not in stale]
            temps += len(stale)
        total = sum(s.nbytes for s in splits.values())
        deleted = deleted_bytes = 0
        for split in sorted(splits.values(), key=lambda s: s.last_used):
            if total <= max_bytes and (split.segments or split.temps):  # a bare marker goes anyway
                continue
            nbytes = split.nbytes
            self._tree.remove_dir(self._parts_of(split.directory))  # another gc got there first: nothing
            total -= nbytes
            deleted += 1
            deleted_bytes += nbytes
        return GcResult(deleted, deleted_bytes, temps, total, self._tree.skipped - skipped)

    def verify(self, delete: bool = False) -> VerifyResult:
        """Reads and checks every block of every segment (the footer parsed afresh, not
        from the per-process cache); deletes corrupt segments if ``delete``. Unverifiable
        segments (keyed with a key not held here) are reported, never deleted."""
        segments = blocks = 0
        corrupt: list[tuple[str, str]] = []
        unverifiable: list[tuple[str, str]] = []
        deleted: list[str] = []
        skipped = self._tree.skipped
        for split_key, split in sorted(self._scan().items()):
            for info in split.segments:
                segments += 1
                try:
                    blocks += self._verify_segment(info, split_key)
                except Unverifiable as e:
                    unverifiable.append((info.path, str(e)))
                except Skipped:  # swapped for a link since the listing: never read, never deleted
                    segments -= 1
                except (CorruptBlock, OSError, ValueError, pa.ArrowException) as e:
                    corrupt.append((info.path, str(e)))
                    if delete and self._delete_quietly(info):
                        deleted.append(info.path)
        return VerifyResult(segments, blocks, corrupt, unverifiable, deleted, self._tree.skipped - skipped)

    def _verify_segment(self, info: Entry, split_key: str) -> int:
        with self._tree.open_read(info) as source:
            data = source.read_at(info.size, 0)
        footer = read_footer(data, info.size, info.path, self.signer)
        if footer.split_key != split_key:
            raise CorruptBlock(f"{info.path}: a segment of split {footer.split_key!r} in {split_key!r}'s directory")
        self.signer.check(footer)
        for key, desc in footer.blocks.items():
            decode_block(footer, key, memoryview(data)[desc.start:desc.end], self.signer)
        return len(footer.blocks)

    def _footer(self, info: Entry) -> Footer:
        footer = FOOTERS.get((self.uri, info.path))
        if footer is None:
            with self._tree.open_read(info) as source:
                footer = _fetch_footer(PrefetchedFile(source, info.size, IOStats()), info.path)
            FOOTERS.put((self.uri, info.path), footer)
        return footer

    # -- listing ----------------------------------------------------------------------

    def _list(self, directory: str) -> _Split:
        split = _Split(directory)
        for info in self._tree.list_files(self._parts_of(directory)):
            _classify(split, info)
        return split

    def _scan(self) -> dict[str, _Split]:
        """Every split directory with its files (``v1/<xx>/<split>/``), each level opened
        without following a link: what ls, gc and verify see."""
        splits: dict[str, _Split] = {}
        for parts, files in self._tree.leaf_dirs((LAYOUT,), 2):
            split_key = parts[-1]
            if not files:
                continue  # an empty directory holds nothing to count (gc would keep it)
            split = splits.setdefault(split_key, _Split(posixpath.join(self._base, *parts[1:])))
            for info in files:
                _classify(split, info)
        return splits

    def _delete_quietly(self, info: Entry) -> bool:
        """Deletes the cache's own regular file ``info`` (never a link); whether it went."""
        try:
            self._tree.unlink(info.parts)
            return True
        except (OSError, pa.ArrowException):
            return False


def _classify(split: _Split, info: Entry) -> None:
    name = info.name
    split.nbytes += info.size
    if name.startswith(TEMP_PREFIX):
        split.temps.append(info)
    elif name.endswith(SUFFIX):
        split.segments.append(info)
    elif name == USED:
        split.used = info.mtime


def _fetch_footer(file: PrefetchedFile, path: str, signer: Optional[BlockSigner] = None) -> Footer:
    """The footer, with one request for a footer within ``TAIL_GUESS`` bytes, two otherwise;
    the trailer is bounded and its scheme checked against ``signer`` before any more is read
    (``segments.read_footer``; without a signer, as ``ls`` counts blocks, a keyed footer is
    parsed unverified, within the same bounds)."""
    size = file.size
    first = min(size, TAIL_GUESS)
    file.fetch([(size - first, size)])
    length = footer_length(file.view(size - first, size), size, path, signer)
    if length > first:
        file.fetch([(size - length, size - first)])
    file.stats.bytes_needed += length
    return read_footer(file.view(size - length, size), size, path, signer)


def _count(result: Lookup, error: BaseException, blocks: int = 1) -> None:
    """Counts ``blocks`` set aside for ``error`` (a whole segment's footer or read: one)."""
    if isinstance(error, CorruptBlock):
        result.corrupt += blocks
    elif isinstance(error, Unverifiable):
        result.unverifiable += blocks
    else:
        result.faults += blocks


