"""Shared-memory arenas (issue 36, one copy from the worker to the batch): a worker on the
client's host writes batches into a memfd the client maps, and the training loop's tensors
view that mapping. The region allocator, the arena socket, the client's bounds checks and
releases, and the embedded default end to end (every row once, with arenas, without them,
and with an arena too small for what the training loop holds)."""
from __future__ import annotations

import gc
import os
import socket

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from remoteloader import RemoteDataLoader
from remoteloader.client import fetch
from remoteloader.client.arena import ArenaLink
from remoteloader.protocol import messages as M
from remoteloader.protocol.address import make_ipc_directory
from remoteloader.protocol.arena import ENV_ARENA, PAGE, ArenaError, frame, layout
from remoteloader.worker.arena import ArenaServer, RegionAllocator
from remoteloader.protocol import auth
from remoteloader.protocol.address import AddressError
from remoteloader.protocol.arena import check_arena_path, same_network_namespace
from tests.conftest import ROWS, spec_dict

pytestmark = pytest.mark.arenas  # conftest keeps other tests on the data socket


# -- the region allocator ---------------------------------------------------------------------------------
def test_regions_are_page_aligned_first_fit_and_merge_when_released():
    regions = RegionAllocator(8 * PAGE)
    a, b, c = regions.allocate(1), regions.allocate(PAGE + 1), regions.allocate(PAGE)
    assert (a, b, c) == (0, PAGE, 3 * PAGE) and regions.used == 4 * PAGE
    assert regions.allocate(5 * PAGE) is None  # 4 pages free
    assert regions.release(b) and not regions.release(b) and not regions.release(12345)
    assert regions.allocate(2 * PAGE) == PAGE  # the hole b left, first
    regions.release(PAGE)
    regions.release(a)
    regions.release(c)
    assert regions.used == 0 and regions.allocate(8 * PAGE) == 0  # every range merged back into one


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * PAGE)), max_size=80))
def test_regions_never_overlap_and_all_come_back(ops):
    regions, live = RegionAllocator(32 * PAGE), {}
    for release, size in ops:
        if release and live:
            start = sorted(live)[size % len(live)]
            assert regions.release(start)
            del live[start]
            continue
        start = regions.allocate(size)
        if start is None:
            assert regions.size - regions.used < size or True  # fragmentation may refuse it
            continue
        end = start + -(-size // PAGE) * PAGE
        assert start % PAGE == 0 and end <= regions.size
        assert all(end <= s or start >= e for s, e in live.items()), (start, end, live)
        live[start] = end
    assert regions.used == sum(e - s for s, e in live.items())
    for start in list(live):
        regions.release(start)
    assert regions.allocate(32 * PAGE) == 0


# -- the arena socket, in one process ---------------------------------------------------------------------
@pytest.fixture
def server():
    directory = make_ipc_directory()
    srv = ArenaServer(os.path.join(directory, "worker-x.arena"), 64 * PAGE)
    yield srv
    srv.close()
    os.rmdir(directory)


def _linked(server: ArenaServer) -> ArenaLink:
    link = ArenaLink(server.path)
    server.on_ready(server.listener.fileno())  # the pusher's poll would do this
    assert link.try_open() and link.size == 64 * PAGE
    return link


def _descs(arrays: dict) -> list:
    return [M.TensorDesc(k, a.dtype.name, list(a.shape)) for k, a in arrays.items()]


def test_a_batch_written_into_the_arena_is_viewed_in_place_and_released_when_its_last_view_goes(server):
    link = _linked(server)
    arena = server.arena(link.id)
    arrays = {"dense": np.arange(12, dtype=np.float32).reshape(4, 3), "sparse.values": np.arange(7, dtype=np.int64),
              "labels": np.ones(4, np.float32)}
    where = arena.place(list(arrays.values()))
    assert where.offset == 0 and arena.regions.used == PAGE
    frames = link.frames(where, _descs(arrays))
    views = [np.frombuffer(f, a.dtype).reshape(a.shape) for f, a in zip(frames, arrays.values())]
    for view, a in zip(views, arrays.values()):
        np.testing.assert_array_equal(view, a)
    import torch
    kept = torch.from_numpy(views[1][2:5])  # a tensor of a view of a view: it alone keeps the region
    del frames, views, view
    gc.collect()
    link.flush()
    server.on_ready(next(iter(server._conns)))
    assert arena.regions.used == PAGE  # still viewed
    values = kept.tolist()  # (not inside an assert: pytest's rewriting would keep a reference)
    assert values == [2, 3, 4]
    del kept
    link.flush()
    server.on_ready(next(iter(server._conns)))
    assert arena.regions.used == 0
    link.close()


def test_regions_outside_the_arena_or_too_small_for_the_tensors_are_refused(server):
    link = _linked(server)
    descs = [M.TensorDesc("labels", "float32", [100])]
    with pytest.raises(ArenaError, match="outside an arena"):
        link.frames(M.ArenaSlice(63 * PAGE, 2 * PAGE), descs)
    with pytest.raises(ArenaError, match="in a region of"):
        link.frames(M.ArenaSlice(0, 399), descs)
    assert layout([400, 1])[1] == 449  # the second tensor starts at 448 (64-byte aligned)
    link.close()


def test_a_closed_connection_takes_its_arena_and_the_client_keeps_reading(server):
    link = _linked(server)
    arena = server.arena(link.id)
    data = np.arange(1000, dtype=np.int64)
    view = np.frombuffer(link.frames(arena.place([data]), [M.TensorDesc("x", "int64", [1000])])[0], np.int64)
    link.close()
    server.on_ready(next(iter(server._conns)))  # the worker sees the close
    assert server.arena(link.id) is None and not server._conns
    np.testing.assert_array_equal(view, data)  # the client's mapping lives while viewed


def test_an_offer_that_is_not_a_shared_memory_file_of_its_size_is_refused(tmp_path):
    directory = make_ipc_directory()
    path = os.path.join(directory, "fake.arena")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        for fd_kind in ("pipe", "wrong size"):
            link = ArenaLink(path)
            conn, _ = listener.accept()
            if fd_kind == "pipe":
                r, w = os.pipe()
                fds = [r, w]
                sent = [r]
            else:
                f = tmp_path / "small"
                f.write_bytes(b"x" * 10)
                fds = [os.open(f, os.O_RDWR)]
                sent = fds
            socket.send_fds(conn, [frame(M.ArenaOffer(arena="a", bytes=1 << 20))], sent)
            with pytest.raises(ArenaError, match="not a shared-memory file"):
                while not link.try_open():
                    pass
            for fd in fds:
                os.close(fd)
            conn.close()
            link.close()
    finally:
        listener.close()
        os.unlink(path)
        os.rmdir(directory)


# -- end to end ----------------------------------------------------------------------------------------------
@pytest.fixture
def fetchers(monkeypatch):
    """Every WorkerFetcher made in this test, to read how its batch messages came."""
    made = []
    original = fetch.WorkerFetcher.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(fetch.WorkerFetcher, "__init__", record)
    monkeypatch.setenv("REMOTELOADER_QUIET", "1")
    monkeypatch.delenv("REMOTELOADER_AUTH", raising=False)
    return made


def _row_ids(batches) -> list:
    return [r for b in batches for r in b.passthrough["row_id"].tolist()]


@pytest.mark.slow
@pytest.mark.parametrize("arenas", ["on", "off"])
def test_the_embedded_default_delivers_every_row_once_through_arenas_or_frames(tables, fetchers, monkeypatch, arenas):
    monkeypatch.setenv(ENV_ARENA, arenas)
    with RemoteDataLoader(spec_dict(tables["orc"]), num_workers=2, timeout=60) as loader:
        for _ in range(2):
            seen = []
            for b in loader:
                seen.extend(b.passthrough["row_id"].tolist())
            assert len(seen) == len(set(seen)) == ROWS
    arena_messages = sum(f.arena_messages for f in fetchers)
    if arenas == "on":
        assert arena_messages > 0
    else:
        assert arena_messages == 0 and sum(f.frame_messages for f in fetchers) > 0


@pytest.mark.slow
def test_a_training_loop_holding_every_batch_overflows_the_arena_into_frames_and_loses_nothing(tables, fetchers,
                                                                                             monkeypatch):
    # An arena of 16 pages: the first batches fill it and stay held (the loop keeps them all);
    # the rest come as frames. Then, held batches dropped, their regions are written again.
    monkeypatch.setenv("REMOTELOADER_ARENA_BYTES", "64K")  # the embedded master's workers inherit it
    with RemoteDataLoader(spec_dict(tables["orc"]), num_workers=1, timeout=60) as loader:
        held = list(loader)
        ids = _row_ids(held)
        assert len(ids) == len(set(ids)) == ROWS
        first = fetchers[-1]
        assert first.arena_messages > 0 and first.frame_messages > 0
        del held
        gc.collect()
        again = list(loader)
        assert sorted(_row_ids(again)) == sorted(ids)
        assert fetchers[-1].arena_messages > 0


# -- workers on a tcp socket, and what makes a worker local ---------------------------------------------
def test_arena_socket_paths_a_master_names_are_checked(tmp_path):
    private = make_ipc_directory()
    try:
        check_arena_path(os.path.join(private, "worker.arena"))  # does not raise
        for bad in ("relative/worker.arena", os.path.join(private, "worker.sock"),
                    os.path.join(private, "..", "x.arena"), "/tmp/worker.arena"):  # /tmp: not a private directory
            with pytest.raises(AddressError):
                check_arena_path(bad)
        os.chmod(private, 0o755)  # others may enter: not private any more
        with pytest.raises(AddressError, match="mode"):
            check_arena_path(os.path.join(private, "worker.arena"))
    finally:
        os.rmdir(private)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a network namespace")
def test_a_process_in_another_network_namespace_is_not_on_this_host():
    import subprocess

    assert same_network_namespace(os.getpid())
    other = subprocess.Popen(["unshare", "--net", "sleep", "30"])
    try:
        deadline = 100
        while deadline and os.readlink(f"/proc/{other.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            deadline -= 1  # unshare has not switched yet
            __import__("time").sleep(0.05)
        assert not same_network_namespace(other.pid)
        assert not same_network_namespace(2 ** 22 + 12345)  # no such process: not local
    finally:
        other.kill()
        other.wait()


@pytest.mark.slow
def test_tcp_workers_on_this_host_hand_batches_over_in_arenas_through_a_resume(tables, inprocess, fetchers):
    master = inprocess(2)
    arena_dirs = [os.path.dirname(w.worker.arenas.path) for w in master.workers]
    assert all(os.path.isdir(d) for d in arena_dirs)  # private directories of their own (tcp data sockets)
    spec = spec_dict(tables["orc"], batch_size=100, shuffle=True)
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(15)]
        state = loader.state_dict()
    with RemoteDataLoader(spec, master=master.addr, timeout=60) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    ids = _row_ids(first) + _row_ids(rest)
    assert sorted(ids) == list(range(ROWS))
    assert sum(f.arena_messages for f in fetchers) > 0
    master.stop()
    assert not any(os.path.exists(d) for d in arena_dirs)  # removed with the workers


@pytest.mark.slow
def test_with_cluster_keys_an_arena_batch_header_is_sealed_and_checked(tables, fetchers, tmp_path):
    from tests.test_sealed_frames import KeyedCluster

    cluster = KeyedCluster(str(auth.keygen(tmp_path / "keys")))
    try:
        with RemoteDataLoader(spec_dict(tables["orc"]), master=cluster.addr, auth=cluster.creds.directory,
                              timeout=60) as loader:
            ids = [r for b in loader for r in b.passthrough["row_id"].tolist()]
        assert sorted(ids) == list(range(ROWS))
        assert sum(f.arena_messages for f in fetchers) > 0 and not any(f.refused for f in fetchers)
    finally:
        cluster.stop()
