"""The split processor through the block cache, in process: every piece byte-identical to
the uncached path, whatever was cached, corrupted, changed or taken away."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from remoteloader.core.binding import bind
from remoteloader.core.cache.job import JobCache
from remoteloader.core.cache.segments import BlockSigner
from remoteloader.core.cache.store import BlockStore
from remoteloader.core.cache.writer import BlockWriter
from remoteloader.core.plan import make_task, plan_epoch
from remoteloader.core.processor import SplitProcessor
from remoteloader.core.sampling import plan_job_splits
from remoteloader.protocol.messages import CacheDirective
from remoteloader.spec import DatasetSpec
from tests.conftest import spec_dict

WORLD = 2


def job(table: Path, **overrides):
    spec = DatasetSpec.from_dict(spec_dict(table, shuffle=True, seed=3, **overrides))
    bound = bind(spec)
    return bound, plan_job_splits(bound)


def everything(bound, write: bool = True) -> CacheDirective:
    features = bound.pipeline.feature_names
    return CacheDirective(features=features, sources=[], write_features=features if write else [], write_sources=[])


def tasks(bound, base, epoch: int, directive=None, rank=None):
    spec = bound.spec
    for s in plan_epoch(base, epoch, spec.seed, spec.shuffle, WORLD, spec.batch_size, spec.drop_last, spec.even_batches):
        if rank is None or s.rank == rank:
            yield make_task(bound.files, base[s.base], s, epoch, cache=directive)


def produce(processor: SplitProcessor, all_tasks) -> list[tuple[int, int, dict]]:
    """Every piece as (split, index, {tensor name: bytes with dtype and shape})."""
    return [(p.split_id, p.index, {k: (a.dtype.str, a.shape, a.tobytes()) for k, a in p.arrays.items()})
            for task in all_tasks for p in processor.pieces(task)]


class Cache:
    """A store on disk with its writer; ``processor`` makes a job's processor through it."""

    def __init__(self, root: Path, signer: BlockSigner = BlockSigner.plain()) -> None:
        self.store = BlockStore(str(root), signer)
        self.writer = BlockWriter(self.store)

    def processor(self, bound) -> SplitProcessor:
        return SplitProcessor(bound, cache=JobCache(self.store, self.writer, bound))

    def flush(self) -> None:
        assert self.writer.flush(30.0)

    def close(self) -> None:
        self.writer.close(5.0)
        self.store.close()


@pytest.fixture
def cache(tmp_path):
    c = Cache(tmp_path / "cache")
    yield c
    c.close()


@pytest.mark.parametrize("sampling", [None, {"rate": 0.5, "seed": 1, "weight": True}])
def test_cached_pieces_equal_computed_ones_in_later_epochs_and_read_no_table(tables, cache, sampling):
    bound, base = job(tables["orc"], **({"sampling": sampling} if sampling else {}))
    expected = {e: produce(SplitProcessor(bound), tasks(bound, base, e)) for e in (0, 1)}
    writing = cache.processor(bound)
    assert produce(writing, tasks(bound, base, 0, everything(bound))) == expected[0]
    cache.flush()
    assert cache.store.counters.puts > 0
    reading = cache.processor(bound)
    assert produce(reading, tasks(bound, base, 1, everything(bound, write=False))) == expected[1]
    assert reading.io.bytes_requested == 0  # every feature, the label and passthrough came from the cache
    assert cache.store.counters.hits > 0


def test_a_changed_parameter_misses_for_that_feature_only(tables, cache):
    bound, base = job(tables["orc"])
    produce(cache.processor(bound), tasks(bound, base, 0, everything(bound)))
    cache.flush()
    changed = spec_dict(tables["orc"], shuffle=True, seed=3)
    changed["features"]["sparse"][1]["transforms"][0]["salt"] = 6  # s1's sigrid_hash salt
    bound2, base2 = job(tables["orc"], features=changed["features"])
    misses = cache.store.counters.misses
    second = cache.processor(bound2)
    assert produce(second, tasks(bound2, base2, 0, everything(bound2, write=False))) == \
        produce(SplitProcessor(bound2), tasks(bound2, base2, 0))
    assert cache.store.counters.misses - misses == len(base2)  # one block a split: s1's
    # Only the column of the missing feature was read from the table.
    assert set(second.costs.to_record("").columns[i].name for i in range(len(second.costs.to_record("").columns))) \
        == {"idlist_1"}


def test_a_flipped_byte_changes_no_piece_and_is_counted(tables, cache, tmp_path):
    bound, base = job(tables["orc"])
    produce(cache.processor(bound), tasks(bound, base, 0, everything(bound)))
    cache.flush()
    segments = sorted((tmp_path / "cache").rglob("*.seg"))
    assert segments
    rng = np.random.default_rng(0)
    for seg in segments:
        data = bytearray(seg.read_bytes())
        data[int(rng.integers(0, len(data) // 2))] ^= 0x40  # inside the blocks' data
        seg.write_bytes(bytes(data))
    reading = cache.processor(bound)
    assert produce(reading, tasks(bound, base, 1, everything(bound, write=False))) == \
        produce(SplitProcessor(bound), tasks(bound, base, 1))
    assert cache.store.counters.corrupt >= len(segments)


def test_parts_of_a_split_are_exact_and_the_first_part_caches_the_whole_split(tables, cache):
    """A split cut between ranks: a later part computes its rows alone (nothing to put), the
    first part computes the whole split in stored order and puts it, later parts gather from it."""
    bound, base = job(tables["orc"])
    directive = everything(bound)
    whole = [t for t in tasks(bound, base, 0)]
    firsts = [_part(t, 0, t.base_rows // 3, directive) for t in whole]
    lasts = [_part(t, t.base_rows // 3, t.base_rows, directive) for t in whole]
    uncached = SplitProcessor(bound)
    expected_lasts = produce(uncached, lasts)
    cached = cache.processor(bound)
    assert produce(cached, lasts) == expected_lasts
    cache.flush()
    assert cache.store.counters.puts == 0
    assert produce(cached, firsts) == produce(uncached, firsts)
    cache.flush()
    assert cache.store.counters.puts == len(whole)
    reading = cache.processor(bound)
    assert produce(reading, lasts) == expected_lasts
    assert reading.io.bytes_requested == 0


def test_a_keyed_cache_refuses_blocks_written_without_the_key(tables, tmp_path):
    bound, base = job(tables["orc"])
    plain = Cache(tmp_path / "shared")
    produce(plain.processor(bound), tasks(bound, base, 0, everything(bound)))
    plain.flush()
    plain.close()
    keyed = Cache(tmp_path / "shared", BlockSigner.keyed(b"cluster secret"))
    try:
        reading = keyed.processor(bound)
        assert produce(reading, tasks(bound, base, 1, everything(bound, write=False))) == \
            produce(SplitProcessor(bound), tasks(bound, base, 1))
        assert keyed.store.counters.hits == 0 and keyed.store.counters.corrupt > 0
    finally:
        keyed.close()


def _part(task, lo: int, hi: int, directive):
    """Rows [lo, hi) of the task's epoch split (of its base split's shuffled order)."""
    return replace(task, row_lo=task.row_lo + lo, row_hi=task.row_lo + hi, cache=directive)


@pytest.mark.parametrize("mixed", [False, True])
def test_local_dataset_uses_the_same_cache_path(tables, tmp_path, mixed):
    from remoteloader import LocalDataset

    cached_spec = {"cache": {"mode": "auto", "expected_epochs": 2}}
    spec = renaming_mix(tables, **cached_spec) if mixed else spec_dict(tables["orc"], shuffle=True, seed=3,
                                                                        **cached_spec)
    plain = LocalDataset(dict(spec, cache={"mode": "off"}))
    cached = LocalDataset(spec, cache=str(tmp_path / "local-cache"))
    for epoch in (0, 1):
        plain.set_epoch(epoch)
        cached.set_epoch(epoch)
        assert [_batch_bytes(b) for b in cached] == [_batch_bytes(b) for b in plain]
        assert list((tmp_path / "local-cache").rglob("*.seg"))  # auto with 2 expected epochs writes


def _batch_bytes(batch) -> tuple:
    return (batch.dense_features.numpy().tobytes(), batch.labels.numpy().tobytes(),
            batch.sparse_features.values().numpy().tobytes(), batch.sparse_features.lengths().numpy().tobytes(),
            {k: v.numpy().tobytes() for k, v in batch.passthrough.items()})


def renaming_mix(tables, **overrides) -> dict:
    """The ORC table at weight 3 and the Parquet one at 1, which gives the job's float_1 and
    idlist_1 from its float_2 and idlist_2."""
    spec = spec_dict(tables["orc"], shuffle=True, seed=3, **overrides)
    del spec["table"]
    spec["tables"] = [{"path": str(tables["orc"]), "weight": 3},
                      {"path": str(tables["parquet"]), "weight": 1, "columns": {"float_1": "float_2",
                                                                                "idlist_1": "idlist_2"}}]
    return spec


def test_a_mix_caches_each_tables_blocks_under_its_stored_columns_shared_with_a_job_of_that_table(tables, cache):
    """A mix whose second table gives the job's float_1 and idlist_1 from its float_2 and
    idlist_2: its second epoch reads every block (no table byte) and is byte-identical; a job
    of that table alone reading float_2 and idlist_2 finds the same blocks, and one reading its
    float_1 and idlist_1 is not served them."""
    from remoteloader.core.mix import plan_mixed_epoch

    bound = bind(DatasetSpec.from_dict(renaming_mix(tables)))
    base = plan_job_splits(bound)

    def mixed_tasks(epoch: int, directive=None):
        plans = plan_mixed_epoch(base, [bound.file_tables[b.file] for b in base], (3, 1), ("drop", "drop"), epoch,
                                 3, True, WORLD, bound.spec.batch_size, bound.spec.even_batches)
        for rank in sorted(plans):
            for s in plans[rank].splits:
                yield make_task(bound.files, base[s.base], s, epoch, cache=directive)

    expected = {e: produce(SplitProcessor(bound), mixed_tasks(e)) for e in (0, 1)}
    assert produce(cache.processor(bound), mixed_tasks(0, everything(bound))) == expected[0]
    cache.flush()
    reading = cache.processor(bound)
    assert produce(reading, mixed_tasks(1, everything(bound, write=False))) == expected[1]
    assert reading.io.bytes_requested == 0 and cache.store.counters.hits > 0

    alone = spec_dict(tables["parquet"], shuffle=True, seed=3)
    alone["features"]["dense"][1]["column"] = "float_2"
    alone["features"]["sparse"][1]["column"] = "idlist_2"
    single, single_base = job(tables["parquet"], features=alone["features"])
    plain = produce(SplitProcessor(single), tasks(single, single_base, 2))
    shared = cache.processor(single)
    assert produce(shared, tasks(single, single_base, 2, everything(single, write=False))) == plain
    assert shared.io.bytes_requested == 0  # the mix's blocks of the table, under its own column names
    # The table's own float_1 and idlist_1 are other columns: a job reading them is not served the mix's blocks.
    other, other_base = job(tables["parquet"])
    assert produce(cache.processor(other), tasks(other, other_base, 2, everything(other, write=False))) == \
           produce(SplitProcessor(other), tasks(other, other_base, 2))


@pytest.mark.parametrize("cached", [False, True])
def test_a_task_naming_a_table_the_mix_does_not_have_is_refused_naming_the_split(tables, cache, cached):
    """A split task of a mix names its table by index: one past the mix's tables fails the
    split with an error naming it (not an IndexError out of the reader or the cache)."""
    from remoteloader.core.plan import EpochSplit
    from remoteloader.formats import TableError

    bound = bind(DatasetSpec.from_dict(renaming_mix(tables)))
    base = plan_job_splits(bound)
    task = make_task(bound.files, base[0], EpochSplit(0, 0, 0, 0, base[0].rows, table=(2, 0)), 0,
                     cache=everything(bound) if cached else None)
    processor = cache.processor(bound) if cached else SplitProcessor(bound)
    with pytest.raises(TableError, match=r"split 0 .*: table 2 of a mix of 2 tables"):
        list(processor.pieces(task))
