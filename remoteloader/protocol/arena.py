"""Shared-memory arenas: batches handed from a worker to a client on the same host without
going through a socket.

A worker also listens on an arena socket, a Unix stream socket in a private directory
(``PATH.arena`` beside an ``ipc://PATH`` data socket, else in a directory of its own), and
names it in ``register.arena``; the master passes it on in membership. A client on the same
host (the path exists there, in a private directory of its user's, and the worker is in its
network namespace) connects and gets an
``arena_offer`` and, with it (SCM_RIGHTS), the descriptor of a shared-memory file made for
that connection alone; it maps the file and names the arena in its credit. From then on
the worker may write a batch's tensors into a free region of the arena and send only the
header (``batch.arena``) over the data socket; the tensors the training loop gets are
views of the client's mapping, so the client copies none of the batch's bytes (the
worker's write replaces its send). When the client no longer reads a region (the last
tensor viewing it is gone), it says so in an ``arena_release`` on the arena socket, and
the worker may write it again. A worker whose arena is full sends frames as before.

Trust is the private directory's (and each side checks the other's uid); with cluster
keys the header naming a region is still sealed and checked before the region is read. What the worker wrote is still input: every region is bounds-checked against the
mapping before it is read, and the client reads the sizes it validates (``sparse.lengths``)
from its own copy, so a worker that rewrote a region after sending it could change
values, never where the client reads. An arena lives as long as its mappings: the worker
drops its mapping when the connection closes, the client's stays until its last view
of it is gone.

Messages on the arena socket are framed as a little-endian u32 length, then the msgpack
header (``wire.encode``), at most ``MAX_ARENA_MESSAGE`` bytes.
"""
from __future__ import annotations

import os
import socket
import struct
from typing import Optional, Sequence

from . import wire
from .address import AddressError, check_ipc_directory, ipc_path, is_ipc
from .messages import ARENA_ALIGN, Message

ARENA_SUFFIX = ".arena"
ENV_ARENA = "REMOTELOADER_ARENA"  # "off": a client never maps workers' arenas (diagnostics, benchmarks)
MAX_ARENA_MESSAGE = 64 << 10
PAGE = 4096  # regions start on page boundaries: no two batches share a page
_LENGTH = struct.Struct("<I")


class ArenaError(Exception):
    """An arena socket or offer that does not follow this protocol."""


def arena_socket_path(data_addr: str) -> Optional[str]:
    """The arena socket beside an ``ipc://`` data socket; None for any other address."""
    return ipc_path(data_addr) + ARENA_SUFFIX if is_ipc(data_addr) else None


def arenas_wanted() -> bool:
    return os.environ.get(ENV_ARENA, "").strip().lower() not in ("off", "0", "no", "false")


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where tensors of ``sizes`` bytes start in a region, in order, each aligned to
    ``ARENA_ALIGN``; and the region's size."""
    starts, end = [], 0
    for n in sizes:
        end = -(-end // ARENA_ALIGN) * ARENA_ALIGN
        starts.append(end)
        end += n
    return starts, end


def frame(message: Message) -> bytes:
    body = wire.encode(message)[0]
    if len(body) > MAX_ARENA_MESSAGE:
        raise ArenaError(f"an arena message of {len(body)} bytes (at most {MAX_ARENA_MESSAGE})")
    return _LENGTH.pack(len(body)) + body


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def peer_uid(sock: socket.socket) -> int:
    return peer_credentials(sock)[1]


def same_network_namespace(pid: int) -> bool:
    """Whether process ``pid`` is in this process's network namespace. Network namespaces
    on one machine stand for hosts (as in the project's multi-host tests): a worker in
    another one is on "another host", even where a shared filesystem would let its arena
    socket be reached. False when it cannot be told."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return False


def check_arena_path(path: str) -> None:
    """An arena socket path a master named: absolute, normalized, ``*.arena``, in a private
    directory of this user's (``check_ipc_directory``). Raises AddressError."""
    if not (isinstance(path, str) and path.endswith(ARENA_SUFFIX) and os.path.isabs(path)
            and os.path.normpath(path) == path and "\0" not in path):
        raise AddressError(f"not an arena socket path: {path[:120]!r}")
    check_ipc_directory(os.path.dirname(path))


class MessageReader:
    """Framed messages from a stream socket, as bytes arrive (bounded: a frame longer than
    ``MAX_ARENA_MESSAGE`` is an error, never buffered)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out = []
        while len(self._buf) >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(self._buf)
            if n > MAX_ARENA_MESSAGE:
                raise ArenaError(f"an arena message of {n} bytes (at most {MAX_ARENA_MESSAGE})")
            if len(self._buf) < _LENGTH.size + n:
                break
            body = bytes(self._buf[_LENGTH.size:_LENGTH.size + n])
            del self._buf[:_LENGTH.size + n]
            try:
                message, frames = wire.decode([body])
            except wire.ProtocolError as e:
                raise ArenaError(str(e)) from None
            out.append(message)
        return out
