"""Coalesced reads: fetch planned byte ranges with few requests, then let the format
libraries decode from memory.

On disks and object stores the number of requests, not the bytes, sets the speed of a
projected read: a 10% projection of a wide table is hundreds of small, scattered column
streams. The format modules plan the byte ranges a split needs from the file's own
metadata; ``merge_ranges`` joins ranges whose gap is at most ``coalesce_gap`` (reading
the gap costs less than another request); ``PrefetchedFile`` fetches each merged range
with one request and serves the decoders' reads from memory. A decoder read that falls
outside the fetched ranges still works (one more request), and is counted.

File tails (ORC postscript + footer, Parquet footer) are fetched with one request of
the format's first guess (two when the tail is larger) and kept in a small per-process
cache: a worker reads many splits of the same file.
"""
from __future__ import annotations

import bisect
import io
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence, Union

import pyarrow as pa

from .types import IOStats, TableError

DEFAULT_COALESCE_GAP = 1310720  # 1.25 MiB, DPP's merge distance
_TAIL_CACHE_BYTES = 64 << 20

Range = tuple[int, int]  # [start, end)


def merge_ranges(ranges: Sequence[Range], gap: int) -> list[Range]:
    """Sorted ranges with those closer than ``gap`` bytes merged; ``gap <= 0`` merges only
    overlapping ranges, so each stream or column chunk stays its own request."""
    merged: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and (start < merged[-1][1] or (gap > 0 and start - merged[-1][1] <= gap)):
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


class PrefetchedFile(io.RawIOBase):
    """A read-only file over ``source`` serving reads from fetched byte ranges.

    Hand it to pyarrow as ``pa.PythonFile(f, mode="r")``. ``unplanned`` counts decoder
    reads that had to go to storage (the plan missed them)."""

    def __init__(self, source: pa.NativeFile, size: int, stats: IOStats):
        super().__init__()
        self._source = source
        self._size = size
        self.stats = stats
        self._starts: list[int] = []  # fetched ranges, sorted, never overlapping
        self._buffers: list[bytes] = []
        self._pos = 0
        self.unplanned = 0

    @property
    def size(self) -> int:
        return self._size

    def fetch(self, ranges: Sequence[Range]) -> None:
        """One request per range, less what earlier fetches already hold."""
        for start, end in ranges:
            for piece in self._uncovered(max(start, 0), min(end, self._size)):
                self._insert(piece[0], self._request(*piece))

    def add(self, start: int, data: bytes) -> None:
        """Bytes known without a request (a cached tail)."""
        for s, e in self._uncovered(start, start + len(data)):
            self._insert(s, data[s - start:e - start])

    def view(self, start: int, end: int) -> Optional[Union[memoryview, bytes]]:
        """The bytes [start, end) if fetched (contiguously), else None."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            return None
        s, buf = self._starts[i], self._buffers[i]
        if end <= s + len(buf):
            return memoryview(buf)[start - s:end - s]
        parts, pos = [memoryview(buf)[start - s:]], s + len(buf)
        for s, buf in zip(self._starts[i + 1:], self._buffers[i + 1:]):
            if s != pos:
                return None
            parts.append(memoryview(buf)[:end - s])
            pos = s + len(buf)
            if pos >= end:
                return b"".join(parts)
        return None

    def _request(self, start: int, end: int) -> bytes:
        data = self._source.read_at(end - start, start)
        self.stats.requests += 1
        self.stats.bytes_requested += len(data)
        if len(data) != end - start:
            raise TableError(f"short read at {start}: {len(data)} of {end - start} bytes (file changed?)")
        return data

    def _uncovered(self, start: int, end: int) -> list[Range]:
        pieces, pos = [], start
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        for s, buf in zip(self._starts[i:], self._buffers[i:]):
            if s >= end:
                break
            if s > pos:
                pieces.append((pos, s))
            pos = max(pos, s + len(buf))
        if pos < end:
            pieces.append((pos, end))
        return pieces

    def _insert(self, start: int, data: bytes) -> None:
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._buffers.insert(i, data)

    # -- the file protocol pyarrow's PythonFile uses ---------------------------------------

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = offset + (0 if whence == io.SEEK_SET else self._pos if whence == io.SEEK_CUR else self._size)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> Union[memoryview, bytes]:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        start = self._pos
        if end <= start:
            return b""
        data = self.view(start, end)
        if data is None:
            self.unplanned += 1
            data = self._request(start, end)
        self._pos = end
        return data


class _TailCache:
    """(path, size) -> (tail bytes, parsed tail), bounded in bytes, least recently used out.

    A file replaced by another of the same size would be misread: table files are
    written once (a rewrite goes to a new name or changes the size in practice)."""

    def __init__(self, budget: int):
        self._budget = budget
        self._used = 0
        self._items: OrderedDict[tuple[str, int], tuple[bytes, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> Optional[tuple[bytes, Any]]:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: tuple[str, int], raw: bytes, parsed: Any) -> None:
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (raw, parsed)
            self._used += len(raw)
            while self._used > self._budget and len(self._items) > 1:
                _, (old, _) = self._items.popitem(last=False)
                self._used -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._used = 0


TAIL_CACHE = _TailCache(_TAIL_CACHE_BYTES)


def clear_tail_cache() -> None:
    """Forget cached file tails (tests and benchmarks measure cold reads)."""
    TAIL_CACHE.clear()


def fetch_tail(file: PrefetchedFile, name: str, guess: int, tail_length: Callable[[memoryview], int],
               parse: Callable[[memoryview], Any]) -> Any:
    """The parsed tail of ``file`` (cached per process), its bytes left in ``file`` for the
    decoder. The first request reads the last ``guess`` bytes; ``tail_length`` tells from
    them how long the tail is."""
    size = file.size
    key = (name, size)
    cached = TAIL_CACHE.get(key)
    if cached is not None:
        raw, parsed = cached
        file.add(size - len(raw), raw)
        return parsed
    first = min(size, guess)
    file.fetch([(size - first, size)])
    length = tail_length(file.view(size - first, size))
    if length > size:
        raise TableError(f"the file's tail claims {length} bytes, the file has {size}")
    if length > first:
        file.fetch([(size - length, size - first)])
    file.stats.bytes_needed += length
    raw = bytes(file.view(size - max(length, first), size))
    parsed = parse(memoryview(raw)[len(raw) - length:])
    TAIL_CACHE.put(key, raw, parsed)
    return parsed
