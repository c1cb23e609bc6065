"""The client's side of a worker's shared-memory arena (``protocol/arena.py``).

One ``ArenaLink`` per worker of the partition on this host, owned by the fetcher (the
training thread). The link connects to the worker's arena socket, takes the offered
memfd and maps it; batches that lie in the arena become frames viewing that mapping.
Each batch's region is one ctypes object over the mapping, the buffer every view of the
batch ultimately holds: when the last tensor viewing it is gone, the object is, and a
finalizer queues the region's release, which the next ``flush`` sends to the worker.
The mapping outlives the link: a batch received stays readable after the worker left.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import socket
import stat
import weakref
from typing import Optional, Sequence

from ..protocol import messages as M
from ..protocol.address import AddressError
from ..protocol.arena import (ArenaError, MessageReader, check_arena_path, frame, layout, peer_credentials,
                              same_network_namespace)
from ..protocol.wire import tensor_bytes

log = logging.getLogger(__name__)


class ArenaLink:
    def __init__(self, path: str) -> None:
        """Connect to the arena socket at ``path``; OSError if there is none (a worker
        without arenas: its batches come as frames)."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)  # a listening Unix socket accepts into its backlog at once
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self.id: Optional[str] = None  # set once the offer is taken
        self._map: Optional[mmap.mmap] = None
        self.size = 0
        self._released: collections.deque[int] = collections.deque()  # appended by finalizers, any thread
        self._out = bytearray()  # framed releases the socket did not take yet
        self._closed = False

    @property
    def closed(self) -> bool:
        """The socket is closed or the worker went away: a new link is needed for a new arena."""
        return self._closed

    def try_open(self) -> bool:
        """Take the worker's offer if it has come (never blocks); whether the arena is mapped.
        Raises ArenaError for an offer that does not follow the protocol."""
        if self.id is not None or self._closed:
            return self.id is not None
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, 4096, 1)
        except BlockingIOError:
            return False
        except OSError as e:
            raise ArenaError(f"arena socket: {e}") from None
        try:
            if not data:
                raise ArenaError("the worker closed its arena socket before offering an arena")
            pid, uid = peer_credentials(self.sock)
            if uid != os.geteuid():
                raise ArenaError("the arena socket belongs to another user")
            if not same_network_namespace(pid):
                raise ArenaError("the worker is in another network namespace (another host, as far as arenas go)")
            messages = MessageReader().feed(data)
            if len(messages) != 1 or not isinstance(messages[0], M.ArenaOffer) or len(fds) != 1:
                raise ArenaError("expected one arena_offer with one descriptor")
            offer = messages[0]
            st = os.fstat(fds[0])
            if not stat.S_ISREG(st.st_mode) or st.st_size != offer.bytes:
                raise ArenaError(f"the offered arena is not a shared-memory file of {offer.bytes} bytes")
            self._map = mmap.mmap(fds[0], offer.bytes)
        finally:
            for fd in fds:
                os.close(fd)
        self.id, self.size = offer.arena, offer.bytes
        return True

    def frames(self, where: M.ArenaSlice, tensors: Sequence[M.TensorDesc]) -> list[memoryview]:
        """The frames of a batch lying at ``where``: views of the mapping, bounds checked.
        Raises ArenaError if the region is not inside the arena or cannot hold the tensors."""
        if self._map is None:
            raise ArenaError("a batch in an arena this client has not mapped")
        if where.offset + where.nbytes > self.size:
            raise ArenaError(f"region [{where.offset}, +{where.nbytes}) outside an arena of {self.size} bytes")
        sizes = [tensor_bytes(d) for d in tensors]
        starts, total = layout(sizes)
        if total > where.nbytes:
            raise ArenaError(f"{len(sizes)} tensors of {total} bytes in a region of {where.nbytes}")
        region = (ctypes.c_char * max(1, total)).from_buffer(self._map, where.offset)
        weakref.finalize(region, self._released.append, where.offset)
        view = memoryview(region).cast("B")
        return [view[s:s + n] for s, n in zip(starts, sizes)]

    def flush(self) -> None:
        """Send the releases queued so far (never blocks: what the socket does not take now
        goes with the next flush)."""
        if self._closed:
            return
        while self._released:
            offsets = []
            while self._released and len(offsets) < M.MAX_ARENA_RELEASES:
                offsets.append(self._released.popleft())
            self._out += frame(M.ArenaRelease(offsets=offsets))
        if not self._out:
            return
        try:
            sent = self.sock.send(self._out)
        except BlockingIOError:
            return
        except OSError:  # the worker is gone: its arena with it, nothing to release
            self._out.clear()
            self._closed = True
            return
        del self._out[:sent]

    def close(self) -> None:
        """Close the socket (the worker drops its side of the arena); views stay readable."""
        if not self._closed:
            self.flush()
        self._closed = True
        self.sock.close()
        self._map = None  # unmapped when the last view of it is gone


class ArenaLinks:
    """The loader's links to arenas, one per worker address, kept across epoch runs: an
    arena's pages, once written and mapped, serve every later epoch (a new arena per run
    would fault in fresh pages on both sides every time)."""

    def __init__(self) -> None:
        self._links: dict[str, ArenaLink] = {}

    def link(self, path: str) -> Optional[ArenaLink]:
        """The link to the arena socket at ``path`` (as the master named it), connected now if
        new; None if there is none here (a worker on another host, or one without arenas:
        its batches come as frames)."""
        link = self._links.get(path)
        if link is None or link.closed:
            try:
                check_arena_path(path)
                link = self._links[path] = ArenaLink(path)
            except (OSError, AddressError):
                self._links.pop(path, None)
                return None
        return link

    def drop(self, path: str) -> None:
        link = self._links.pop(path, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
