"""LocalDataset under DDP with DataLoader workers: every rank yields exactly ``len()``
batches, the same on all ranks, each selected row exactly once (issue 22, defect 10)."""
from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DataLoader

from remoteloader import LocalDataset
from remoteloader.core.plan import rank_shares
from remoteloader.tools.datagen import generate_table

from tests.conftest import spec_dict

WORLD = 4
BATCH = 64
# 4 ranks x 11 rounds of 64, plus 2: the last round has fewer rows than ranks, so
# even_batches has to pad (or drop) and every split of ~200 rows ends in a tail.
ROWS = WORLD * 11 * BATCH + 2


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    path = tmp_path_factory.mktemp("local_ddp") / "t"
    generate_table(str(path), rows=ROWS, partitions=1, dense=2, sparse=2, format="parquet", seed=3,
                   row_group_rows=100, files_per_partition=2, progress=False)
    return path


def run_epochs(spec: dict, num_workers: int, epochs: int) -> list[list[list[tuple[np.ndarray, np.ndarray]]]]:
    """Per epoch, per rank: each batch's row ids and padding flags."""
    out = [[[] for _ in range(WORLD)] for _ in range(epochs)]
    for rank in range(WORLD):
        dataset = LocalDataset(spec, rank=rank, world_size=WORLD)
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers,
                            persistent_workers=num_workers > 0)
        for epoch in range(epochs):
            dataset.set_epoch(epoch)
            for batch in loader:
                pad = np.zeros(len(batch), bool) if batch.padding is None else batch.padding.numpy()
                out[epoch][rank].append((batch.passthrough["row_id"].numpy(), pad))
        assert all(len(out[e][rank]) == len(dataset) for e in range(epochs)), \
            (rank, len(dataset), [len(out[e][rank]) for e in range(epochs)])
        del loader
    return out


def check(spec: dict, runs: list, equal: bool = True) -> None:
    shares = rank_shares(ROWS, WORLD, BATCH, spec.get("drop_last", False), spec.get("even_batches", "pad"))
    for ranks in runs:
        counts = [len(batches) for batches in ranks]
        assert not equal or len(set(counts)) == 1, counts
        for batches in ranks:
            short = sum(len(ids) < BATCH for ids, _ in batches)
            assert short == (0 if spec.get("drop_last") else int(sum(len(ids) for ids, _ in batches) % BATCH > 0))
        ids = np.concatenate([ids[~pad] for batches in ranks for ids, pad in batches])
        assert len(ids) == ROWS - shares.dropped
        assert len(np.unique(ids)) == len(ids)
        padded = sum(int(pad.sum()) for batches in ranks for _, pad in batches)
        assert padded == sum(shares.padding)


# 3 DataLoader workers on a small CI machine: torch warns about oversubscription, which is the point here.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_equal_counts_equal_len_with_dataloader_workers(table, num_workers):
    spec = spec_dict(table, batch_size=BATCH, split_rows=250, shuffle=True)
    shares = rank_shares(ROWS, WORLD, BATCH, even="pad")
    assert any(shares.padding)  # the case under test: a padded last round
    runs = run_epochs(spec, num_workers, epochs=10)
    check(spec, runs)
    assert sorted(np.concatenate([ids for ids, _ in runs[0][0]]).tolist()) \
        != sorted(np.concatenate([ids for ids, _ in runs[1][0]]).tolist())  # set_epoch reached the workers


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{"even_batches": "drop"}, {"drop_last": True}, {"even_batches": "off"}])
def test_drop_modes_with_dataloader_workers(table, overrides):
    spec = spec_dict(table, batch_size=BATCH, split_rows=250, shuffle=True, **overrides)
    check(spec, run_epochs(spec, num_workers=2, epochs=2), equal=overrides.get("even_batches") != "off")
