from __future__ import annotations

import msgpack
import numpy as np
import pytest

from remoteloader.protocol import wire


def _piece(rows: int, first: int) -> dict:
    return {"dense": np.arange(first, first + 4 * rows, dtype=np.float32).reshape(rows, 4),
            "labels": np.full(rows, first, np.float32), "ids": np.array([1, 2], np.int64),
            "empty": np.zeros(0, np.int32)}


def test_roundtrip_of_several_pieces_in_one_message():
    pieces = [(7, 0, _piece(3, 0)), (7, 1, _piece(3, 100)), (9, 4, _piece(1, 200))]
    descs, frames = [], []
    for _, _, arrays in pieces:
        d, f = wire.pack_arrays(arrays)
        descs.append(d)
        frames.extend(f)
    parts = wire.encode("batch", frames, rank=0, epoch=1, pieces=[[s, i, len(a["labels"])] for s, i, a in pieces],
                        held=0, tensors=descs)
    header, got_frames = wire.decode([bytes(p) for p in parts])
    got = wire.unpack_pieces(header["pieces"], header["tensors"], got_frames)
    assert [(s, i) for s, i, _ in got] == [(7, 0), (7, 1), (9, 4)]
    for (_, _, want), (_, _, have) in zip(pieces, got):
        for k, a in want.items():
            assert np.array_equal(have[k], a) and have[k].dtype == a.dtype


THREE = np.zeros(3, np.float32).tobytes()  # a frame of three float32


@pytest.mark.parametrize("pieces,descs,frames,match", [
    ([], [], [], "pieces"),
    ([[1, 0, 3]] * 17, [[]] * 17, [], "pieces"),
    ([[1, 0, 3], [1, 1, 3]], [[["labels", "float32", [3]]]], [THREE], "descriptor lists"),
    ([[1, 0]], [[["labels", "float32", [3]]]], [THREE], "bad piece"),
    ([[1, -1, 3]], [[["labels", "float32", [3]]]], [THREE], "bad piece"),
    ([[1, 0, 4]], [[["labels", "float32", [3]]]], [THREE], "says 4 rows"),
    ([[1, 0, 3]], [[["dense", "float32", [3]]]], [THREE], "labels"),
    ([[1, 0, 3]], [[["labels", "float32", [3]]]], [THREE, THREE], "frames"),
    ([[1, 0, 1]], [[["labels", "float32", []]]], [THREE[:4]], "shape"),
])
def test_bad_piece_lists_are_refused(pieces, descs, frames, match):
    with pytest.raises(wire.ProtocolError, match=match):
        wire.unpack_pieces(pieces, descs, frames)


@pytest.mark.parametrize("parts,match", [
    ([], "empty"),
    ([b"\xc1garbage"], "not msgpack"),
    ([msgpack.packb([1, 2])], "not a map"),
    ([msgpack.packb({"v": 99, "t": "ok"})], "version"),
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "pickle_me"})], "unknown message type"),
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "get_split"})], "missing"),
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "get_split", "worker_id": 5})], "must be str"),
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "credit", "rank": True, "epoch": 0})], "got bool"),
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "ok", "extra": 1})], "unknown fields"),
    ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "ok"})] + [b""] * 65, "frames"),
])
def test_malformed_messages_are_rejected(parts, match):
    with pytest.raises(wire.ProtocolError, match=match):
        wire.decode(parts)
    assert wire.safe_decode(parts, "test") is None


@pytest.mark.parametrize("descs,frames,match", [
    ([["a", "float32", [3]]], [b"\0" * 8], "needs 12"),
    ([["a", "object", [1]]], [b"\0" * 8], "descriptor"),
    ([["a", "int64", [1, 1, 1]]], [b"\0" * 8], "descriptor"),
    ([["a", "int64", [-1]]], [b"\0" * 8], "descriptor"),
    ([["a", "int64", [1]]], [], "frames"),
])
def test_bad_tensor_descriptors(descs, frames, match):
    with pytest.raises(wire.ProtocolError, match=match):
        wire.unpack_arrays(descs, frames)


def test_every_message_type_is_documented():
    """docs/protocol.md and wire.SCHEMAS describe the same protocol."""
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()
    missing = [t for t in wire.SCHEMAS if f"`{t}" not in doc]
    assert not missing, f"message types missing from docs/protocol.md: {missing}"
