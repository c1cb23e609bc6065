"""The local launcher's handle on a worker fork server (``python -m remoteloader.worker.forkserver``).

The server is started by its command, like any worker (the master never imports worker
code), and answers on a Unix socket pair; its module docstring describes the messages.
One thread owns a ``ForkServerHandle``: the launcher's.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Mapping, Optional

MAX_LINE_BYTES = 1 << 16  # the server's answers are a few dozen bytes


class ForkServerError(RuntimeError):
    """The fork server is gone, did not answer in time, or refused a request."""


class ForkServerHandle:
    """Starts the server; ``fork`` a worker, ``exits`` of those that ended, ``stop``."""

    # The first answer waits for the server's imports and numba's warm-up (a few seconds
    # on a busy machine); later ones take milliseconds.
    ANSWER_TIMEOUT_S = 120.0

    def __init__(self, env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "remoteloader.worker.forkserver",
                                          "--control", str(theirs.fileno())],
                                         env=dict(env), stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._pending = b""
        self._exits: list[tuple[int, int]] = []
        self.gone = False  # the server ended or broke the protocol: start another

    def fork(self, argv: list[str]) -> int:
        """A new worker's pid; ForkServerError if the server cannot start one."""
        self._send({"argv": argv})
        while True:
            message = self._next(self.ANSWER_TIMEOUT_S)
            if "pid" in message:
                return _int(message["pid"])
            if "error" in message:
                raise ForkServerError(f"the worker fork server refused a start: {message['error']}")

    def exits(self, read: bool = True) -> list[tuple[int, int]]:
        """(pid, exit code) of the workers reported ended since the previous call; never
        blocks. ``read=False``: only those already read (while waiting for a fork's answer)."""
        try:
            while read and self._next(0.0, block=False):
                pass
        except ForkServerError:
            pass  # gone: the caller sees self.gone
        exits, self._exits = self._exits, []
        return exits

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every worker (the server does, and reaps them), then end the server."""
        if not self.gone:
            try:
                self._send({"stop": True})
            except ForkServerError:
                pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._sock.close()
        self.gone = True

    def _send(self, message: dict) -> None:
        if self.gone:
            raise ForkServerError("the worker fork server is gone")
        try:
            self._sock.settimeout(self.ANSWER_TIMEOUT_S)
            self._sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError as e:
            self.gone = True
            raise ForkServerError(f"the worker fork server is gone ({e})") from None

    def _next(self, timeout_s: float, block: bool = True) -> Optional[dict]:
        """The server's next answer; exit reports are kept for ``exits`` and their message
        returned too. None when not blocking and nothing is there."""
        while b"\n" not in self._pending:
            try:
                self._sock.settimeout(timeout_s if block else 0.0)
                data = self._sock.recv(65536)
            except BlockingIOError:
                return None
            except socket.timeout:
                self.gone = True
                raise ForkServerError(f"the worker fork server did not answer within {timeout_s:.0f} s") from None
            except OSError as e:
                self.gone = True
                raise ForkServerError(f"the worker fork server is gone ({e})") from None
            if not data:
                self.gone = True
                raise ForkServerError(f"the worker fork server exited (code {self.proc.poll()})")
            self._pending += data
            if len(self._pending) > MAX_LINE_BYTES and b"\n" not in self._pending:
                self.gone = True
                raise ForkServerError("the worker fork server sent a line too long")
        line, self._pending = self._pending.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            self.gone = True
            raise ForkServerError(f"the worker fork server sent {line[:80]!r}")
        if "exit" in message:
            self._exits.append((_int(message["exit"]), _int(message.get("code", 1))))
        return message


def _int(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ForkServerError(f"the worker fork server sent {value!r} for a number")
    return value
