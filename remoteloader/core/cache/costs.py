"""What a job's splits cost a worker, per table column and per feature: the cache policy's input.

The producer thread records; the heartbeat thread reads a copy (``to_record``), so the
counters sit behind one lock. Reading and decoding is one call for all of a split's
columns, so its time is shared out by the columns' decoded bytes.
"""
from __future__ import annotations

import threading
from typing import Mapping

from ...columns import Column
from ...protocol.messages import Cost, JobCosts
from .writer import column_nbytes


class CostMeter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows = 0
        self._split_s = 0.0
        self._columns: dict[str, list[float]] = {}  # name -> [rows, seconds, bytes]
        self._features: dict[str, list[float]] = {}

    def split(self, rows: int, seconds: float) -> None:
        with self._lock:
            self._rows += rows
            self._split_s += seconds

    def read(self, columns: Mapping[str, Column], seconds: float) -> None:
        sizes = {name: column_nbytes(c) for name, c in columns.items()}
        total = sum(sizes.values()) or 1
        with self._lock:
            for name, nbytes in sizes.items():
                _add(self._columns, name, len(columns[name]), seconds * nbytes / total, nbytes)

    def transformed(self, seconds: Mapping[str, float], done: Mapping[str, Column]) -> None:
        with self._lock:
            for name, s in seconds.items():
                _add(self._features, name, len(done[name]), s, column_nbytes(done[name]))

    def to_record(self, fingerprint: str) -> JobCosts:
        with self._lock:
            return JobCosts(fingerprint, self._rows, self._split_s, _costs(self._columns), _costs(self._features))


def _add(table: dict[str, list[float]], name: str, rows: int, seconds: float, nbytes: int) -> None:
    entry = table.setdefault(name, [0, 0.0, 0])
    entry[0] += rows
    entry[1] += seconds
    entry[2] += nbytes


def _costs(table: dict[str, list[float]]) -> list[Cost]:
    return [Cost(name, int(rows), float(seconds), int(nbytes)) for name, (rows, seconds, nbytes) in sorted(table.items())]
