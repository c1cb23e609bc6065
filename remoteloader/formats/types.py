"""What the table layer hands to the rest of remoteloader: files, their read units, errors."""
from __future__ import annotations

from dataclasses import dataclass, field


class TableError(ValueError):
    """A table that cannot be listed or read; the message names the path, file, partition
    or column at fault, so a master or worker can report it without more context."""


@dataclass(frozen=True)
class Unit:
    """The smallest independently readable piece of a file: one ORC stripe or one Parquet
    row group. Splits are ranges of units, so a split never decodes another split's rows."""

    index: int
    first_row: int  # within the file
    num_rows: int
    nbytes: int  # bytes on storage (compressed), what a read of the whole unit costs


@dataclass(frozen=True)
class DataFile:
    path: str  # full path or URI, reopenable by open_filesystem() in any process
    format: str  # "orc" | "parquet"
    partition: str  # partition dir relative to the table root, e.g. "ds=2026-01-01/hr=03"
    num_rows: int
    nbytes: int  # file size
    units: tuple[Unit, ...]
    # A digest of the file's last bytes (its footer: stripe or row-group offsets and
    # statistics), taken when the table is listed. With path, size and ``identity`` it is
    # the file's identity for the block cache: a file rewritten with the same size has
    # another tail, unless values only moved within a stripe (statistics unchanged).
    tail_digest: str = ""
    # What the filesystem says of this version of the file, taken once when the table is
    # listed (``formats.table.file_identity``): on a local or POSIX filesystem its inode and
    # modification and change times in nanoseconds, which any rewrite in place changes; on
    # an object store its modification time. "" for a file journaled by an older master.
    # Not part of equality: it describes when the file was seen, not what it holds.
    identity: str = field(default="", compare=False)

    def unit_range(self, first: int, stop: int) -> tuple[Unit, ...]:
        """Units ``[first, stop)`` by index, or () if the file does not list all of them. A
        file may list only a contiguous run of its units: a split task carries its split's."""
        base = self.units[0].index if self.units else 0
        units = self.units[first - base:stop - base] if base <= first < stop else ()
        return units if len(units) == stop - first else ()


@dataclass
class IOStats:
    """Storage reads of split reads: what a worker adds up and reports in its heartbeats.

    ``requests`` counts read requests (one per merged byte range, tail or stripe footer
    fetch, or unplanned read); ``bytes_requested`` is what those requests transferred and
    ``bytes_needed`` what the decoder actually needed (selected streams or column chunks,
    stripe footers, file tail), so ``bytes_requested / bytes_needed`` is the over-read.
    """

    requests: int = 0
    bytes_requested: int = 0
    bytes_needed: int = 0
    splits: int = 0

    def add(self, other: "IOStats") -> None:
        self.requests += other.requests
        self.bytes_requested += other.bytes_requested
        self.bytes_needed += other.bytes_needed
        self.splits += other.splits

    def to_dict(self) -> dict[str, int]:
        return {"requests": self.requests, "bytes_requested": self.bytes_requested,
                "bytes_needed": self.bytes_needed, "splits": self.splits}
