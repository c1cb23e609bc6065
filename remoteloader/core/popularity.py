"""The popularity log: which columns jobs read, written by the master, read by the
offline ``remoteloader reorder`` tool to store popular columns together.

``<journal dir>/popularity.jsonl`` holds one JSON object per line,
``{"time": <unix seconds>, "table": <table path>, "columns": [<column>, ...]}``. The
table is stored redacted (``redact``: no credential in a URI's query), the file is 0600
and a directory made for it 0700: the log names the tables a master reads.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Optional, Sequence

from .redact import open_private, redact


def record_projection(path: str, table: str, columns: Sequence[str], *, now: Optional[float] = None) -> None:
    """Append one job's projection to the popularity log ``path`` (one line, one write:
    concurrent appenders do not interleave lines)."""
    line = json.dumps({"time": time.time() if now is None else now, "table": redact(table), "columns": list(columns)})
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)  # an existing one is left as it is
    with os.fdopen(open_private(path, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8") as f:
        f.write(line + "\n")


def load_popularity(path: str, window_s: Optional[float] = None, now: Optional[float] = None, *,
                    table: Optional[str] = None) -> dict[str, int]:
    """Column -> number of logged jobs that read it, over the jobs of the last
    ``window_s`` seconds before ``now`` (default: all jobs), of ``table`` if given (matched
    as it was logged: redacted).
    Lines that do not parse (a torn last line after a crash) are skipped."""
    now = time.time() if now is None else now
    counts: Counter[str] = Counter()
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                job = json.loads(line)
                when, columns = float(job["time"]), job["columns"]
            except (ValueError, KeyError, TypeError):
                continue
            if window_s is not None and not now - window_s <= when <= now:
                continue
            if table is not None and job.get("table") != redact(table):
                continue
            counts.update(set(map(str, columns)))
    return dict(counts)
