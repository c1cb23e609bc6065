"""What the table layer hands to the rest of remoteloader: files, their read units, errors."""
from __future__ import annotations

from dataclasses import dataclass


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
