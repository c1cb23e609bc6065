"""``python -m remoteloader.worker.forkserver --control FD``: local workers forked from one warm process.

A fresh worker process spends about a second and a half of CPU before it can take a
split: importing pyarrow and numba, then numba setting up its compiler at the first
compiled call. A master's local launcher pays that once per master: it starts this
server, which imports the worker and warms numba up, and then forks one child per worker
it is asked for. A forked worker runs ``remoteloader-worker``'s ``main`` with the
arguments it was given: it is forked in milliseconds and serves its first batch in about
a third of the time a worker started by its command takes (benchmarks/worker_start.py).

The server starts no thread and creates no ZeroMQ context (each worker makes its own
after the fork); the only other threads it has are the idle ones its libraries start as
they load (OpenBLAS's, jemalloc's in pyarrow), which hold their locks across a fork with
their own fork handlers. Nothing random is drawn before a fork: each worker makes its own
keys and nonces, as a fresh process would.

The control channel is a Unix socket inherited as file descriptor ``FD``; each message
is one JSON object on one line.

=====================  ============================  ==========================================
from                   message                       meaning
=====================  ============================  ==========================================
launcher               ``{"argv": [ARG, ...]}``      fork a worker with these arguments
server                 ``{"pid": N}``                ... forked (one answer per request, in order)
server                 ``{"error": TEXT}``           ... refused (not a list of strings, too long)
server                 ``{"exit": N, "code": C}``    worker N ended; C as ``Popen.returncode``
launcher               ``{"stop": true}``            SIGKILL every worker, reap them, exit
=====================  ============================  ==========================================

The server dies with the master (parent-death signal, SIGKILL), and each worker with the
server (``--die-with-parent``, which the launcher passes): a master that crashes leaves
its workers draining on SIGTERM, as when it launched them by command. An orderly master
shutdown sends ``stop``. The server ignores SIGINT and SIGTERM, so that a Ctrl-C or a
service manager's SIGTERM to the whole process group reaches the master and the workers
but leaves the server to carry out the master's ``stop``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import selectors
import signal
import socket
import sys
import traceback
import warnings
from typing import Optional, Sequence

from ..core.procs import die_with_parent, set_process_name
from ..core.sizing import warm_up
from .__main__ import main as worker_main

log = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 1 << 20  # one request line: a worker's arguments
WORKER_NAME = "rl-worker"     # what ps -e and top show for a forked worker


class WorkerForkServer:
    """Forks workers on request and reports each one's end; one thread, one selector."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.children: set[int] = set()
        self._pending = b""
        # SIGCHLD wakes the selector through this pair (the handler itself does nothing).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.control, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    def serve(self) -> int:
        """Until ``stop`` (0) or the launcher's end of the socket closing (0: the master
        is gone, and the workers drain on their parent-death signal once this exits)."""
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self._wake_r:
                    self._drain_wakeups()
                    self._reap()
                    continue
                data = self.control.recv(65536)
                if not data:
                    return 0
                self._pending += data
                while b"\n" in self._pending:
                    line, self._pending = self._pending.split(b"\n", 1)
                    if self._handle(line):
                        return 0
                if len(self._pending) > MAX_REQUEST_BYTES:
                    self._send({"error": f"a request longer than {MAX_REQUEST_BYTES} bytes"})
                    self._pending = b""

    def _handle(self, line: bytes) -> bool:
        """One request; True for ``stop``."""
        try:
            request = json.loads(line)
        except (ValueError, RecursionError):
            request = None
        if isinstance(request, dict) and request.get("stop") is True:
            self._stop_all()
            return True
        argv = request.get("argv") if isinstance(request, dict) else None
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            self._send({"error": "expected {\"argv\": [strings]} or {\"stop\": true}"})
            return False
        try:
            pid = self._fork(argv)
        except OSError as e:  # no memory, or the process limit: this start fails, the others run on
            self._send({"error": f"fork failed: {e}"})
            return False
        self._send({"pid": pid})
        return False

    def _fork(self, argv: list[str]) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():
            # Python 3.12+ warns at a fork from a process with threads; this one's are the idle
            # library threads the module docstring names, safe across a fork.
            warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks",
                                    category=DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            self._become_worker(argv)  # never returns
        self.children.add(pid)
        return pid

    def _become_worker(self, argv: list[str]) -> None:
        """In the child: drop the server's signal set-up and sockets, run the worker, exit
        with its status (as ``multiprocessing`` ends a forked process: no return into the
        server's loop, no second run of its exit handlers)."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig, handler in ((signal.SIGCHLD, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL),
                                 (signal.SIGINT, signal.default_int_handler)):
                signal.signal(sig, handler)
            self._selector.close()
            for s in (self.control, self._wake_r, self._wake_w):
                s.close()
            set_process_name(WORKER_NAME)
            code = worker_main(argv)
        except SystemExit as e:  # argparse's errors and --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self._send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def _stop_all(self) -> None:
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self.children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.children.clear()

    def _send(self, message: dict) -> None:
        self.control.sendall(json.dumps(message).encode() + b"\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remoteloader.worker.forkserver", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--control", type=int, required=True, metavar="FD",
                   help="the inherited Unix socket the launcher sends requests on")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    control = socket.socket(fileno=args.control)
    try:
        # numba's compiler set-up and one cached kernel: what every forked worker would pay again.
        warm_up()
    except Exception:  # each worker then warms up on its own, and reports what fails
        log.warning("the worker fork server's warm-up failed; forked workers warm up themselves", exc_info=True)
    try:
        return WorkerForkServer(control).serve()
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the master is gone


if __name__ == "__main__":
    sys.exit(main())
