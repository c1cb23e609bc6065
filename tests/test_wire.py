from __future__ import annotations

import msgpack
import numpy as np
import pytest

from remoteloader.protocol import wire


def test_roundtrip_with_frames():
    arrays = {"dense": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": np.array([1, 2], np.int64),
              "empty": np.zeros(0, np.int32)}
    descs, frames = wire.pack_arrays(arrays)
    parts = wire.encode("batch", frames, rank=0, epoch=1, split_id=2, piece=0, rows=3, held=0, tensors=descs)
    header, got_frames = wire.decode([bytes(p) for p in parts])
    assert header["t"] == "batch" and header["split_id"] == 2
    got = wire.unpack_arrays(header["tensors"], got_frames)
    for k, a in arrays.items():
        assert np.array_equal(got[k], a) and got[k].dtype == a.dtype


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
