"""An ORC file written stripe by stripe: each unit is encoded once, as the only stripe of
a small ORC file in memory, and its bytes are copied into the output; the output's
metadata (stripe list, stripe statistics, file statistics) is assembled at the end.

Why not one pyarrow ``ORCWriter`` for the whole file: it cuts a stripe only when its size
estimate passes ``stripe_size`` after a batch, so an exact unit must be one batch of the
unit's rows, and Arrow's ORC adapter fills a batch's list / map children one row at a
time, growing their buffers to the exact new size on every row (a copy of everything
filled so far): a batch of n rows with list columns costs O(n x values), quadratic in the
stripe (issue 38: ``flatten`` of a 60k-row file took 56 s, nearly all in those copies).
Here a unit is encoded in batches of ``BATCH_ROWS`` rows with an unreachable stripe size,
so it stays one stripe, each batch costs O(batch x its values), and the unit costs time
linear in its rows.

The stripes are copied byte for byte (their stream offsets are stripe-relative); the
output's footer lists them at their new offsets, its metadata section holds each
stripe's statistics as the small file wrote them, and the file statistics are those of
the stripes merged the way the ORC writer merges them (``_merge``): the result is the
file one ORC writer would have written with the same stripes (a test compares bytes).
"""
from __future__ import annotations

import struct
import zlib
from typing import Iterator, Optional, Union

import pyarrow as pa
import pyarrow.orc as paorc

from ..formats.orc_layout import COMPRESSION as COMPRESSION_KINDS
from ..formats.orc_layout import decompress, read_fields, read_varint
from ..formats.types import TableError
from ..formats.writer import COMPRESSION, ORC_FILE_VERSION

BATCH_ROWS = 1024  # rows per ORC writer batch (the ORC writer's default)
_NO_CUT = 1 << 62  # a stripe size no unit reaches: the writer never cuts a unit in two
_MAGIC = b"ORC"
_INT64 = (-(1 << 63), (1 << 63) - 1)

Value = Union[int, bytes]


class OrcStripeWriter:
    """One ORC file; every ``write(table)`` is one stripe of exactly its rows.

    ``stats`` counts the work: ``encoded_rows`` (rows handed to an ORC encoder, each
    once), ``copied_bytes`` (stripe bytes copied into the file, each once), ``stripes``.
    """

    def __init__(self, sink: pa.NativeFile, *, compression: str = COMPRESSION, file_version: str = ORC_FILE_VERSION,
                 batch_rows: int = BATCH_ROWS):
        self._sink = sink
        self._options = dict(file_version=file_version, compression=compression, batch_size=batch_rows,
                             stripe_size=_NO_CUT)
        self._offset = 0
        self._stripes: list[bytes] = []  # StripeInformation messages
        self._stripe_stats: list[bytes] = []  # StripeStatistics messages
        self._file_stats: Optional[list[dict[int, list[Value]]]] = None
        self._template: Optional[_Tail] = None  # the first small file's tail
        self._rows = 0
        self.stats = {"stripes": 0, "encoded_rows": 0, "copied_bytes": 0}

    def write(self, table: pa.Table) -> None:
        """Append ``table`` as one stripe (an empty table adds nothing)."""
        if not table.num_rows:
            return
        data = self._encode(table)
        tail = _Tail(data)
        if len(tail.stripes) != 1 or len(tail.stripe_stats) != 1:
            raise TableError(f"the ORC writer cut a {table.num_rows}-row unit into {len(tail.stripes)} stripes")
        if self._template is None:
            self._template = tail
            self._sink.write(_MAGIC)
            self._offset = len(_MAGIC)
        elif tail.types != self._template.types:
            raise TableError("a unit's ORC schema differs from the file's first unit")
        info = _message(tail.stripes[0])
        start, length = info[1][0], sum(info[k][0] for k in (2, 3, 4) if k in info)
        self._sink.write(data[start:start + length])
        info[1] = [self._offset]
        self._stripes.append(_encode(info))
        self._stripe_stats.append(tail.stripe_stats[0])
        columns = [_message(s) for s in tail.file_stats]
        self._file_stats = columns if self._file_stats is None else [
            _merge(a, b) for a, b in zip(self._file_stats, columns, strict=True)]
        self._offset += length
        self._rows += table.num_rows
        self.stats["stripes"] += 1
        self.stats["encoded_rows"] += table.num_rows
        self.stats["copied_bytes"] += length

    def close(self, schema: pa.Schema) -> None:
        """Write the file's tail (``schema``: that of the tables, for a file without
        stripes, which is then the ORC writer's own empty file)."""
        if self._template is None:
            self._sink.write(self._encode(schema.empty_table()))
            return
        t = self._template
        compress = _Compressor(t.compression, t.block_size)
        metadata = compress(_encode({1: self._stripe_stats}))
        footer = dict(t.footer)
        # contentLength: the stripes' bytes, without the header (what the ORC writer records)
        footer.update({1: [len(_MAGIC)], 2: [self._offset - len(_MAGIC)], 3: self._stripes, 6: [self._rows],
                       7: [_encode(s) for s in self._file_stats or []]})
        footer = compress(_encode(footer))
        postscript = dict(t.postscript)
        postscript.update({1: [len(footer)], 5: [len(metadata)]})
        postscript = _encode(postscript)
        self._sink.write(metadata + footer + postscript + bytes([len(postscript)]))

    def _encode(self, table: pa.Table) -> pa.Buffer:
        sink = pa.BufferOutputStream()
        writer = paorc.ORCWriter(sink, **self._options)
        writer.write(table)
        writer.close()
        return sink.getvalue()


class _Tail:
    """A small file's PostScript, Footer and stripe statistics, field by field."""

    def __init__(self, data: pa.Buffer):
        data = memoryview(data).cast("B")
        ps_length = data[-1]
        self.postscript = _message(data[-1 - ps_length:-1])
        if self.postscript.get(8000) != [_MAGIC]:
            raise TableError("the ORC writer wrote no ORC postscript")
        self.compression = COMPRESSION_KINDS.get(self.postscript.get(2, [0])[0], "unknown")
        self.block_size = self.postscript.get(3, [256 * 1024])[0]
        footer_end = len(data) - 1 - ps_length
        footer_start = footer_end - self.postscript[1][0]
        metadata_start = footer_start - self.postscript.get(5, [0])[0]
        self.footer = _message(decompress(data[footer_start:footer_end], self.compression, self.block_size))
        metadata = _message(decompress(data[metadata_start:footer_start], self.compression, self.block_size))
        self.stripes: list[bytes] = self.footer.get(3, [])
        self.types: list[bytes] = self.footer.get(4, [])
        self.file_stats: list[bytes] = self.footer.get(7, [])
        self.stripe_stats: list[bytes] = metadata.get(1, [])


# -- protobuf wire format: messages as {field: [values]}, varints as ints, the rest as bytes --

def _fields(buf: Union[bytes, memoryview]) -> Iterator[tuple[int, int, Value]]:
    """``orc_layout.read_fields`` with values kept: length-delimited as bytes, fixed-width as ``_Fixed``."""
    for field, wire, value in read_fields(buf):
        if wire == 2:
            value = bytes(value)
        elif wire in (1, 5):
            value = _Fixed(value)
        yield field, wire, value


class _Fixed(bytes):
    """A fixed-width field's bytes (8: a double, 4: a float), kept apart from strings."""


def _message(buf: Union[bytes, memoryview]) -> dict[int, list[Value]]:
    out: dict[int, list[Value]] = {}
    for field, _, value in _fields(buf):
        out.setdefault(field, []).append(value)
    return out


def _put_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _encode(message: dict[int, list[Value]]) -> bytes:
    """Fields in field-number order, as protobuf's serializer writes them."""
    out = []
    for field in sorted(message):
        for value in message[field]:
            if isinstance(value, int):
                out.append(_put_varint(field << 3) + _put_varint(value))
            elif isinstance(value, _Fixed):
                out.append(_put_varint(field << 3 | (1 if len(value) == 8 else 5)) + value)
            else:
                out.append(_put_varint(field << 3 | 2) + _put_varint(len(value)) + bytes(value))
    return b"".join(out)


def _zigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def _unzigzag(value: int) -> int:
    return (value << 1) ^ (value >> 63) if value < 0 else value << 1


# -- compression of the metadata and footer, as the ORC writer does it ---------------------

class _Compressor:
    """ORC's chunked compression: ``block_size`` bytes of input per chunk, each with a
    3-byte header ``length << 1 | is_original``; a chunk that does not shrink is stored."""

    def __init__(self, compression: str, block_size: int):
        self.compression, self.block_size = compression, block_size
        codecs = {"snappy": "snappy", "zstd": "zstd", "lz4": "lz4_raw"}  # ORC's LZ4: raw blocks
        if compression in codecs:
            self._codec = pa.Codec(codecs[compression])
        elif compression not in ("none", "zlib"):
            raise TableError(f"cannot assemble ORC files compressed with {compression!r}")

    def __call__(self, raw: bytes) -> bytes:
        if self.compression == "none":
            return raw
        out = []
        for start in range(0, len(raw), self.block_size):
            chunk = raw[start:start + self.block_size]
            packed = self._compress(chunk)
            original = len(packed) >= len(chunk)
            body = chunk if original else packed
            header = len(body) << 1 | original
            out.append(header.to_bytes(3, "little") + body)
        return b"".join(out)

    def _compress(self, chunk: bytes) -> bytes:
        if self.compression == "zlib":
            c = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15)
            return c.compress(chunk) + c.flush()
        return self._codec.compress(chunk, asbytes=True)


# -- merging column statistics, as the ORC writer merges stripe statistics into the file's --

def _merge(a: dict[int, list[Value]], b: dict[int, list[Value]]) -> dict[int, list[Value]]:
    """The ColumnStatistics of two row ranges together. What the ORC writer computes is
    kept exactly for integer, floating point, string, boolean, date, binary and collection
    columns; other statistics it cannot merge exactly (decimal sums, truncated string
    bounds, unknown kinds) are left out, which readers take as "unknown"."""
    out: dict[int, list[Value]] = {}
    for field in sorted(set(a) | set(b)):
        if field not in a or field not in b:
            continue  # a statistic one side lacks is unknown for both together
        x, y = a[field][0], b[field][0]
        if field in (1, 11):  # numberOfValues, bytesOnDisk
            out[field] = [x + y]
        elif field == 10:  # hasNull
            out[field] = [x | y]
        elif field in _KINDS:
            merged = _KINDS[field](_message(x), _message(y))
            if merged is not None:
                out[field] = [_encode(merged)]
    return out


def _min_max(a: dict, b: dict, key, lo: int = 1, hi: int = 2) -> dict:
    """InternalStatisticsImpl::merge: a side's minimum and maximum are set together."""
    if lo not in b:
        return {k: a[k] for k in (lo, hi) if k in a}
    if lo not in a:
        return {k: b[k] for k in (lo, hi) if k in b}
    out = {lo: a[lo], hi: a[hi]}
    if key(out[hi][0]) < key(b[hi][0]):
        out[hi] = b[hi]
    if key(b[lo][0]) < key(out[lo][0]):
        out[lo] = b[lo]
    return out


def _sum_int64(a: dict, b: dict, field: int, out: dict) -> None:
    if field in a and field in b:
        total = _zigzag(a[field][0]) + _zigzag(b[field][0])
        if _INT64[0] <= total <= _INT64[1]:  # the writer drops a sum that overflows
            out[field] = [_unzigzag(total)]


def _integers(a: dict, b: dict) -> dict:
    out = _min_max(a, b, _zigzag)
    _sum_int64(a, b, 3, out)
    return out


def _doubles(a: dict, b: dict) -> dict:
    out = _min_max(a, b, lambda v: struct.unpack("<d", v)[0])
    if 3 in a and 3 in b:
        out[3] = [_Fixed(struct.pack("<d", struct.unpack("<d", a[3][0])[0] + struct.unpack("<d", b[3][0])[0]))]
    return out


def _strings(a: dict, b: dict) -> dict:
    out = {}
    if not any(k in s for s in (a, b) for k in (4, 5)):
        out = _min_max(a, b, bytes)
    else:  # truncated bounds on one side: keep bounds only, loose but true
        lows = [s.get(1, s.get(4)) for s in (a, b)]
        highs = [s.get(2, s.get(5)) for s in (a, b)]
        if all(lows) and all(highs):
            out = {4: [min(v[0] for v in lows)], 5: [max(v[0] for v in highs)]}
    _sum_int64(a, b, 3, out)
    return out


def _buckets(a: dict, b: dict) -> dict:
    if 1 not in a or 1 not in b:
        return {}
    counts = [_unpack(a[1][0]), _unpack(b[1][0])]
    return {1: [b"".join(_put_varint(x + y) for x, y in zip(*counts))]}


def _unpack(value: Value) -> list[int]:
    if isinstance(value, int):
        return [value]
    buf, pos, out = memoryview(value), 0, []
    while pos < len(buf):
        v, pos = read_varint(buf, pos)
        out.append(v)
    return out


def _dates(a: dict, b: dict) -> dict:
    return _min_max(a, b, _zigzag)


def _binary(a: dict, b: dict) -> dict:
    out: dict = {}
    _sum_int64(a, b, 1, out)
    return out


def _collections(a: dict, b: dict) -> dict:
    out = _min_max(a, b, int)
    if 3 in a and 3 in b:
        out[3] = [a[3][0] + b[3][0]]
    return out


def _unknown(a: dict, b: dict) -> None:
    return None


# ColumnStatistics field -> how its kind merges (6 decimal, 9 timestamp, 13+: left out).
_KINDS = {2: _integers, 3: _doubles, 4: _strings, 5: _buckets, 6: _unknown, 7: _dates, 8: _binary,
          9: _unknown, 12: _collections}
