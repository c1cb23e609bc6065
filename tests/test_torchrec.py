"""torchrec-native batches: ``Batch.to_torchrec()`` and training through torchrec's ``TrainPipelineBase``.

Needs the ``torchrec`` extra (``make install`` sets it up; see the Makefile for the CPU-only set).
"""
from __future__ import annotations

import math
import warnings

import pyarrow.parquet as pq
import pytest
import torch

torchrec = pytest.importorskip("torchrec")

from torchrec.distributed.train_pipeline import TrainPipelineBase  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchrecKJT  # noqa: E402
from torchrec.streamable import Pipelineable  # noqa: E402

from remoteloader import RemoteDataLoader  # noqa: E402
from remoteloader.client import TorchrecBatch  # noqa: E402
from remoteloader.client.batch import Batch, KeyedJaggedTensor, concat_rows  # noqa: E402
from remoteloader.tools.datagen import generate_table  # noqa: E402

from tests.conftest import spec_dict  # noqa: E402

F32 = torch.float32


def mixed_batch(scored=(False, True, False)) -> Batch:
    """Keys a, b, c over 2 rows; only b is an id-score feature (a and c carry weight 1.0 on the wire).
    a: [1, 2], [3]   b: [10] (0.5), [11, 12] (0.25, 0.75)   c: [], [7]"""
    tensors = {
        "dense": torch.tensor([[0.5, 1.0], [2.0, 3.0]]),
        "labels": torch.tensor([0.0, 1.0]),
        "sparse.values": torch.tensor([1, 2, 3, 10, 11, 12, 7]),
        "sparse.lengths": torch.tensor([2, 1, 1, 2, 0, 1], dtype=torch.int32),
        "sparse.weights": torch.tensor([1.0, 1.0, 1.0, 0.5, 0.25, 0.75, 1.0]),
        "pt.row_id": torch.tensor([100, 101]),
        "weights": torch.tensor([2.0, 2.0]),
    }
    return Batch.from_tensors(tensors, ["a", "b", "c"], scored)


def check_split(tb: TorchrecBatch) -> None:
    assert isinstance(tb.sparse_features, TorchrecKJT)
    assert tb.sparse_features.keys() == ["a", "c"]
    assert tb.sparse_features.weights_or_none() is None
    assert tb.sparse_features.values().tolist() == [1, 2, 3, 7]
    assert tb.sparse_features.lengths().tolist() == [2, 1, 0, 1]
    assert tb.sparse_features.offset_per_key() == [0, 3, 4]
    assert tb.sparse_features["c"].values().tolist() == [7]
    scored = tb.id_score_list_features
    assert isinstance(scored, TorchrecKJT)
    assert scored.keys() == ["b"]
    assert scored.values().tolist() == [10, 11, 12]
    assert scored.lengths().tolist() == [1, 2]
    assert scored.weights().tolist() == [0.5, 0.25, 0.75]
    assert tb.dense_features.tolist() == [[0.5, 1.0], [2.0, 3.0]]
    assert tb.labels.tolist() == [0.0, 1.0]
    assert tb.weights.tolist() == [2.0, 2.0]
    assert tb.passthrough["row_id"].tolist() == [100, 101]


def test_to_torchrec_splits_id_list_from_id_score_features():
    b = mixed_batch()
    assert b.sparse_features.scored_keys() == ["b"]
    check_split(b.to_torchrec())
    # The flags survive the loader's own plumbing: to(), pin-free copies, row concatenation.
    check_split(b.to("cpu").to_torchrec())
    check_split(concat_rows([(b, 0, 1), (b, 1, 2)]).to_torchrec())
    # Said by the caller instead of the sender.
    check_split(mixed_batch(scored=None).to_torchrec(id_score_keys=["b"]))


def test_to_torchrec_without_flags_detects_scored_keys_by_their_weights():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_split(mixed_batch(scored=None).to_torchrec())
    assert mixed_batch(scored=None).sparse_features.scored_keys() is None
    # (the warning is given once per process; only check that nothing else is raised)
    assert all(issubclass(w.category, RuntimeWarning) for w in caught)


def test_to_torchrec_unscored_and_all_scored_batches():
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1, 1], dtype=torch.int32),
                            stride=2, scored=[False, False])
    tb = Batch(torch.zeros(2, 1), kjt, torch.zeros(2)).to_torchrec()
    assert tb.id_score_list_features is None
    assert tb.sparse_features.keys() == ["a", "b"] and tb.sparse_features.weights_or_none() is None
    assert tb.sparse_features.values().tolist() == [1, 2, 3]

    b = mixed_batch()
    everything = b.to_torchrec(id_score_keys=["a", "b", "c"])
    assert everything.sparse_features.keys() == [] and everything.sparse_features.stride() == 2
    assert everything.id_score_list_features.weights().tolist() == b.sparse_features.weights().tolist()
    nothing = b.to_torchrec(id_score_keys=[])
    assert nothing.id_score_list_features is None and nothing.sparse_features.weights_or_none() is None
    with pytest.raises(KeyError, match="zz"):
        b.to_torchrec(id_score_keys=["zz"])
    with pytest.raises(ValueError, match="no weights"):
        Batch(torch.zeros(2, 1), kjt, torch.zeros(2)).to_torchrec(id_score_keys=["a"])
    with pytest.raises(ValueError, match="scored flags"):
        KeyedJaggedTensor(["a"], torch.tensor([1]), torch.tensor([1]), scored=[True, False])


def test_batches_are_pipelineable():
    b = mixed_batch()
    tb = b.to_torchrec()
    for obj in (b, tb):
        assert isinstance(obj, Pipelineable)
        for name in ("to", "record_stream", "pin_memory"):
            assert callable(getattr(obj, name))
    moved = tb.to(torch.device("cpu"), non_blocking=True)
    assert isinstance(moved, TorchrecBatch)
    check_split(moved)
    assert len(tb) == 2


class TwoTowerLogits(torch.nn.Module):
    """An unweighted EBC over the id-list features, a weighted one (``is_weighted=True``) over
    the id-score features, dense through a linear layer, one logit; returns torchrec's
    ``(loss, output)`` pair."""

    def __init__(self, dense_width: int, id_list: list[str], id_score: list[str], dim: int = 8,
                 buckets: int = 1000) -> None:
        super().__init__()

        def tables(keys):
            return [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=dim, num_embeddings=buckets, feature_names=[k])
                    for k in keys]

        self.ebc = EmbeddingBagCollection(tables=tables(id_list), device=torch.device("cpu"))
        self.weighted_ebc = EmbeddingBagCollection(tables=tables(id_score), is_weighted=True,
                                                   device=torch.device("cpu"))
        self.dense = torch.nn.Linear(dense_width, dim)
        self.over = torch.nn.Linear(dim * (1 + len(id_list) + len(id_score)), 1)

    def forward(self, batch: TorchrecBatch):
        pooled = self.ebc(batch.sparse_features).values()
        scored = self.weighted_ebc(batch.id_score_list_features).values()
        x = torch.cat([torch.relu(self.dense(batch.dense_features)), pooled, scored], dim=1)
        logits = self.over(x).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


@pytest.fixture(scope="module")
def scored_table(tmp_path_factory):
    path = tmp_path_factory.mktemp("torchrec") / "t"
    generate_table(str(path), rows=2000, partitions=1, dense=4, sparse=4, scored=1, format="parquet", seed=11,
                   row_group_rows=500, progress=False)
    return path


def torchrec_spec(table) -> dict:
    spec = spec_dict(table, batch_size=128, split_rows=500)
    sparse = spec["features"]["sparse"]
    sparse[0]["transforms"].append({"op": "positive_modulus", "modulus": 1000})  # ids within the tables
    sparse.append({"name": "s_scored", "column": "idscore_0", "scores": "idscore_0_scores",
                   "transforms": [{"op": "positive_modulus", "modulus": 1000}]})
    return spec


@pytest.mark.slow
def test_dlrm_trains_through_train_pipeline_base_on_remote_batches(scored_table):
    raw = pq.read_table(str(scored_table), columns=["row_id", "idscore_0_scores"]).to_pydict()
    scores_of = {rid: s or [] for rid, s in zip(raw["row_id"], raw["idscore_0_scores"])}

    loader = RemoteDataLoader(torchrec_spec(scored_table), num_workers=1, timeout=120)
    try:
        model = TwoTowerLogits(2, ["s0", "s1"], ["s_scored"])
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        pipeline = TrainPipelineBase(model, optimizer, torch.device("cpu"))

        seen: list[TorchrecBatch] = []

        def batches():
            for b in loader:
                # The flags come from the master's compiled pipeline once the loader passes them on;
                # until then to_torchrec() tells id-score keys by their weights (with a warning).
                assert b.sparse_features.scored_keys() == ["s_scored"]
                tb = b.to_torchrec()
                seen.append(tb)
                yield tb

        it = batches()
        losses = []
        for _ in range(5):
            loss, _logits, _labels = pipeline.progress(it)
            losses.append(float(loss))
        it.close()
    finally:
        loader.close()

    assert all(math.isfinite(x) for x in losses), losses
    after = model.state_dict()
    for name in ("ebc.embedding_bags.t_s0.weight", "weighted_ebc.embedding_bags.t_s_scored.weight",
                 "over.weight"):
        assert not torch.equal(before[name], after[name]), f"{name} did not change"

    assert len(seen) >= 5
    for tb in seen:
        assert isinstance(tb, Pipelineable)
        assert tb.sparse_features.keys() == ["s0", "s1"]
        assert tb.sparse_features.weights_or_none() is None
        assert tb.id_score_list_features.keys() == ["s_scored"]
        jt = tb.id_score_list_features["s_scored"]
        rows = jt.lengths().tolist()
        weights = jt.weights().split(rows)
        for rid, w in zip(tb.passthrough["row_id"].tolist(), weights):
            assert w.dtype == F32
            assert w.tolist() == pytest.approx(scores_of[rid]), rid  # the table's own scores, not 1.0
        assert bool((jt.weights() != 1.0).any())
