"""The wire format (docs/protocol.md is the prose version; keep the two in step).

Every message is one ZeroMQ multipart message: a msgpack header (a map with the
protocol version ``v``, the message type ``t`` and the type's fields), then zero or
more raw data frames. Headers are small and checked against ``SCHEMAS`` before any
code looks at them; data frames are only ever reinterpreted as arrays of whitelisted
dtypes whose declared shape matches the frame's byte length. Nothing that arrives is
unpickled, evaluated or imported.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Mapping, Optional, Sequence

import msgpack
import numpy as np
import zmq

PROTOCOL_VERSION = 8  # 8: capabilities (required fields, so incompatible): welcome/credit token (the master's signature of the session), registered token and verify_key, the worker token on every request naming a worker id; 7: master-issued client sessions and epoch runs (session, seq), goodbye, job fingerprint on register and split; 6: a batch message is a run of consecutive pieces, one frame per tensor; 5: several pieces per batch message; 4: credit replaces get_batch; 3: splits_released, get_split avoid_ranks; 2: files as maps, start_epoch done, ...
MAX_HEADER_BYTES = 16 << 20  # a spec with a large map_id table still fits; nothing else comes close
MAX_FRAMES = 64
MAX_PIECES = 64  # pieces in one batch message
MAX_FRAME_BYTES = 1 << 30  # ZeroMQ handles up to ~2 GB; a batch this big is a misconfiguration
MAX_STRING = 4096  # ids, addresses, reasons; longer only where SCHEMAS says so
MAX_LIST = 1 << 20  # items of any list field (a rank's splits, acks)
MAX_INT = (1 << 63) - 1
DTYPES = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "int64": np.int64, "uint8": np.uint8}
_NP_DTYPES = {name: np.dtype(t) for name, t in DTYPES.items()}

log = logging.getLogger(__name__)


class ProtocolError(ValueError):
    """A message that does not follow the protocol; it is logged and dropped."""


# type -> {field: (accepted python types, required)}
_STR, _INT, _NUM, _BOOL, _MAP, _LIST = (str,), (int,), (int, float), (bool,), (dict,), (list,)
_LONG_STRINGS = {"error": 1 << 16, "message": 1 << 16}  # error texts name files and causes
_NONNEGATIVE = {"batches", "bytes", "held", "epoch", "rank", "world_size", "pid", "buffered", "split_id", "piece", "rows",
                "retry_ms", "seq"}

# Heartbeat statistics: every key typed, numbers finite and >= 0; nothing else accepted.
_COUNT, _AMOUNT = "count", "amount"
WORKER_STATS = {"rows": _COUNT, "batches": _COUNT, "splits": _COUNT, "busy_s": _AMOUNT, "cpu": _AMOUNT,
                "mem": _AMOUNT, "time": _AMOUNT, "capacity": _COUNT, "ahead": _COUNT, "split": "split", "io": "io",
                "discarded": "discarded"}
CLIENT_STATS = {"wait_s": _AMOUNT, "starved_s": _AMOUNT, "epoch_start_s": _AMOUNT, "batches": _COUNT, "rows": _COUNT, "queued": _COUNT,
                "time": _AMOUNT, "since_batch_s": _AMOUNT, "wait_le": "amounts", "wait_buckets": "counts"}  # a wait histogram
MAX_BUCKETS = 32
IO_STATS = ("requests", "bytes_requested", "bytes_needed", "splits")
# Why a worker threw pieces away (never reported stored; their splits go back to the master).
DISCARD_REASONS = ("stale_run", "session_gone", "silent", "yielded", "wrong_job")
SCHEMAS: dict[str, dict[str, tuple[tuple, bool]]] = {
    # worker -> master
    "register": {"addr": (_STR, True), "pid": (_INT, True), "fingerprint": (_STR, True)},
    "get_spec": {},
    "heartbeat": {"worker_id": (_STR, True), "token": (_STR, True), "buffered": (_INT, True), "stats": (_MAP, False)},
    "get_split": {"worker_id": (_STR, True), "token": (_STR, True), "avoid_ranks": (_LIST, False)},
    "splits_released": {"worker_id": (_STR, True), "token": (_STR, True), "splits": (_LIST, True), "reason": (_STR, True)},
    "split_produced": {"worker_id": (_STR, True), "token": (_STR, True), "epoch": (_INT, True), "split_id": (_INT, True)},
    "split_failed": {"worker_id": (_STR, True), "token": (_STR, True), "epoch": (_INT, True), "split_id": (_INT, True),
                     "error": (_STR, True)},
    "drain": {"worker_id": (_STR, True), "token": (_STR, True)},
    "bye": {"worker_id": (_STR, True), "token": (_STR, True)},
    # client -> master
    "hello": {"rank": (_INT, True), "world_size": (_INT, True), "spec": (_MAP, True), "fingerprint": (_STR, True)},
    "start_epoch": {"session": (_STR, True), "epoch": (_INT, True), "consumed": (_LIST, False),
                    "done": (_LIST, False)},
    "client_heartbeat": {"session": (_STR, True), "seq": (_INT, True), "acks": (_LIST, True),
                         "stats": (_MAP, False)},
    "finish_epoch": {"session": (_STR, True), "seq": (_INT, True)},
    "goodbye": {"session": (_STR, True)},
    "status": {},
    # master -> worker / client
    "registered": {"worker_id": (_STR, True), "heartbeat_interval": (_NUM, True), "fingerprint": (_STR, True),
                   "token": (_STR, True), "verify_key": (_STR, True)},
    "spec": {"spec": (_MAP, True), "schema": (_MAP, True), "fingerprint": (_STR, True)},
    "heartbeat_ok": {"state": (_STR, True), "sessions": (_LIST, False)},
    "split": {"split": (_MAP, True)},
    "no_split": {"retry_ms": (_INT, True), "reason": (_STR, True)},
    "welcome": {"session": (_STR, True), "token": (_STR, True), "job": (_MAP, True)},
    "epoch": {"epoch": (_INT, True), "seq": (_INT, True), "splits": (_LIST, True)},
    "membership": {"workers": (_LIST, True), "errors": (_LIST, True), "master": (_STR, False)},
    "ok": {},
    "error": {"message": (_STR, True), "code": (_STR, False)},
    "status_reply": {"status": (_MAP, True)},
    # client -> worker and back
    "credit": {"session": (_STR, True), "token": (_STR, True), "seq": (_INT, True), "batches": (_INT, True), "bytes": (_INT, True)},
    "batch": {"session": (_STR, True), "seq": (_INT, True), "split_id": (_INT, True), "piece": (_INT, True),
              "rows": (_LIST, True), "held": (_INT, True), "tensors": (_LIST, True)},
}
# What the master answers; MasterService checks at import that it has a handler for each.
MASTER_REQUESTS = frozenset({"register", "get_spec", "heartbeat", "get_split", "split_produced", "split_failed",
                             "splits_released", "drain", "bye", "hello", "start_epoch", "client_heartbeat",
                             "finish_epoch", "goodbye", "status"})


def encode(t: str, frames: Sequence[Any] = (), **fields: Any) -> list:
    """A message ready for ``socket.send_multipart(..., copy=False)``."""
    header = {"v": PROTOCOL_VERSION, "t": t, **fields}
    _check_fields(t, header)
    return [msgpack.packb(header, use_bin_type=True), *frames]


def decode(parts: Sequence[Any]) -> tuple[dict, list]:
    """Header and data frames of a received message; raises ProtocolError on anything off."""
    if not parts:
        raise ProtocolError("empty message")
    if len(parts) - 1 > MAX_FRAMES:
        raise ProtocolError(f"{len(parts) - 1} data frames (at most {MAX_FRAMES})")
    raw = parts[0].bytes if hasattr(parts[0], "bytes") else parts[0]
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not msgpack: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r}, this side speaks {PROTOCOL_VERSION}")
    t = header.get("t")
    if not isinstance(t, str) or t not in SCHEMAS:
        raise ProtocolError(f"unknown message type {t!r}")
    _check_fields(t, header)
    return header, list(parts[1:])


def _check_fields(t: str, header: Mapping) -> None:
    schema = SCHEMAS[t]
    for name, (types, required) in schema.items():
        if name not in header:
            if required:
                raise ProtocolError(f"{t}: field {name!r} is missing")
            continue
        value = header[name]
        if isinstance(value, bool) and bool not in types:
            raise ProtocolError(f"{t}: field {name!r} must be {types[0].__name__}, got bool")
        if not isinstance(value, types):
            raise ProtocolError(f"{t}: field {name!r} must be {types[0].__name__}, got {type(value).__name__}")
        _check_value(t, name, value)
    extra = set(header) - set(schema) - {"v", "t"}
    if extra:
        raise ProtocolError(f"{t}: unknown fields {sorted(extra)}")
    if "stats" in header:
        _check_stats(t, header["stats"], WORKER_STATS if t == "heartbeat" else CLIENT_STATS)


def _check_value(t: str, name: str, value: Any) -> None:
    if isinstance(value, str) and len(value) > _LONG_STRINGS.get(name, MAX_STRING):
        raise ProtocolError(f"{t}: field {name!r} is {len(value)} characters long (at most "
                            f"{_LONG_STRINGS.get(name, MAX_STRING)})")
    if isinstance(value, list) and len(value) > MAX_LIST:
        raise ProtocolError(f"{t}: field {name!r} has {len(value)} items (at most {MAX_LIST})")
    if name in _NONNEGATIVE and isinstance(value, int) and not 0 <= value <= MAX_INT:
        raise ProtocolError(f"{t}: field {name!r} must be >= 0, got {value}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _check_stats(t: str, stats: Mapping, schema: Mapping[str, str]) -> None:
    for key, value in stats.items():
        kind = schema.get(key)
        if kind is None:
            raise ProtocolError(f"{t}: unknown stats key {key!r}")
        if kind == _COUNT:
            ok = _is_number(value) and isinstance(value, int)
        elif kind == _AMOUNT:
            ok = _is_number(value)
        elif kind in ("amounts", "counts"):
            ok = isinstance(value, list) and len(value) <= MAX_BUCKETS and all(
                _is_number(x) and (kind == "amounts" or isinstance(x, int)) for x in value)
        elif kind == "discarded":  # reason -> pieces discarded so far
            ok = isinstance(value, dict) and set(value) <= set(DISCARD_REASONS) and all(
                _is_number(x) and isinstance(x, int) for x in value.values())
        elif kind == "split":  # [epoch, split id, pieces produced]
            ok = isinstance(value, list) and len(value) == 3 and all(_is_number(x) and isinstance(x, int) for x in value)
        else:  # io counters
            ok = isinstance(value, dict) and set(value) <= set(IO_STATS) and all(
                _is_number(x) and isinstance(x, int) for x in value.values())
        if not ok:
            raise ProtocolError(f"{t}: stats {key!r} has an invalid value {str(value)[:80]!r}")


# -- tensors as raw frames ---------------------------------------------------------------
def pack_arrays(arrays: Mapping[str, np.ndarray]) -> tuple[list, list]:
    """Descriptors for the header and the arrays themselves as frames (no copy)."""
    descs, frames = [], []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        descs.append([name, a.dtype.name, list(a.shape)])
        frames.append(memoryview(a).cast("B") if a.size else b"")
    return descs, frames


def unpack_arrays(descs: Iterable, frames: Sequence[Any]) -> dict[str, np.ndarray]:
    """Arrays viewing the received frames' memory; checks every size before trusting it."""
    descs = list(descs)
    if len(descs) != len(frames):
        raise ProtocolError(f"{len(descs)} tensor descriptors but {len(frames)} frames")
    out = {}
    for desc, frame in zip(descs, frames):
        if not (isinstance(desc, list) and len(desc) == 3 and isinstance(desc[0], str)
                and desc[1] in DTYPES and isinstance(desc[2], list) and len(desc[2]) <= 2
                and all(type(d) is int and 0 <= d <= MAX_FRAME_BYTES for d in desc[2])):
            raise ProtocolError(f"bad tensor descriptor {desc!r}")
        name, dtype, shape = desc
        buf = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
        dt = _NP_DTYPES[dtype]
        elements = 1
        for d in shape:  # each d is bounded above: the product is exact in Python ints
            elements *= d
        expected = elements * dt.itemsize
        if buf.nbytes != expected:
            raise ProtocolError(f"tensor {name!r}: frame has {buf.nbytes} bytes, shape {shape} {dtype} needs {expected}")
        out[name] = np.frombuffer(buf, dtype=dt).reshape(shape) if expected else np.zeros(shape, dtype=dt)
    return out


_PER_VALUE = ("sparse.values", "sparse.weights")  # one entry per sparse value; the rest per row (lengths: per row and feature)


def unpack_pieces(header: Mapping, frames: Sequence[Any], keys: int) -> list[tuple[int, int, dict[str, np.ndarray]]]:
    """(split id, piece, arrays) of each piece of a ``batch`` message: pieces ``piece``,
    ``piece + 1``, ... of ``split_id`` with ``rows`` rows each, their tensors one after
    the other in one frame per tensor (sparse ones piece-major: each piece key-major over
    ``keys`` features). Every size is checked before a piece is cut out (as views)."""
    rows = header["rows"]
    if not (0 < len(rows) <= MAX_PIECES and all(type(r) is int and 0 < r <= MAX_FRAME_BYTES for r in rows)):
        raise ProtocolError(f"batch rows {str(rows)[:80]}: 1 to {MAX_PIECES} pieces of at least one row")
    arrays = unpack_arrays(header["tensors"], frames)
    total = sum(rows)
    lengths, values = arrays.get("sparse.lengths"), arrays.get("sparse.values")
    if lengths is None or values is None or lengths.ndim != 1 or values.ndim != 1:
        raise ProtocolError("batch without 1-d sparse.lengths and sparse.values")
    # int32 (as workers send them): their sum cannot overflow the int64 offsets below.
    if lengths.shape[0] != keys * total or lengths.dtype != np.int32 or (total and keys and lengths.min() < 0):
        raise ProtocolError(f"sparse.lengths: {lengths.shape[0]} {lengths.dtype} for {keys} features x {total} rows "
                            "(int32, >= 0)")
    offsets = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    for name, a in arrays.items():
        if name in _PER_VALUE:
            if a.shape != (offsets[-1],):
                raise ProtocolError(f"{name}: shape {list(a.shape)}, the lengths add up to {offsets[-1]}")
        elif name != "sparse.lengths" and (a.ndim == 0 or a.shape[0] != total):
            raise ProtocolError(f"{name}: shape {list(a.shape)}, the pieces hold {total} rows")
    if "labels" not in arrays or arrays["labels"].ndim != 1:
        raise ProtocolError("batch without 1-d labels")
    split_id, first = header["split_id"], header["piece"]
    if len(rows) == 1:
        return [(split_id, first, arrays)]
    out, lo = [], 0
    for i, r in enumerate(rows):
        hi = lo + r
        a, b = keys * lo, keys * hi
        va, vb = int(offsets[a]), int(offsets[b])
        out.append((split_id, first + i, {
            name: arr[va:vb] if name in _PER_VALUE else arr[a:b] if name == "sparse.lengths" else arr[lo:hi]
            for name, arr in arrays.items()}))
        lo = hi
    return out


def safe_decode(parts: Sequence[Any], source: str) -> Optional[tuple[dict, list]]:
    """``decode`` for server loops: a malformed message is logged and dropped, never fatal."""
    try:
        return decode(parts)
    except ProtocolError as e:
        log.warning("dropped malformed message from %s: %s", source, e)
        return None
