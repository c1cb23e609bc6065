"""Why a peer refused our socket's handshake, from ZeroMQ's socket monitor.

A CURVE server drops a peer whose handshake fails before any message reaches the
application, so without this a client with the wrong keys (or none) only sees silence and
a timeout. The client side of a refused handshake is distinct in the monitor's events:

* ``HANDSHAKE_FAILED_PROTOCOL`` with a mechanism mismatch: one side has keys (CURVE) and
  the other none (NULL);
* ``HANDSHAKE_FAILED_NO_DETAIL``: both have keys, different ones; or the same refusal
  again without its detail (reported before or after it, or alone);
* ``HANDSHAKE_FAILED_AUTH``: our keys are right but the server does not admit our public key.

A process without keys whose handshake fails meets a server that wants keys, whatever the
event says.

Explanations name where this process's keys came from (the directory), never a key.
"""
from __future__ import annotations

import time
from typing import Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from .auth import ENV_AUTH, Credentials

_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
DETAIL_WAIT_S = 0.5  # a refusal seen without detail waits this long for the detailed report of it


class HandshakeMonitor:
    """The handshake outcomes of one client socket (``refused()`` reads them)."""

    def __init__(self, sock: zmq.Socket, auth: Optional[Credentials], peer: str) -> None:
        self.auth, self.peer = auth, peer
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self._sock = sock
        self._reason: Optional[str] = None
        self._specific = False  # the reason comes from a detailed event
        self._since = 0.0  # when the first refusal since the last success was seen

    def refused(self) -> Optional[str]:
        """Why the peer refused our last handshake (None: no refusal since the last success)."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._reason, self._specific = None, False
            elif self._reason is None or (not self._specific and kind != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                # One refusal may be reported twice, with and without detail, in either order:
                # the detailed one (a mechanism mismatch, an auth refusal) says more.
                if self._reason is None:
                    self._since = time.monotonic()
                self._reason = self._explain(kind, value)
                self._specific = kind != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        if self._reason is not None and not self._specific and time.monotonic() - self._since < DETAIL_WAIT_S:
            return None  # its detail may still come
        return self._reason

    def _explain(self, kind: int, value: int) -> str:
        where = f"the key directory {self.auth.directory}" if self.auth is not None else \
            f"no key directory (no --auth / auth=, ${ENV_AUTH} unset)"
        if self.auth is None:  # a plain handshake fails only against a server that wants keys
            return (f"{self.peer} requires the cluster's keys (it runs with --auth) and this process has "
                    f"{where}: give it the cluster's key directory")
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MISMATCH:
            return (f"{self.peer} runs without keys (no --auth) and this process uses {where}: "
                    "use keys on both sides or on neither")
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (f"{self.peer} does not admit this process's public key (from {where}): its public_keys/ "
                    "lacks it; copy the cluster's whole key directory")
        # Not always reported with detail: either other keys, or none at the master.
        return (f"{self.peer} refused the CURVE handshake: its keys differ from those in {where}, or it runs "
                "without keys (no --auth); make the directory once with `remoteloader keygen` and copy it to "
                "every machine")

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
