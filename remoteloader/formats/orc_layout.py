"""ORC byte layout from the file's own metadata, so a split's reads can be planned as
byte ranges before any data is read.

An ORC file is ``"ORC" | stripes | metadata | footer | postscript | 1 byte: postscript
length``; a stripe is ``index streams | data streams | stripe footer``, and the stripe
footer lists the streams (kind, column id, length) in file order. Column ids number the
flattened type tree in pre-order (0 is the root struct), so a top-level column owns a
contiguous id range: a list column has its element column, a map its key and value
columns, and so on down.

Only the few protobuf messages needed are parsed, by a minimal wire-format reader:
PostScript, Footer (stripes and types) and StripeFooter (streams). Footer, metadata and
stripe footers are compressed in chunks with 3-byte headers; the PostScript never is.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import numpy as np
import pyarrow as pa

from .types import TableError

Bytes = Union[bytes, memoryview]

# CompressionKind enum of the PostScript.
COMPRESSION = {0: "none", 1: "zlib", 2: "snappy", 3: "lzo", 4: "lz4", 5: "zstd"}
# Stream kinds of the index area (read only with search arguments, which remoteloader never passes).
INDEX_STREAMS = (6, 7, 8)  # ROW_INDEX, BLOOM_FILTER, BLOOM_FILTER_UTF8
_MAX_POSTSCRIPT = 255  # its length is stored in one byte


@dataclass(frozen=True)
class Stripe:
    offset: int
    index_length: int
    data_length: int
    footer_length: int
    rows: int

    @property
    def footer_offset(self) -> int:
        return self.offset + self.index_length + self.data_length


@dataclass(frozen=True)
class Streams:
    """A stripe's streams, one array entry per stream."""

    kind: np.ndarray
    column: np.ndarray
    offset: np.ndarray  # absolute, in the file
    length: np.ndarray


@dataclass(frozen=True)
class Tail:
    compression: str
    block_size: int
    length: int  # bytes at the end of the file: footer, postscript, its length byte
    stripes: tuple[Stripe, ...]
    columns: dict[str, range]  # top-level column -> the column ids of its subtree


# -- protobuf wire format ----------------------------------------------------------------

def read_varint(buf: Bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise TableError("truncated ORC metadata (varint runs past the end)")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def read_fields(buf: Bytes) -> Iterator[tuple[int, int, Union[int, Bytes]]]:
    """(field number, wire type, value) of a message: ints for varints, slices for
    length-delimited and fixed-width (8 or 4 bytes) fields; bounds checked."""
    buf = memoryview(buf).cast("B")
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        wire = key & 7
        if wire == 0:
            value, pos = read_varint(buf, pos)
        elif wire in (1, 2, 5):
            if wire == 2:
                size, pos = read_varint(buf, pos)
            else:
                size = 8 if wire == 1 else 4
            value, pos = buf[pos:pos + size], pos + size
            if pos > len(buf):
                raise TableError("truncated ORC metadata (field runs past the end)")
        else:
            raise TableError(f"corrupt ORC metadata (wire type {wire})")
        yield key >> 3, wire, value


def _fields(buf: Bytes) -> Iterator[tuple[int, Union[int, Bytes]]]:
    """(field number, value) of a message's varint and length-delimited fields (the
    fixed-width ones are unused by the messages read here)."""
    return ((field, value) for field, wire, value in read_fields(buf) if wire in (0, 2))


def _uints(value: Union[int, Bytes]) -> list[int]:
    """A repeated integer field entry: one varint, or a packed run of them."""
    if isinstance(value, int):
        return [value]
    out, pos = [], 0
    while pos < len(value):
        v, pos = read_varint(value, pos)
        out.append(v)
    return out


# -- decompression ---------------------------------------------------------------------

def decompress(buf: Bytes, compression: str, block_size: int) -> bytes:
    """Undo ORC's chunked compression: each chunk has a 3-byte little-endian header,
    ``length << 1 | is_original`` (original chunks are stored as is)."""
    if compression == "none":
        return bytes(buf)
    buf = memoryview(buf)
    out, pos = [], 0
    while pos < len(buf):
        if pos + 3 > len(buf):
            raise TableError("truncated ORC compression chunk header")
        header = buf[pos] | buf[pos + 1] << 8 | buf[pos + 2] << 16
        length, original = header >> 1, header & 1
        chunk = buf[pos + 3:pos + 3 + length]
        if len(chunk) != length:
            raise TableError("truncated ORC compression chunk")
        out.append(bytes(chunk) if original else _decompress_chunk(chunk, compression, block_size))
        pos += 3 + length
    return b"".join(out)


def _decompress_chunk(chunk: memoryview, compression: str, block_size: int) -> bytes:
    # pyarrow's codecs need the exact decompressed size (it sizes the output buffer and
    # zstd checks it), so it is read from the chunk's own framing.
    if compression == "zlib":
        return zlib.decompress(chunk, -15)  # raw deflate, no zlib header
    if compression == "snappy":
        return pa.Codec("snappy").decompress(chunk, read_varint(chunk, 0)[0], asbytes=True)
    if compression == "zstd":
        return pa.Codec("zstd").decompress(chunk, _zstd_content_size(chunk), asbytes=True)
    if compression == "lz4":
        return pa.Codec("lz4_raw").decompress(chunk, _lz4_block_size(chunk), asbytes=True)
    raise TableError(f"ORC compression {compression!r} is not supported")


def _zstd_content_size(frame: memoryview) -> int:
    """Frame_Content_Size from a zstd frame header (ORC's writer always records it)."""
    if bytes(frame[:4]) != b"\x28\xb5\x2f\xfd":
        raise TableError("corrupt zstd chunk in ORC metadata")
    descriptor = frame[4]
    fcs_flag, single_segment, dict_flag = descriptor >> 6, (descriptor >> 5) & 1, descriptor & 3
    pos = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[dict_flag]
    width = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if width == 0:
        raise TableError("zstd chunk in ORC metadata without a content size")
    size = int.from_bytes(frame[pos:pos + width], "little")
    return size + 256 if width == 2 else size


def _lz4_block_size(block: memoryview) -> int:
    """The decompressed size of an LZ4 raw block, by walking its sequences (metadata
    blocks are small, so a Python loop over sequences is fine)."""
    pos = size = 0
    n = len(block)
    while pos < n:
        token = block[pos]
        pos += 1
        literals = token >> 4
        if literals == 15:
            while True:
                extra = block[pos]
                pos += 1
                literals += extra
                if extra != 255:
                    break
        pos += literals
        size += literals
        if pos >= n:  # the last sequence has literals only
            break
        pos += 2  # match offset
        match = token & 15
        if match == 15:
            while True:
                extra = block[pos]
                pos += 1
                match += extra
                if extra != 255:
                    break
        size += match + 4
    return size


# -- messages ----------------------------------------------------------------------------

def tail_length(end: Bytes) -> int:
    """How many bytes at the end of the file a reader needs (footer, postscript, its
    length byte), from the file's last bytes (which must hold the PostScript). The
    metadata section before the footer (stripe statistics) is left out: readers use it
    only to skip stripes by predicate, and it grows with stripes x columns."""
    return _postscript(end)[0]


def _postscript(end: Bytes) -> tuple[int, int, int, str, int]:
    """(tail length, postscript length, footer length, compression, block size)."""
    end = memoryview(end)
    if len(end) < 2:
        raise TableError("not an ORC file (too short)")
    ps_length = end[-1]
    if ps_length + 1 > len(end):
        raise TableError("not an ORC file (postscript runs past the start)")
    footer = 0
    compression, block_size, magic = "none", 256 * 1024, b""
    for field, value in _fields(end[-1 - ps_length:-1]):
        if field == 1:
            footer = value
        elif field == 2:
            compression = COMPRESSION.get(value, f"unknown({value})")
        elif field == 3:
            block_size = value
        elif field == 8000:
            magic = bytes(value)
    if magic != b"ORC":
        raise TableError("not an ORC file (no ORC magic in the postscript)")
    return 1 + ps_length + footer, ps_length, footer, compression, block_size


def parse_tail(tail: Bytes) -> Tail:
    """The layout from the file's tail (at least ``tail_length`` bytes from the end)."""
    tail = memoryview(tail)
    length, ps_length, footer_length, compression, block_size = _postscript(tail)
    if length > len(tail):
        raise TableError(f"ORC tail needs {length} bytes, got {len(tail)}")
    end = len(tail) - 1 - ps_length
    footer = decompress(tail[end - footer_length:end], compression, block_size)
    stripes, types = [], []
    for field, value in _fields(footer):
        if field == 3:
            s = dict(_fields(value))
            stripes.append(Stripe(s.get(1, 0), s.get(2, 0), s.get(3, 0), s.get(4, 0), s.get(5, 0)))
        elif field == 4:
            subtypes, names = [], []
            for f, v in _fields(value):
                if f == 2:
                    subtypes += _uints(v)
                elif f == 3:
                    names.append(bytes(v).decode())
            types.append((subtypes, names))
    return Tail(compression, block_size, length, tuple(stripes), _top_level_columns(types))


def _top_level_columns(types: list[tuple[list[int], list[str]]]) -> dict[str, range]:
    if not types:
        raise TableError("ORC footer without a schema")

    def stop(column: int) -> int:  # one past the last id of the subtree (ids are pre-order)
        children = types[column][0]
        return stop(children[-1]) if children else column + 1

    subtypes, names = types[0]
    return {name: range(child, stop(child)) for name, child in zip(names, subtypes)}


def parse_stripe_footer(buf: Bytes, stripe: Stripe, compression: str, block_size: int) -> Streams:
    """The stripe's streams with absolute offsets (streams are stored in the listed order)."""
    raw = decompress(buf, compression, block_size)
    fields = _stream_fields(raw)
    if fields is None:  # not the plain shape the fast path reads: parse message by message
        fields = _stream_fields_slowly(raw)
    kind, column, length = fields
    offset = np.empty(len(length), np.int64)
    if len(length):
        offset[0] = stripe.offset
        np.cumsum(length[:-1], out=offset[1:])
        offset[1:] += stripe.offset
    end = stripe.offset + int(length.sum())
    if end != stripe.footer_offset:
        raise TableError(f"ORC stripe at {stripe.offset}: streams span {end - stripe.offset} bytes, "
                         f"the footer says {stripe.index_length + stripe.data_length}")
    return Streams(kind, column, offset, length)


def _stream_fields_slowly(raw: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = [(s.get(1, 0), s.get(2, 0), s.get(3, 0))
            for s in (dict(_fields(v)) for f, v in _fields(raw) if f == 1)]
    kind, column, length = (np.array(c, np.int64) for c in zip(*rows)) if rows else (np.zeros(0, np.int64),) * 3
    return kind, column, length


def _stream_fields(raw: bytes) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(kind, column, length) of the streams, decoded with numpy: a wide stripe lists
    thousands of streams, too many for a Python loop per split.

    The stream list leads the StripeFooter, and a Stream message holds only varint
    fields, so that prefix is a run of varint pairs: (tag 10, message length), then the
    message's (tag 8 | 16 | 24, kind | column | length) pairs, and so on. All varints of
    the buffer are decoded at once and read as pairs up to the first other tag; message
    lengths are checked against the pairs they cover. None if anything does not fit."""
    data = np.frombuffer(raw, np.uint8)
    last = np.flatnonzero(data < 0x80)  # the last byte of every varint
    if len(last) < 2:
        return None
    first = np.concatenate([[0], last[:-1] + 1])
    size = np.minimum(last - first + 1, 10)
    values = np.zeros(len(first), np.uint64)
    for k in range(int(size.max())):
        has = size > k
        values[has] |= (data[first[has] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    pairs = len(values) // 2
    tags, vals = values[0:2 * pairs:2], values[1:2 * pairs:2].astype(np.int64)
    other = np.flatnonzero(~np.isin(tags, (8, 10, 16, 24)))
    end = int(other[0]) if len(other) else pairs
    tags, vals = tags[:end], vals[:end]
    starts = np.flatnonzero(tags == 10)
    if not len(starts) or starts[0] != 0:
        return None
    # Each message's declared length equals the bytes up to the next message (or the end).
    body = last[2 * starts + 1] + 1
    stop = np.append(first[2 * starts[1:]], first[2 * end] if 2 * end < len(first) else len(data))
    if not np.array_equal(stop - body, vals[starts]):
        return None
    group = np.cumsum(tags == 10) - 1
    out = []
    for tag in (8, 16, 24):
        column = np.zeros(len(starts), np.int64)
        at = tags == tag
        column[group[at]] = vals[at]
        out.append(column)
    return out[0], out[1], out[2]
