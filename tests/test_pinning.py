"""Pinned staging off the training thread (issue 26, part 3) and the ``device=`` prefetch.

On a machine without CUDA, the pinning primitive (``staging.alloc_pinned``) is replaced by
one that records its calls and returns ordinary CPU memory, and ``torch.cuda.is_available``
says yes: everything but the page-locking itself runs as it would (the staging thread,
slabs, their reuse and bound, errors, close). ``Tensor.pin_memory`` raises in these tests, so
any copy left on the training thread fails them. The CUDA tests at the end check real
pinning and the side-stream copy; they are skipped without CUDA.
"""
from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from remoteloader import RemoteDataLoader
from remoteloader.client import staging
from remoteloader.client.batch import Batch, KeyedJaggedTensor, batch_tensors, concat_rows
from tests.conftest import ROWS, spec_dict
from tests.test_end_to_end import assert_same, collect, read_reference

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
PIN_THREAD = "remoteloader-pin"


class FakePinning:
    """Stands in for page-locked allocations: CPU bytes, each call recorded with its thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self.fail: BaseException | None = None

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.calls.append((nbytes, threading.current_thread().name))
        if self.fail is not None:
            raise self.fail
        return torch.empty(nbytes, dtype=torch.uint8)


@pytest.fixture
def fake_pinning(monkeypatch):
    if CUDA:
        pytest.skip("mocks the accelerator: real CUDA is here (the CUDA tests cover it)")
    fake = FakePinning()
    monkeypatch.setattr(staging, "alloc_pinned", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def no_pinning_here(self, *args, **kwargs):
        raise AssertionError("Tensor.pin_memory called: a copy on the training thread")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning_here)
    return fake


def pin_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == PIN_THREAD]


def make_batch(rows: int = 64, seed: int = 0, dense: int = 8, keys: int = 3) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (keys * rows,), generator=g, dtype=torch.int32)
    n = int(lengths.sum())
    kjt = KeyedJaggedTensor([f"k{i}" for i in range(keys)], torch.randint(0, 1 << 40, (n,), generator=g),
                            lengths, torch.rand(n, generator=g), stride=rows, scored=[True] + [False] * (keys - 1))
    return Batch(torch.rand(rows, dense, generator=g), kjt, torch.rand(rows, generator=g),
                 {"row_id": torch.arange(rows) + seed * rows}, torch.rand(rows, generator=g),
                 torch.zeros(rows, dtype=torch.bool))


def tensors(b: Batch) -> list[torch.Tensor]:
    return batch_tensors(b)


class Job:
    """Stands for an ``assembly.Ready``: the rows a batch is made of, and its ticket."""

    def __init__(self, pieces: list[tuple[Batch, int, int]]) -> None:
        self.pieces, self.ticket = pieces, None


def stage(stager: staging.Stager, batch: Batch) -> staging.Ticket:
    """Queue ``batch`` (one whole piece) for staging."""
    return stager.submit(Job([(batch, 0, len(batch))]))


def batch_bytes(batch: Batch) -> int:
    return staging.size_class(sum(t.numel() * t.element_size() + staging.ALIGN for t in tensors(batch)))


def assert_equal(a: Batch, b: Batch) -> None:
    assert a.sparse_features.keys() == b.sparse_features.keys()
    assert a.sparse_features.stride() == b.sparse_features.stride()
    assert a.sparse_features.scored_keys() == b.sparse_features.scored_keys()
    assert list(a.passthrough) == list(b.passthrough)
    ta, tb = tensors(a), tensors(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def slab_range(pool: staging.SlabPool, t: torch.Tensor) -> tuple[int, int]:
    for s in pool.leased.values():
        if s.base.data_ptr() <= t.data_ptr() < s.base.data_ptr() + s.size:
            return s.base.data_ptr(), s.base.data_ptr() + s.size
    raise AssertionError("not in a leased slab")


def eventually(check, what: str, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


@pytest.fixture
def stagers():
    made: list[staging.Stager] = []

    def make(pool: staging.SlabPool, **kw) -> staging.Stager:
        made.append(staging.Stager(pool, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


# -- the stager and its pool --------------------------------------------------------------------------
def test_a_batch_arrives_pinned_copied_once_on_the_staging_thread(fake_pinning, stagers):
    pool = staging.SlabPool(8 << 20)
    stager = stagers(pool)
    source = make_batch()
    got = stager.take(stage(stager, source))
    assert_equal(got, source)
    assert all(pool.owns(t) for t in tensors(got))  # every tensor handed out lies in a slab
    src_ptrs = {t.data_ptr() for t in tensors(source)}
    assert not src_ptrs & {t.data_ptr() for t in tensors(got)}
    assert stager.stats.staged == 1 and stager.stats.copied_tensors == len(tensors(source))
    assert [name for _, name in fake_pinning.calls] == [PIN_THREAD]  # one slab, allocated off the training thread


def test_rows_merged_from_several_pieces_are_built_once_straight_into_a_slab(fake_pinning, stagers):
    pool = staging.SlabPool(8 << 20)
    stager = stagers(pool)
    a, b = make_batch(rows=40, seed=1), make_batch(rows=40, seed=2)
    got = stager.take(stager.submit(Job([(a, 10, 40), (b, 0, 30)])))  # a split's tail and the next one's head
    assert_equal(got, concat_rows([(a, 10, 40), (b, 0, 30)]))
    assert all(pool.owns(t) for t in tensors(got))
    assert stager.stats.staged == stager.stats.merged == 1  # one build, in the slab: no copy before it
    assert stager.stats.copied_tensors == len(tensors(got))


def test_empty_tensors_of_a_staged_batch_lie_in_its_slab(fake_pinning, stagers):
    # The epoch's short last batch can be one row without sparse ids (over a quarter of the
    # test tables' rows; which row comes last depends on arrival order): empty values and
    # scores, whose data_ptr() is 0. They view the slab like the others.
    pool = staging.SlabPool(8 << 20)
    stager = stagers(pool)
    source = make_batch(rows=1, seed=3)
    kjt = source.sparse_features
    source.sparse_features = KeyedJaggedTensor(kjt.keys(), kjt._values[:0], torch.zeros_like(kjt._lengths),
                                               kjt._weights[:0], stride=1, scored=kjt._scored)
    got = stager.take(stage(stager, source))
    assert_equal(got, source)
    assert [t.numel() for t in tensors(got)].count(0) == 2  # the values and their scores
    assert all(pool.owns(t) for t in tensors(got))
    assert not pool.owns(torch.empty(0, dtype=torch.int64))  # an empty tensor of no slab is not
    assert not pool.owns(source.dense_features)


def test_padding_pieces_are_staged_with_their_padding_also_merged_with_plain_rows(fake_pinning, stagers):
    stager = stagers(staging.SlabPool(8 << 20))
    source = make_batch()
    source.padding = None
    padded = source.as_padding()  # as the stream marks a padding split's pieces before they are routed
    got = stager.take(stage(stager, padded))
    assert got.padding is not None and bool(got.padding.all())
    assert torch.equal(got.dense_features, source.dense_features)
    mixed = stager.take(stager.submit(Job([(source, 0, 10), (padded, 0, 20)])))
    assert mixed.padding.tolist() == [False] * 10 + [True] * 20


def test_slabs_are_reused_after_release_and_never_while_a_view_is_alive(fake_pinning, stagers):
    pool = staging.SlabPool(8 << 20)
    stager = stagers(pool)
    first = stager.take(stage(stager, make_batch(seed=0)))
    view = first.dense_features[3:]  # the training loop keeps one view of the first batch
    kept = view.clone()
    lo, hi = slab_range(pool, view)
    del first
    gc.collect()
    for seed in range(1, 6):
        b = stager.take(stage(stager, make_batch(seed=seed)))
        assert not any(lo <= t.data_ptr() < hi for t in tensors(b)), "a slab reused while a view of it lives"
        del b
    assert torch.equal(view, kept)
    assert pool.stats.allocated == 2  # the viewed slab, and one slab reused by every later batch
    del view
    gc.collect()
    again = [stager.take(stage(stager, make_batch(seed=s))) for s in (6, 7)]  # both slabs free: no allocation
    assert pool.stats.allocated == 2 and pool.stats.reused >= 5
    assert {slab_range(pool, b.labels) for b in again} >= {(lo, hi)}


def test_the_pool_bound_holds_and_the_staging_thread_waits_for_a_release(fake_pinning, stagers):
    pool = staging.SlabPool(2 * batch_bytes(make_batch()))
    stager = stagers(pool)
    held = [stager.take(stage(stager, make_batch(seed=s))) for s in (0, 1)]  # the loop keeps two batches
    third = stage(stager, make_batch(seed=2))
    eventually(lambda: pool.waiting, "the staging thread waits for a slab")
    assert not third.done.is_set()
    assert pool.stats.allocated == 2 and pool.held_bytes <= pool.max_bytes and pool.stats.waits == 1
    del held[0]  # released: its slab takes the third batch
    got = stager.take(third)
    assert_equal(got, make_batch(seed=2))
    assert pool.stats.allocated == 2 and pool.stats.peak_bytes <= pool.max_bytes


def test_a_batch_dropped_before_its_turn_is_not_copied(fake_pinning, stagers):
    pool = staging.SlabPool(batch_bytes(make_batch()))
    stager = stagers(pool)
    held = stager.take(stage(stager, make_batch(seed=0)))
    blocked = stage(stager, make_batch(seed=1))
    eventually(lambda: pool.waiting, "the staging thread waits")
    duplicate = stage(stager, make_batch(seed=2))  # queued behind, then dropped (a duplicate piece)
    del duplicate
    del held
    assert_equal(stager.take(blocked), make_batch(seed=1))
    eventually(lambda: stager.stats.skipped == 1, "the dropped batch's job is skipped")
    assert stager.stats.staged == 2


def test_waiting_on_slabs_the_loop_itself_holds_ends_in_an_error_naming_pin_bytes(fake_pinning, stagers):
    stager = stagers(staging.SlabPool(batch_bytes(make_batch())), timeout=0.3)
    held = stager.take(stage(stager, make_batch(seed=0)))
    with pytest.raises(TimeoutError, match="pin_bytes"):
        stager.take(stage(stager, make_batch(seed=1)))
    del held


def test_a_batch_larger_than_the_pool_fails_in_the_training_thread(fake_pinning, stagers):
    stager = stagers(staging.SlabPool(staging.MIN_SLAB))
    with pytest.raises(RuntimeError, match="staging a batch into pinned memory failed") as err:
        stager.take(stage(stager, make_batch(rows=4096)))
    assert "pin_bytes" in str(err.value.__cause__)
    assert fake_pinning.calls == []


def test_an_error_in_staging_surfaces_in_the_training_thread_and_later_batches_still_come(fake_pinning, stagers):
    stager = stagers(staging.SlabPool(8 << 20))
    fake_pinning.fail = MemoryError("no page-locked memory left")
    with pytest.raises(RuntimeError, match="no page-locked memory left") as err:
        stager.take(stage(stager, make_batch(seed=0)))
    assert isinstance(err.value.__cause__, MemoryError)
    fake_pinning.fail = None
    assert_equal(stager.take(stage(stager, make_batch(seed=1))), make_batch(seed=1))


def test_a_failed_staging_thread_is_an_error_not_a_hang(fake_pinning, stagers, monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: (_ for _ in ()).throw(SystemError("bad device")))
    monkeypatch.setattr(staging, "_device_ready", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    stager = stagers(staging.SlabPool(8 << 20))
    with pytest.raises(RuntimeError, match="pinned-staging thread failed") as err:
        stager.take(stage(stager, make_batch()))
    assert isinstance(err.value.__cause__, SystemError)


def test_close_stops_the_staging_thread_even_while_it_waits(fake_pinning):
    pool = staging.SlabPool(batch_bytes(make_batch()))
    stager = staging.Stager(pool)
    held = stager.take(stage(stager, make_batch(seed=0)))
    pending = stage(stager, make_batch(seed=1))
    eventually(lambda: pool.waiting, "the staging thread waits for a slab")
    stager.close()
    assert not stager.alive
    with pytest.raises(staging.StagingClosed):
        stager.take(pending)
    del held
    pool.close()
    assert pool.held_bytes == 0  # the last slab, returned after close, is dropped


def test_reusing_a_size_class_s_last_free_slab_leaves_eviction_working(fake_pinning):
    # Issue 36: reusing a class's last free slab left an empty list under its key, and the
    # eviction loop popped from it (IndexError) at the next lease of another class.
    pool = staging.SlabPool(128 << 10)
    _, first = pool.lease(64 << 10, lambda: False)
    del first
    gc.collect()
    _, second = pool.lease(64 << 10, lambda: False)  # the 64 KiB class's only free slab, reused
    got: list = []
    thread = threading.Thread(target=lambda: got.append(pool.lease(128 << 10, lambda: False)))
    thread.start()
    eventually(lambda: pool.waiting, "the 128 KiB lease waits for the leased 64 KiB slab")
    del second  # returned: evicted to make room
    gc.collect()
    thread.join(10)
    assert got and got[0][1].nbytes == 128 << 10
    assert pool.stats.evicted == 1 and pool.held_bytes == 128 << 10 <= pool.max_bytes


def test_pool_pressure_over_several_size_classes_with_a_slow_consumer(fake_pinning, stagers):
    # Batches of four size classes through a pool that holds a few of them, a consumer that
    # keeps the last three batches: slabs are evicted and reused, every batch is exact.
    sizes = [40, 300, 1200, 90, 2500, 700, 60, 1900, 300, 2500] * 4
    pool = staging.SlabPool(4 * batch_bytes(make_batch(rows=2500)))
    stager = stagers(pool, timeout=30)
    held: list[Batch] = []
    jobs = [(seed, rows, stage(stager, make_batch(rows=rows, seed=seed))) for seed, rows in enumerate(sizes)]
    for seed, rows, ticket in jobs:
        got = stager.take(ticket)
        assert_equal(got, make_batch(rows=rows, seed=seed))
        held.append(got)
        if len(held) > 3:
            held.pop(0)
        assert pool.held_bytes <= pool.max_bytes
    assert pool.stats.evicted > 0 and pool.stats.reused > 0
    assert pool.stats.peak_bytes <= pool.max_bytes


class FakeEvent:
    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeDeviceCopy:
    """Stands in for ``staging.CudaCopy``: the "device" copy is a CPU clone, made on the
    staging thread; the hand-over is recorded."""

    made: list["FakeDeviceCopy"] = []

    def __init__(self, device: torch.device) -> None:
        self.device, self.copies, self.handed = device, 0, 0
        FakeDeviceCopy.made.append(self)

    def open(self) -> None:
        assert threading.current_thread().name == PIN_THREAD

    def start(self, pinned: Batch) -> tuple[Batch, FakeEvent]:
        self.copies += 1
        return concat_rows([(pinned, 0, len(pinned))]), FakeEvent()

    def hand_over(self, batch: Batch, event: FakeEvent) -> None:
        assert isinstance(event, FakeEvent)
        self.handed += 1


@pytest.fixture
def fake_device(fake_pinning, monkeypatch):
    FakeDeviceCopy.made = []
    monkeypatch.setattr(staging, "device_copier", FakeDeviceCopy)
    return FakeDeviceCopy.made


def test_device_copies_run_in_hand_out_order_so_the_awaited_batch_never_lacks_a_slot(fake_device, stagers):
    # Issue 36's hang: jobs queued in arrival order put two later whole pieces ahead of a
    # merged batch handed out first; they took both device slots, which free only when taken.
    stager = stagers(staging.SlabPool(8 << 20), device=torch.device("cuda", 0), timeout=5)
    a, b = make_batch(rows=64, seed=1), make_batch(rows=64, seed=2)
    merged = stager.submit(Job([(a, 10, 64), (b, 0, 20)]))  # the batch the loop takes first...
    later = [stage(stager, make_batch(seed=s)) for s in (3, 4, 5)]  # ...then these, more than DEVICE_AHEAD
    assert_equal(stager.take(merged), concat_rows([(a, 10, 64), (b, 0, 20)]))
    for s, ticket in zip((3, 4, 5), later):
        assert_equal(stager.take(ticket), make_batch(seed=s))
    copier = fake_device[0]
    assert copier.copies == copier.handed == 4 and stager.stats.device_copies == 4


@pytest.mark.parametrize("mode", ["device", "pinned"])
def test_merged_tails_many_pieces_padding_and_epochs_through_staging(tables, inprocess, fake_device, mode):
    # Many pieces per split and a tail in every split (900-row splits, batches of 128: seven
    # whole pieces and a 4-row tail), merged tails handed out between whole pieces, three
    # epochs on two ranks with padding, a pool small enough to evict and reuse.
    cluster = inprocess(workers=3)
    spec = spec_dict(tables["orc"], batch_size=128)
    kwargs = {"device": "cuda:0"} if mode == "device" else {"pin_memory": True}
    ranks = [cluster.loader(spec, rank=r, world_size=2, pin_bytes=1 << 20, timeout=30, **kwargs) for r in range(2)]
    for epoch in range(3):
        out: list[list] = [[], []]

        def read(r: int) -> None:
            for b in ranks[r]:
                keep = b.passthrough["row_id"] if b.padding is None else b.passthrough["row_id"][~b.padding]
                out[r].append(keep.tolist())

        threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), f"epoch {epoch}: a rank hung"
        assert len(out[0]) == len(out[1])  # equal batch counts
        rows = [row for batches in out for batch in batches for row in batch]
        assert sorted(rows) == list(range(ROWS)), f"epoch {epoch}: not every row exactly once"
    for loader in ranks:
        assert loader.pin_stats.merged > 0 and loader.pin_stats.staged == loader.pin_stats.taken
        if mode == "device":
            assert loader.pin_stats.device_copies == loader.pin_stats.taken
        loader.close()
    assert not pin_threads()


# -- the loader -------------------------------------------------------------------------------------
def test_pinned_epochs_equal_the_unpinned_path_each_row_once(tables, inprocess, fake_pinning):
    cluster = inprocess(workers=2)
    expected = read_reference(tables["orc"])
    spec = spec_dict(tables["orc"])  # 900-row splits in batches of 256: tails merged into batches
    loader = cluster.loader(spec, pin_memory=True, prefetch_bytes=8 << 20)
    assert loader.pin_pool is not None and loader.pin_pool.max_bytes == 8 << 20  # pin_bytes defaults to the window
    handed = 0
    for epoch in range(2):
        batches = []
        for b in loader:
            assert all(loader.pin_pool.owns(t) for t in tensors(b)), "a batch handed out unpinned"
            handed += len(tensors(b))
            batches.append(b)
        assert not pin_threads(), "the staging thread outlived its epoch"
        got, sizes = collect(batches)
        assert_same(got, expected)
        assert sizes[:-1] == [256] * (len(sizes) - 1) and sum(sizes) == ROWS
        del batches, b
    stats = loader.pin_stats
    assert stats.copied_tensors == handed  # each tensor handed out copied once, nothing else
    assert all(name == PIN_THREAD for _, name in fake_pinning.calls)
    assert loader.pin_pool.stats.allocated < stats.staged  # slabs reused
    assert loader.pin_pool.stats.peak_bytes <= loader.pin_pool.max_bytes
    plain, _ = collect(cluster.loader(spec))
    assert_same(plain, expected)


def test_padding_and_ranks_through_staging(tables, inprocess, fake_pinning):
    cluster = inprocess(workers=2)
    spec = spec_dict(tables["parquet"], batch_size=833, split_rows=700)  # 1,666 / 1,667 rows: 2 or 3 batches, padded
    ranks = [cluster.loader(spec, rank=r, world_size=3, pin_memory=True) for r in range(3)]
    out: list[list[Batch]] = [[] for _ in ranks]

    def read(r: int) -> None:
        out[r].extend(ranks[r])

    threads = [threading.Thread(target=read, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len({len(o) for o in out}) == 1  # equal batch counts
    rows, padded = [], 0
    for loader, batches in zip(ranks, out):
        for b in batches:
            assert all(loader.pin_pool.owns(t) for t in tensors(b))
            keep = b.passthrough["row_id"] if b.padding is None else b.passthrough["row_id"][~b.padding]
            padded += 0 if b.padding is None else int(b.padding.sum())
            rows += keep.tolist()
    assert sorted(rows) == list(range(ROWS)) and padded >= 1


def test_a_resumed_position_through_staging_is_exact(tables, inprocess, fake_pinning):
    cluster = inprocess(workers=1)
    spec = spec_dict(tables["orc"])  # 900-row splits in batches of 256: the position falls inside tails
    first = cluster.loader(spec, pin_memory=True)
    it = iter(first)
    seen = [next(it).passthrough["row_id"].clone() for _ in range(7)]
    state = first.state_dict()
    first.close()
    assert not pin_threads()
    again = cluster.loader(spec, pin_memory=True)
    again.load_state_dict(state)
    rest = [b.passthrough["row_id"].clone() for b in again]
    rows = torch.cat(seen + rest).tolist()
    assert sorted(rows) == list(range(ROWS))


def test_an_error_in_staging_reaches_the_training_loop_and_close_stops_the_thread(tables, inprocess, fake_pinning):
    cluster = inprocess(workers=1)
    loader = cluster.loader(spec_dict(tables["orc"]), pin_memory=True)
    it = iter(loader)
    next(it)
    assert pin_threads()
    fake_pinning.fail = MemoryError("pinned memory exhausted")
    with pytest.raises(RuntimeError, match="pinned memory exhausted"):
        for _ in it:
            pass
    assert not pin_threads()
    fake_pinning.fail = None
    it = iter(loader)  # a new epoch iterator: a new staging thread
    next(it)
    assert len(pin_threads()) == 1
    loader.close()
    assert not pin_threads()


def test_device_cpu_is_a_no_op_and_no_staging_without_pinning():
    for kwargs in ({"device": "cpu"}, {"device": torch.device("cpu")}, {}):
        loader = RemoteDataLoader({"table": {"path": "/nonexistent"}, "batch_size": 2,
                                   "features": {"label": "label", "dense": ["x"]}}, master="tcp://127.0.0.1:9",
                                  rank=0, world_size=1, **kwargs)
        assert loader.device is None and loader.pin_pool is None
        loader.close()


@pytest.mark.skipif(CUDA, reason="checks the error without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_a_cuda_device_without_cuda_is_an_error_naming_the_parameter(device):
    with pytest.raises(ValueError, match=r"device=.*CUDA is not available"):
        RemoteDataLoader({"table": {"path": "/nonexistent"}, "batch_size": 2,
                          "features": {"label": "label", "dense": ["x"]}}, master="tcp://127.0.0.1:9", device=device)


def test_an_unsupported_device_is_an_error_naming_the_parameter():
    with pytest.raises(ValueError, match=r"device='meta'"):
        staging.resolve_device("meta")
    with pytest.raises(ValueError, match=r"device='nonsense'"):
        staging.resolve_device("nonsense")


# -- real CUDA (skipped without it) -------------------------------------------------------------------
@needs_cuda
def test_cuda_batches_are_pinned_and_equal_the_unpinned_path(tables, inprocess):
    cluster = inprocess(workers=2)
    expected = read_reference(tables["orc"])
    loader = cluster.loader(spec_dict(tables["orc"]), pin_memory=True)
    batches = list(loader)
    for b in batches:
        assert all(t.is_pinned() for t in tensors(b))
        assert all(loader.pin_pool.owns(t) for t in tensors(b))
    got, _ = collect(batches)
    assert_same(got, expected)
    assert not pin_threads()


@needs_cuda
def test_cuda_device_batches_equal_the_host_path(tables, inprocess):
    cluster = inprocess(workers=2)
    expected = read_reference(tables["orc"])
    loader = cluster.loader(spec_dict(tables["orc"]), device="cuda")
    batches = []
    for b in loader:
        assert all(t.device.type == "cuda" for t in tensors(b))
        batches.append(b.to("cpu"))
    got, _ = collect(batches)
    assert_same(got, expected)
    assert loader.pin_stats.device_copies == len(batches)


@needs_cuda
def test_cuda_copy_on_the_side_stream_overlaps_the_current_stream():
    pool = staging.SlabPool(64 << 20)
    stager = staging.Stager(pool, torch.device("cuda"))
    try:
        source = make_batch(rows=4096)
        current = torch.cuda.current_stream()
        torch.cuda._sleep(2_000_000_000)  # the "model": a long kernel on the current stream
        busy_done = torch.cuda.Event()
        busy_done.record(current)
        staged = stage(stager, source)
        eventually(staged.done.is_set, "the staging thread issued the copy")
        staged.event.synchronize()  # the side stream's copy is done...
        assert not busy_done.query(), "the copy waited for the current stream"  # ...while the model still runs
        got = stager.take(staged)  # the current stream now waits for the copy's event
        assert all(t.device.type == "cuda" for t in tensors(got))
        torch.cuda.synchronize()
        assert_equal(got.to("cpu"), source)
    finally:
        stager.close()
        pool.close()
