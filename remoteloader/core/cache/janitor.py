"""Keeping the cache under ``--cache-max-bytes``: a daemon thread that runs the store's
least-recently-used GC as soon as it starts (a cache left over the bound by an earlier run,
or by a smaller bound, is brought under it at start) and then every few minutes. Writes
keep the bound themselves (``BlockStore(max_bytes=...)``); the janitor also removes the
temp files of killed writers and splits left with only a marker. Several processes may
run one against the same store: a split removed under a reader is a miss there, never an
error. gc goes through ``fs``, so a link planted in the cache is never followed."""
from __future__ import annotations

import logging
import threading

from .store import BlockStore

log = logging.getLogger(__name__)
GC_INTERVAL_S = 300.0


class CacheJanitor:
    def __init__(self, store: BlockStore, max_bytes: int, interval_s: float = GC_INTERVAL_S) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-gc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:  # the first pass at once, then one every interval
            try:
                result = self.store.gc(self.max_bytes)
            except Exception as e:  # noqa: BLE001 - a GC failure must not take a worker or master down
                log.warning("cache gc of %s failed: %s", self.store.uri, e)
            else:
                log.info("cache gc: %s", result)
            if self._stop.wait(self.interval_s):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
