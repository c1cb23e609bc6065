from __future__ import annotations

import msgpack
import numpy as np
import pytest

from remoteloader.protocol import docs, wire
from remoteloader.protocol.messages import MESSAGE_TYPES, Batch, tag


def _run(rows: list[int], keys: int = 2, seed: int = 0):
    """A run of consecutive pieces as a worker sends it, and each piece on its own."""
    from remoteloader.columns import SparseColumn
    from remoteloader.core.processor import TransformedSplit

    rng, total = np.random.default_rng(seed), sum(rows)
    sparse = []
    for _ in range(keys):
        offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 4, total))])
        sparse.append(SparseColumn(rng.integers(0, 99, int(offsets[-1])), offsets))
    split = TransformedSplit.build(rng.random((total, 3)).astype(np.float32), rng.random(total).astype(np.float32),
                                   sparse, {"row_id": np.arange(total)}, None, rows[0])
    bounds = np.concatenate([[0], np.cumsum(rows)])
    return split.arrays(0, total), [split.arrays(int(a), int(b)) for a, b in zip(bounds, bounds[1:])]


def _message(arrays: dict, rows: list[int], **fields) -> dict:
    descs, frames = wire.pack_arrays(arrays)
    header = {"session": "s-1", "seq": 1, "split_id": 7, "piece": 3, "rows": rows, "held": 0, "tensors": descs, **fields}
    parts = wire.encode(Batch(**header), frames)
    return wire.decode([bytes(p) for p in parts])


@pytest.mark.parametrize("rows,keys", [([4, 4, 4, 2], 2), ([5], 3), ([3, 3], 0)])
def test_a_run_of_pieces_arrives_as_the_pieces(rows, keys):
    whole, pieces = _run(rows, keys)
    header, frames = _message(whole, rows)
    got = wire.unpack_pieces(header, frames, keys)
    assert [(s, i) for s, i, _ in got] == [(7, 3 + i) for i in range(len(rows))]
    for want, (_, _, have) in zip(pieces, got):
        assert set(have) == set(want)
        for k, a in want.items():
            assert np.array_equal(have[k], a) and have[k].dtype == a.dtype, k


def _broken(change) -> tuple[dict, list]:
    whole, _ = _run([4, 4], 2)
    whole = dict(whole)
    fields = change(whole)
    fields = fields if isinstance(fields, dict) else {}
    return _message(whole, fields.pop("rows", [4, 4]), **fields)


@pytest.mark.parametrize("change,match", [
    (lambda a: {"rows": []}, r"length >= 1 - at `\$\.rows`"),  # refused by the decoder
    (lambda a: {"rows": [1] * 65}, r"length <= 64 - at `\$\.rows`"),
    (lambda a: {"rows": [4, 0, 4]}, r">= 1 - at `\$\.rows\[1\]`"),
    (lambda a: {"rows": [4, 5]}, "lengths"),
    (lambda a: a.__delitem__("sparse.lengths"), "sparse"),
    (lambda a: a.update({"sparse.lengths": -a["sparse.lengths"]}), "lengths"),
    # int64 lengths could sum past 2**63 and wrap to match the values: only int32 is taken
    (lambda a: a.update({"sparse.lengths": np.full(16, 2**62, np.int64), "sparse.values": np.zeros(0, np.int64)}),
     "int32"),
    (lambda a: a.update({"sparse.values": a["sparse.values"][1:]}), "add up"),
    (lambda a: a.update({"dense": a["dense"][1:]}), "dense"),
    (lambda a: a.update({"labels": a["labels"].reshape(2, 4)}), "labels"),
    (lambda a: a.__delitem__("labels"), "labels"),
])
def test_bad_runs_are_refused(change, match):
    with pytest.raises(wire.ProtocolError, match=match):
        header, frames = _broken(change)
        wire.unpack_pieces(header, frames, 2)


def test_descriptors_and_frames_must_match():
    whole, _ = _run([4, 4], 2)
    header, frames = _message(whole, [4, 4])
    with pytest.raises(wire.ProtocolError, match="frames"):
        wire.unpack_pieces(header, frames[:-1], 2)


@pytest.mark.parametrize("parts,match", [
    ([], "empty"),
    ([b"\xc1garbage"], "not msgpack"),
    ([msgpack.packb([1, 2])], "not a map"),
    ([msgpack.packb({"v": 99, "t": "ok"})], "version"),
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "pickle_me"})], "unknown message type"),
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "get_split"})], "missing"),
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "get_split", "worker_id": 5})], "Expected `str`, got `int`"),
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "credit", "session": "s", "token": "t", "seq": True})],
     "got `bool`"),
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "ok", "extra": 1})], "unknown field `extra`"),
    ([msgpack.packb({"v": 8, "t": "credit", "session": "s", "token": "t", "seq": 0, "batches": 1, "bytes": 1})],
     "protocol version 8"),  # another version is named as such, not as its fields
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "start_epoch", "session": "s", "epoch": 0,
                     "done": [[0, 1]]})], r"at `\$\.done\[0\]`"),  # nested records are checked too
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "ok"})] + [b""] * 65, "frames"),
])
def test_malformed_messages_are_rejected(parts, match):
    with pytest.raises(wire.ProtocolError, match=match):
        wire.decode(parts)
    assert wire.safe_decode(parts, "test") is None


@pytest.mark.parametrize("descs,frames,match", [
    ([["a", "float32", [3]]], [b"\0" * 8], "needs 12"),
    ([["a", "object", [1]]], [b"\0" * 8], r"at `\$\.tensors\[0\]\[1\]`"),
    ([["a", "int64", [1, 1, 1]]], [b"\0" * 8], r"length <= 2 - at `\$\.tensors\[0\]\[2\]`"),
    ([["a", "int64", [-1]]], [b"\0" * 8], r">= 0 - at `\$\.tensors\[0\]\[2\]\[0\]`"),
    ([["a", "int64", [1]]], [], "frames"),
])
def test_bad_tensor_descriptors(descs, frames, match):
    """Descriptors are checked by the decoder, each frame's size against them after."""
    header = {"v": wire.PROTOCOL_VERSION, "t": "batch", "session": "s", "seq": 0, "split_id": 0, "piece": 0,
              "rows": [1], "held": 0, "tensors": descs}
    with pytest.raises(wire.ProtocolError, match=match):
        message, frames = wire.decode([msgpack.packb(header), *frames])
        wire.unpack_arrays(message.tensors, frames)


def test_every_message_type_is_documented():
    for cls in MESSAGE_TYPES:
        assert f"`{tag(cls)}`" in docs.generated()


def test_protocol_doc_tables_are_generated_from_the_types():
    """docs/protocol.md's tables are the types' (python -m remoteloader.protocol.docs docs/protocol.md)."""
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()
    assert docs.current(page) == docs.generated()
