"""An append-only journal of update records, on disk before anyone hears of their effect.

Group commit: ``append`` only buffers; ``sync`` writes and fsyncs what was appended, once
per pass of the master's loop, before the replies of that pass go out. A crash can
lose records whose effects nobody was told about, which is the same as the requests
never having arrived. ``compact`` replaces the whole file by one ``Snapshot`` record (write
to a temporary file, fsync, rename), so the journal and its replay stay the size of
the current state, not of the job's history.

Format: a sequence of records, each a 4-byte little-endian length and a msgpack map
(``updates.encode``: the update's fields, tagged ``u`` by its type). A crash can leave a
torn last record; replay stops at the first incomplete record and truncates the file
there, so the journal always ends on a whole record before new ones are appended. A whole
record that cannot be read (damage, or written by another version: ``updates.decode``
checks every field of it against this version's types) is quarantined: copied to
``journal.quarantine`` with a log line naming its offset, and skipped, so the master still
starts.

The journal holds the job's spec as given (a restarted master serves it to workers), so
its directory is private to the master's user (0700) and its files are 0600.
"""
from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Iterator

from ..core.redact import open_private, private_dir
from .updates import Snapshot, Update, decode, encode

log = logging.getLogger(__name__)
_LEN = struct.Struct("<I")


def _frame(update: Update) -> bytes:
    """One record as it is stored: its length, then its msgpack map."""
    blob = encode(update)
    return _LEN.pack(len(blob)) + blob


class Journal:
    FILE = "journal.bin"

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        private_dir(self.dir)
        self.path = self.dir / self.FILE
        self._file = None
        self._pending: list[bytes] = []
        self.size = self.path.stat().st_size if self.path.exists() else 0  # bytes on disk, and pending

    def replay(self) -> Iterator[Update]:
        """Every whole record written so far, oldest first."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        pos = 0
        while pos + _LEN.size <= len(data):
            (n,) = _LEN.unpack_from(data, pos)
            if pos + _LEN.size + n > len(data):
                break
            record = data[pos + _LEN.size : pos + _LEN.size + n]
            try:
                update = decode(record)
            except ValueError as e:  # msgspec's DecodeError and ValidationError
                self.quarantine(pos, record, str(e))
                update = None
            pos += _LEN.size + n
            if update is not None:
                yield update
        if pos < len(data):
            log.warning("journal %s: dropping a torn tail of %d bytes", self.path, len(data) - pos)
            with open(self.path, "r+b") as f:
                f.truncate(pos)

    def quarantine(self, offset: int, record: bytes, why: str) -> None:
        """Set a record aside (kept for inspection) instead of replaying it."""
        where = f"at byte {offset}" if offset >= 0 else "that could not be applied"
        log.error("journal %s: record %s quarantined (%s)", self.path, where, why[:200])
        with os.fdopen(open_private(self.dir / "journal.quarantine", os.O_WRONLY | os.O_APPEND), "ab") as f:
            f.write(_LEN.pack(len(record)) + record)

    def append(self, update: Update) -> None:
        """Buffer a record; it is durable after the next ``sync``."""
        record = _frame(update)
        self._pending.append(record)
        self.size += len(record)

    def sync(self) -> None:
        """Write and fsync every record appended since the last sync (one fsync for all)."""
        if not self._pending:
            return
        if self._file is None:
            self._file = os.fdopen(open_private(self.path, os.O_WRONLY | os.O_APPEND), "ab")
        self._file.write(b"".join(self._pending))
        self._pending.clear()
        self._file.flush()
        os.fsync(self._file.fileno())

    def compact(self, snapshot: Snapshot) -> None:
        """Replace the journal by ``snapshot`` alone (after a sync: nothing pending is lost)."""
        self.sync()
        record = _frame(snapshot)
        tmp = self.dir / (self.FILE + ".tmp")
        with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as f:
            f.write(record)
            f.flush()
            os.fsync(f.fileno())
        if self._file is not None:
            self._file.close()
            self._file = None
        os.replace(tmp, self.path)  # atomic: a crash leaves the old journal or the new one
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.size = len(record)

    def close(self) -> None:
        self.sync()
        if self._file is not None:
            self._file.close()
            self._file = None
