"""The worker's shared-memory arenas (``protocol/arena.py``): one per connection on its
arena socket, owned by the pusher's thread like the data socket.

Each arena is a memfd of ``--arena-bytes`` (pages are allocated as they are first written,
and regions are reused lowest first, so what an arena holds is about what its client has
not yet released). A batch goes into the first free region that fits; its client's
``arena_release`` frees it. A connection that closes takes its arena with it: the
worker's mapping goes, the client's stays valid for what it still reads.
"""
from __future__ import annotations

import bisect
import logging
import mmap
import os
import secrets
import socket
from typing import Optional, Sequence

import numpy as np
import zmq

from ..protocol import messages as M
from ..protocol.address import make_ipc_directory
from ..protocol.arena import ARENA_SUFFIX, PAGE, ArenaError, MessageReader, arena_socket_path, frame, layout, peer_uid

log = logging.getLogger(__name__)
MAX_ARENAS = 256  # connections served at once; more are closed at accept (their clients use frames)


class RegionAllocator:
    """First fit over ``[0, size)`` in pages: free ranges sorted by start, neighbours merged
    when a region is released."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]  # free ranges, sorted
        self._ends: list[int] = [size]
        self._taken: dict[int, int] = {}  # start -> end of each region handed out
        self.used = 0

    def allocate(self, nbytes: int) -> Optional[int]:
        need = max(PAGE, -(-nbytes // PAGE) * PAGE)
        for i, (start, end) in enumerate(zip(self._starts, self._ends)):
            if end - start >= need:
                if end - start == need:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = start + need
                self._taken[start] = start + need
                self.used += need
                return start
        return None

    def release(self, start: int) -> bool:
        """Free the region at ``start``; False (nothing changes) if none was handed out there."""
        end = self._taken.pop(start, None)
        if end is None:
            return False
        self.used -= end - start
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == end:  # merge with the next free range
            end = self._ends[i]
            del self._starts[i], self._ends[i]
        if i > 0 and self._ends[i - 1] == start:  # and with the previous one
            self._ends[i - 1] = end
        else:
            self._starts.insert(i, start)
            self._ends.insert(i, end)
        return True


class Arena:
    """One client's shared memory."""

    def __init__(self, nbytes: int) -> None:
        self.id = secrets.token_hex(8)
        self.fd = os.memfd_create("remoteloader-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self._map = mmap.mmap(self.fd, nbytes)
        except OSError:
            os.close(self.fd)
            raise
        self._bytes = np.frombuffer(self._map, np.uint8)
        self.regions = RegionAllocator(nbytes)
        self.size = nbytes

    def place(self, arrays: Sequence[np.ndarray]) -> Optional[M.ArenaSlice]:
        """Write ``arrays`` (contiguous) into a free region, one after another as ``layout``
        places them; None if no free region is large enough."""
        starts, total = layout([a.nbytes for a in arrays])
        offset = self.regions.allocate(total)
        if offset is None:
            return None
        for a, start in zip(arrays, starts):
            if a.nbytes:
                self._bytes[offset + start:offset + start + a.nbytes] = a.reshape(-1).view(np.uint8)
        return M.ArenaSlice(offset, total)

    def release(self, offsets: Sequence[int]) -> int:
        """Free the regions at ``offsets``; how many were not handed out (ignored)."""
        return sum(not self.regions.release(o) for o in offsets)

    def close(self) -> None:
        del self._bytes
        self._map.close()
        os.close(self.fd)


class ArenaServer:
    """The arena socket (``<data socket path>.arena``) and the arenas of its connections."""

    def __init__(self, path: str, arena_bytes: int, directory: Optional[str] = None) -> None:
        """Listen at ``path``; ``directory``: a private directory made for it, removed at close."""
        self.path, self.arena_bytes, self._directory = path, arena_bytes, directory
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(path)
            os.chmod(path, 0o600)  # behind the private directory, as the data socket
            self.listener.listen(64)
            self.listener.setblocking(False)
        except OSError:
            self.listener.close()
            raise
        self._conns: dict[int, tuple[socket.socket, Arena, MessageReader]] = {}  # fd -> connection
        self._by_id: dict[str, Arena] = {}
        self._poller: Optional[zmq.Poller] = None

    @classmethod
    def beside(cls, data_addr: str, arena_bytes: int) -> "ArenaServer":
        """The arena socket of a worker whose data socket is ``data_addr``: beside an ipc one
        (same private directory), else in a private directory of its own (0700, this user's:
        ``make_ipc_directory``), so that a tcp worker serves the ranks of its host too."""
        path = arena_socket_path(data_addr)
        if path is not None:
            return cls(path, arena_bytes)
        directory = make_ipc_directory()
        try:
            return cls(os.path.join(directory, "worker" + ARENA_SUFFIX), arena_bytes, directory)
        except OSError:
            os.rmdir(directory)
            raise

    def attach(self, poller: zmq.Poller) -> None:
        """Have ``poller`` watch the listener and every connection (the pusher's loop)."""
        self._poller = poller
        poller.register(self.listener.fileno(), zmq.POLLIN)

    def arena(self, arena_id: Optional[str]) -> Optional[Arena]:
        return self._by_id.get(arena_id) if arena_id is not None else None

    def on_ready(self, fd: int) -> bool:
        """Serve a socket the poller found readable; False if ``fd`` is not one of ours."""
        if fd == self.listener.fileno():
            self._accept()
            return True
        conn = self._conns.get(fd)
        if conn is None:
            return False
        sock, arena, reader = conn
        try:
            data = sock.recv(MAX_READ)
            if not data:
                raise ConnectionResetError("closed")
            for message in reader.feed(data):
                if not isinstance(message, M.ArenaRelease):
                    raise ArenaError(f"a client sent {M.tag(message)!r} on the arena socket")
                unknown = arena.release(message.offsets)
                if unknown:
                    log.warning("arena %s: %d released regions were never handed out (ignored)", arena.id, unknown)
        except BlockingIOError:
            pass
        except (OSError, ArenaError) as e:
            if not isinstance(e, ConnectionResetError):
                log.warning("closing arena %s: %s", arena.id, e)
            self._drop(fd)
        return True

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        try:
            if peer_uid(sock) != os.geteuid():  # the directory is the lock; this is a second one
                raise ArenaError("a connection from another user")
            if len(self._conns) >= MAX_ARENAS:
                raise ArenaError(f"{MAX_ARENAS} arenas in use")
            arena = Arena(self.arena_bytes)
        except (OSError, ArenaError) as e:
            log.warning("refused an arena connection: %s", e)
            sock.close()
            return
        try:
            # A new socket's buffer takes the small offer whole: this send does not block.
            socket.send_fds(sock, [frame(M.ArenaOffer(arena=arena.id, bytes=arena.size))], [arena.fd])
            sock.setblocking(False)
        except OSError as e:
            log.warning("could not offer an arena: %s", e)
            sock.close()
            arena.close()
            return
        self._conns[sock.fileno()] = (sock, arena, MessageReader())
        self._by_id[arena.id] = arena
        if self._poller is not None:
            self._poller.register(sock.fileno(), zmq.POLLIN)

    def _drop(self, fd: int) -> None:
        sock, arena, _ = self._conns.pop(fd)
        if self._poller is not None:
            self._poller.unregister(fd)
        self._by_id.pop(arena.id, None)
        sock.close()
        arena.close()

    def close(self) -> None:
        for fd in list(self._conns):
            self._drop(fd)
        if self._poller is not None:
            self._poller.unregister(self.listener.fileno())
        self.listener.close()
        try:
            os.unlink(self.path)
            if self._directory is not None:
                os.rmdir(self._directory)
        except FileNotFoundError:
            pass


MAX_READ = 64 << 10
