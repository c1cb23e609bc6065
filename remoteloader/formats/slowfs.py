"""Slow storage on a fast disk: a filesystem wrapper adding a fixed latency per request
and a bandwidth cap, so the effect of request counts (coalescing, reordering, stripe
sizes) is measurable locally.

Selected through the table path, so every process (master, workers) opening the table
gets it: prefix the scheme of a filesystem URI with ``slow+`` and say how slow in the
query, e.g. ``slow+file:///data/t?profile=hdd`` or
``slow+s3://bucket/t?profile=object_store&endpoint_override=host:9000&scheme=http``.
Query parameters: ``profile`` (``hdd``: 8 ms, 150 MB/s; ``object_store``: 20 ms,
80 MB/s), ``latency_ms`` and ``mbps`` (MB/s, 10**6 bytes) override the profile's values.
The other parameters stay with the wrapped filesystem's URI.

A request is one read call on an open file (``read``/``read_at``: one storage round
trip) or one metadata call (file info, listing); it sleeps ``latency + bytes /
bandwidth``. Opening a file for reading is free, as for a client that knows the size from
the listing. Writing is one request per opened output stream (one PUT, or one file's
create-and-close): opening it sleeps the latency once, and every write call sleeps its
bytes over the bandwidth. Moves, deletes and directory creation are free. Requests do
not queue behind each other (concurrent reads overlap, as on an object store).
``SLOW_IO`` counts every request of the process (writes apart from reads).
"""
from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass
from typing import Optional, Union
from urllib.parse import parse_qsl, urlencode, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from . import fs
from .types import TableError

PREFIX = "slow+"
PROFILES: dict[str, tuple[float, float]] = {  # name -> (latency s, bandwidth bytes/s)
    "hdd": (0.008, 150e6),
    "object_store": (0.020, 80e6),
}
_OWN_PARAMS = ("profile", "latency_ms", "mbps")


@dataclass
class SlowIOCounter:
    """Requests seen by every slow filesystem of the process."""

    requests: int = 0
    metadata_requests: int = 0
    bytes: int = 0
    write_requests: int = 0  # output streams opened
    bytes_written: int = 0
    seconds: float = 0.0  # simulated time slept, reads and writes

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def record(self, nbytes: int, seconds: float, metadata: bool = False) -> None:
        with self._lock:
            if metadata:
                self.metadata_requests += 1
            else:
                self.requests += 1
            self.bytes += nbytes
            self.seconds += seconds

    def record_write(self, nbytes: int, seconds: float, opened: bool = False) -> None:
        with self._lock:
            self.write_requests += int(opened)
            self.bytes_written += nbytes
            self.seconds += seconds

    def reset(self) -> None:
        with self._lock:
            self.requests = self.metadata_requests = self.bytes = 0
            self.write_requests = self.bytes_written = 0
            self.seconds = 0.0

    def snapshot(self) -> dict[str, Union[int, float]]:
        with self._lock:
            return {"requests": self.requests, "metadata_requests": self.metadata_requests,
                    "bytes": self.bytes, "write_requests": self.write_requests,
                    "bytes_written": self.bytes_written, "seconds": self.seconds}


SLOW_IO = SlowIOCounter()


@dataclass(frozen=True)
class Slowness:
    latency: float  # seconds per request
    bandwidth: float  # bytes per second

    def wait(self, nbytes: int, metadata: bool = False) -> None:
        seconds = self.latency + nbytes / self.bandwidth
        time.sleep(seconds)
        SLOW_IO.record(nbytes, seconds, metadata)

    def open_for_write(self) -> None:
        """An output stream opened: one request's latency."""
        time.sleep(self.latency)
        SLOW_IO.record_write(0, self.latency, opened=True)

    def written(self, nbytes: int) -> None:
        """``nbytes`` written to an open output stream: their time at the bandwidth."""
        seconds = nbytes / self.bandwidth
        time.sleep(seconds)
        SLOW_IO.record_write(nbytes, seconds)


def is_slow_uri(path: str) -> bool:
    return path.startswith(PREFIX)


def split_slow_uri(uri: str) -> tuple[str, Slowness]:
    """(the wrapped filesystem's URI, how slow) of a ``slow+...`` URI."""
    parts = urlsplit(uri[len(PREFIX):])
    query = parse_qsl(parts.query, keep_blank_values=True)
    own = {k: v for k, v in query if k in _OWN_PARAMS}
    profile = own.get("profile")
    if profile is None and not {"latency_ms", "mbps"} <= own.keys():
        raise TableError(f"{uri}: a slow+ URI needs profile= ({' | '.join(PROFILES)}) or latency_ms= and mbps=")
    if profile is not None and profile not in PROFILES:
        raise TableError(f"{uri}: unknown profile {profile!r} ({' | '.join(PROFILES)})")
    latency, bandwidth = PROFILES.get(profile, (0.0, 1.0))
    try:
        latency = float(own["latency_ms"]) / 1000 if "latency_ms" in own else latency
        bandwidth = float(own["mbps"]) * 1e6 if "mbps" in own else bandwidth
    except ValueError as e:
        raise TableError(f"{uri}: {e}") from None
    if latency < 0 or bandwidth <= 0:
        raise TableError(f"{uri}: latency_ms must be >= 0 and mbps > 0")
    inner = fs.unsplit(parts._replace(query=urlencode([(k, v) for k, v in query if k not in _OWN_PARAMS])))
    return inner, Slowness(latency, bandwidth)


def slow_filesystem(inner: pafs.FileSystem, slowness: Slowness) -> pafs.FileSystem:
    return pafs.PyFileSystem(_SlowHandler(inner, slowness))


class _SlowFile(io.RawIOBase):
    """A read-only file whose every read is one slow request."""

    def __init__(self, inner: pa.NativeFile, slowness: Slowness):
        super().__init__()
        self._inner = inner
        self._slowness = slowness

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._inner.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def size(self) -> int:
        return self._inner.size()

    def read(self, size: int = -1) -> bytes:
        data = self._inner.read(None if size is None or size < 0 else size)
        self._slowness.wait(len(data))
        return data

    def close(self) -> None:
        self._inner.close()
        super().close()


class _SlowOutput(io.RawIOBase):
    """A write-only stream: the latency was paid when it was opened, each write pays its
    bytes over the bandwidth."""

    def __init__(self, inner: pa.NativeFile, slowness: Slowness):
        super().__init__()
        self._inner = inner
        self._slowness = slowness

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._inner.tell()

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self._inner.write(data)
        self._slowness.written(n)
        return n

    def flush(self) -> None:
        if not self._inner.closed:
            self._inner.flush()

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
        super().close()


class _SlowHandler(pafs.FileSystemHandler):
    def __init__(self, inner: pafs.FileSystem, slowness: Slowness):
        self._inner = inner
        self._slowness = slowness

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SlowHandler) and self._inner.equals(other._inner) and self._slowness == other._slowness

    def __ne__(self, other: object) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return "slow+" + self._inner.type_name

    def normalize_path(self, path: str) -> str:
        return self._inner.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        infos = self._inner.get_file_info(paths)
        for _ in paths:
            self._slowness.wait(0, metadata=True)
        return infos

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        self._slowness.wait(0, metadata=True)
        return self._inner.get_file_info(selector)

    def open_input_file(self, path: str) -> pa.NativeFile:
        return pa.PythonFile(_SlowFile(self._inner.open_input_file(path), self._slowness), mode="r")

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self.open_input_file(path)

    # Moves, deletes and directories pass through unslowed; output streams are slow (_SlowOutput).
    def create_dir(self, path: str, recursive: bool) -> None:
        self._inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self._inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self._inner.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self._inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self._inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self._inner.copy_file(src, dest)

    def open_output_stream(self, path: str, metadata: Optional[dict] = None) -> pa.NativeFile:
        return self._slow_output(self._inner.open_output_stream(path, metadata=metadata))

    def open_append_stream(self, path: str, metadata: Optional[dict] = None) -> pa.NativeFile:
        return self._slow_output(self._inner.open_append_stream(path, metadata=metadata))

    def _slow_output(self, inner: pa.NativeFile) -> pa.NativeFile:
        self._slowness.open_for_write()
        return pa.PythonFile(_SlowOutput(inner, self._slowness), mode="w")
