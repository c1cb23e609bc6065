"""How a worker process ends: signals, drain, and threads that fail.

A worker is three threads (control, producer, pusher) that only make sense together: a
thread that died alone would leave a worker that heartbeats as healthy and serves
nothing. So every thread body runs under ``guarded``: an exception is logged, the whole
worker stops, and ``Worker.run`` raises it, so the process exits non-zero and its
launcher replaces it.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)


class TableRefused(Exception):
    """The master's job names a table this worker may not read (``--allow-table``)."""


class WorkerFailed(RuntimeError):
    """A worker thread raised: the worker stopped (the cause is chained)."""


class Lifecycle:
    def __init__(self) -> None:
        self.stop = threading.Event()
        self.draining = threading.Event()  # no new splits; leave once the master says so
        self.requested: Optional[str] = None  # "drain" | "stop", from a signal handler
        self.failure: Optional[BaseException] = None

    def request(self, what: str) -> None:
        """For signal handlers: only a plain assignment there (Event.set takes a lock a
        second signal could deadlock on); the control thread acts on it within a tick."""
        if self.requested != "stop":
            self.requested = what

    def leaving(self) -> bool:
        return self.stop.is_set() or self.requested is not None

    def guarded(self, name: str, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except TableRefused as e:
                log.error("%s", e)
                self._fail(e)
            except BaseException as e:
                log.critical("worker thread %s failed; stopping the worker", name, exc_info=True)
                self._fail(e)
        return run

    def raise_failure(self) -> None:
        """In the main thread, once every thread has stopped."""
        if isinstance(self.failure, TableRefused):
            raise self.failure
        if self.failure is not None:
            raise WorkerFailed(f"a worker thread failed: {self.failure!r}") from self.failure

    def _fail(self, e: BaseException) -> None:
        if self.failure is None:
            self.failure = e
        self.stop.set()
