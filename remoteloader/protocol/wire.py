"""The wire format (docs/protocol.md's tables are generated from ``messages``).

Every message is one ZeroMQ multipart message: a msgpack header (one of the tagged
Structs of ``messages``: the protocol version ``v``, the message type ``t`` and the
type's fields), then zero or more raw data frames. ``decode`` is the one check of a
header: msgspec validates it against its type, bounds included, while parsing it.
Data frames are only ever reinterpreted as arrays of whitelisted dtypes whose
declared shape matches the frame's byte length. Nothing that arrives is unpickled,
evaluated or imported.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

import msgspec
import numpy as np
import zmq

from .. import jagged
from .messages import (DISCARD_REASONS, MASTER_REQUESTS, MAX_FRAME_BYTES, MAX_PIECES, PROTOCOL_VERSION,
                       MESSAGE_TYPES, AnyMessage, Message, TensorDesc, tag)

__all__ = ["DISCARD_REASONS", "MASTER_REQUESTS", "PROTOCOL_VERSION", "ProtocolError", "encode", "decode",
           "safe_decode", "pack_arrays", "tensor_bytes", "unpack_arrays", "unpack_pieces"]

MAX_HEADER_BYTES = 16 << 20  # a spec with a large map_id table still fits; nothing else comes close
MAX_FRAMES = 64
DTYPES = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "int64": np.int64, "uint8": np.uint8}
_NP_DTYPES = {name: np.dtype(t) for name, t in DTYPES.items()}

log = logging.getLogger(__name__)
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(AnyMessage)


class _Envelope(msgspec.Struct):
    """What every version's header has: read only to explain a header that does not decode."""

    v: Any = None
    t: Any = None


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_TAGS = frozenset(tag(c) for c in MESSAGE_TYPES)


class ProtocolError(ValueError):
    """A message that does not follow the protocol; it is logged and dropped."""


def encode(message: Message, frames: Sequence[Any] = ()) -> list:
    """A message ready for ``socket.send_multipart(..., copy=False)``. Types are not
    checked here: the receiver's ``decode`` checks everything."""
    return [_ENCODER.encode(message), *frames]


def decode(parts: Sequence[Any]) -> tuple[Message, list]:
    """Header and data frames of a received message; raises ProtocolError on anything off."""
    if not parts:
        raise ProtocolError("empty message")
    if len(parts) - 1 > MAX_FRAMES:
        raise ProtocolError(f"{len(parts) - 1} data frames (at most {MAX_FRAMES})")
    raw = memoryview(parts[0].buffer if isinstance(parts[0], zmq.Frame) else parts[0])  # read in place
    if raw.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {raw.nbytes} bytes (at most {MAX_HEADER_BYTES})")
    try:
        message = _DECODER.decode(raw)
    except msgspec.ValidationError as e:
        raise ProtocolError(_invalid(raw, e)) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"header is not msgpack: {e}") from None
    if message.v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {message.v!r}, this side speaks {PROTOCOL_VERSION}")
    return message, list(parts[1:])


def _invalid(raw: memoryview, error: msgspec.ValidationError) -> str:
    """Why a msgpack header is not a message: another version first (its fields differ,
    which would otherwise be the complaint), then the type, then msgspec's own words."""
    try:
        envelope = _ENVELOPE.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return "header is not a map"
    if envelope.v != PROTOCOL_VERSION:
        return f"protocol version {str(envelope.v)[:40]}, this side speaks {PROTOCOL_VERSION}"
    if not isinstance(envelope.t, str) or envelope.t not in _TAGS:
        return f"unknown message type {str(envelope.t)[:40]!r}"
    return f"{envelope.t}: {error}"


# -- tensors as raw frames ---------------------------------------------------------------
def pack_arrays(arrays: Mapping[str, np.ndarray]) -> tuple[list[TensorDesc], list]:
    """Descriptors for the header and the arrays themselves as frames (no copy)."""
    descs, frames = [], []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        descs.append(TensorDesc(name, a.dtype.name, list(a.shape)))
        frames.append(memoryview(a).cast("B") if a.size else b"")
    return descs, frames


def tensor_bytes(desc: TensorDesc) -> int:
    """The bytes a tensor descriptor declares (its dims are bounded at decode: the product is
    exact in Python ints)."""
    n = _NP_DTYPES[desc.dtype].itemsize
    for d in desc.shape:
        n *= d
    return n


def unpack_arrays(descs: Sequence[TensorDesc], frames: Sequence[Any]) -> dict[str, np.ndarray]:
    """Arrays viewing the received frames' memory; the descriptors' types were checked at
    decode, each frame's size is checked here before it is trusted."""
    if len(descs) != len(frames):
        raise ProtocolError(f"{len(descs)} tensor descriptors but {len(frames)} frames")
    out = {}
    for desc, frame in zip(descs, frames):
        name, shape = desc.name, desc.shape
        buf = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
        dt = _NP_DTYPES[desc.dtype]
        expected = tensor_bytes(desc)
        if buf.nbytes != expected:
            raise ProtocolError(f"tensor {name!r}: frame has {buf.nbytes} bytes, shape {shape} {desc.dtype} needs {expected}")
        out[name] = np.frombuffer(buf, dtype=dt).reshape(shape) if expected else np.zeros(shape, dtype=dt)
    return out


def unpack_pieces(header: Mapping, frames: Sequence[Any], keys: int) -> list[tuple[int, int, dict[str, np.ndarray]]]:
    """(split id, piece, arrays) of each piece of a ``batch`` message: pieces ``piece``,
    ``piece + 1``, ... of ``split_id`` with ``rows`` rows each, as one run (``jagged``'s layout,
    over ``keys`` features). Every size is checked once, before the run is cut (as views)."""
    rows = header["rows"]
    if not (0 < len(rows) <= MAX_PIECES and all(type(r) is int and 0 < r <= MAX_FRAME_BYTES for r in rows)):
        raise ProtocolError(f"batch rows {str(rows)[:80]}: 1 to {MAX_PIECES} pieces of at least one row")
    arrays = unpack_arrays(header["tensors"], frames)
    total = sum(rows)
    lengths, values = arrays.get(jagged.LENGTHS), arrays.get(jagged.VALUES)
    if lengths is None or values is None or lengths.ndim != 1 or values.ndim != 1:
        raise ProtocolError("batch without 1-d sparse.lengths and sparse.values")
    # int32 (as workers send them): their sum cannot overflow the int64 offsets below.
    if lengths.shape[0] != keys * total or lengths.dtype != np.int32 or (total and keys and lengths.min() < 0):
        raise ProtocolError(f"sparse.lengths: {lengths.shape[0]} {lengths.dtype} for {keys} features x {total} rows "
                            "(int32, >= 0)")
    row_bounds = np.cumsum([0, *rows], dtype=np.int64)
    value_bounds = _value_bounds(lengths, keys, row_bounds)
    n_values = int(value_bounds[-1])
    for name, a in arrays.items():
        if name in jagged.PER_VALUE:
            if a.shape != (n_values,):
                raise ProtocolError(f"{name}: shape {list(a.shape)}, the lengths add up to {n_values}")
        elif name != jagged.LENGTHS and (a.ndim == 0 or a.shape[0] != total):
            raise ProtocolError(f"{name}: shape {list(a.shape)}, the pieces hold {total} rows")
    if "labels" not in arrays or arrays["labels"].ndim != 1:
        raise ProtocolError("batch without 1-d labels")
    pieces = jagged.cut(arrays, keys, row_bounds, value_bounds)
    return [(header["split_id"], header["piece"] + i, piece) for i, piece in enumerate(pieces)]


def _value_bounds(lengths: np.ndarray, keys: int, row_bounds: np.ndarray) -> np.ndarray:
    """int64 ``[pieces + 1]``: where each piece's values start in the run, then their end.
    A piece's values are the sum of its ``keys * rows`` lengths (one contiguous range of
    ``lengths``): one pass summing per piece (``reduceat``, accumulated in int64), with no
    array of per-length offsets. ``lengths`` is checked already (``keys * total`` int32)."""
    bounds = np.zeros(row_bounds.shape[0], np.int64)
    if keys and lengths.shape[0]:  # every piece has a row, so each range is non-empty
        np.cumsum(np.add.reduceat(lengths, keys * row_bounds[:-1], dtype=np.int64), out=bounds[1:])
    return bounds


def safe_decode(parts: Sequence[Any], source: str) -> Optional[tuple[Message, list]]:
    """``decode`` for server loops: a malformed message is logged and dropped, never fatal."""
    try:
        return decode(parts)
    except ProtocolError as e:
        log.warning("dropped malformed message from %s: %s", source, e)
        return None
