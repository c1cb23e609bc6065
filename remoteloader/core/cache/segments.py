"""The on-storage format of the block cache: a segment holds some blocks of one split.

Layout: each block's arrays back to back (every array 64-byte aligned, so a decoded
array is an aligned view of the fetched bytes), then an index footer (JSON, utf-8,
sorted keys), then the footer's length (u32 little endian) and the magic ``RLSEG001``.
A reader fetches the tail once, then only the byte ranges of the blocks it wants.

Every block carries a MAC over the split key, the block key, its canonical descriptor
(kind, rows, arrays' names, dtypes and shapes; not the file offsets, which may move
between writers) and its data bytes, so an edit of the footer is caught as surely as an
edit of the data. Without ``--auth`` it is a plain CRC-32 (storage faults and torn
writes, as HDFS checks blocks: anyone can compute it, and at 2.6 GB/s it costs a cached
read little); with it, HMAC-SHA256 (truncated to 128 bits) under a key derived from the
cluster secret (a block written without the key is rejected). Both run at the speed of
the CPU's own instructions (SHA-NI, CLMUL), about twice blake2b's here. Segments are
read from a shared location others may write, so nothing in a footer is trusted before it
is checked: sizes, dtypes, shapes, offsets and, after the MAC, the sparse offsets' structure.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Union

import numpy as np

from ...columns import Column, DenseColumn, SparseColumn

if TYPE_CHECKING:
    from ...protocol.auth import Credentials

MAGIC = b"RLSEG001"
VERSION = 1
TRAILER = 4 + len(MAGIC)  # footer length (u32 LE) + magic
ALIGN = 64
MAX_FOOTER = 16 << 20  # a footer longer than this is refused unread
MAX_BLOCKS = 100_000
MAX_DIMS = 2
PLAIN, KEYED = "crc32", "hmac-sha256"
_HKDF_INFO = b"remoteloader block cache v1"
_DIGEST = 16  # bytes of the keyed MAC kept
_HEX_MAC = re.compile(r"[0-9a-f]{8}|[0-9a-f]{%d}" % (2 * _DIGEST))  # a CRC-32, or a truncated HMAC
KEY_PATTERN = re.compile(r"[0-9a-z_-][0-9a-z._-]{0,127}")  # no leading '.': never '.', '..' or hidden
# dtype.str of every dtype a block may hold: little endian on storage on any host.
DTYPES = frozenset(np.dtype(t).newbyteorder("<").str for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.float32, np.float64))
# Exactly these fields: an unknown one is an edit (a flipped byte in a field's name).
_FOOTER_FIELDS = {"version", "split", "mac", "key_id", "blocks"}
_BLOCK_FIELDS = {"key", "kind", "rows", "mac", "arrays"}
_ARRAY_FIELDS = {"name", "dtype", "shape", "offset", "length"}
_DENSE_ARRAYS = ("values", "valid")  # the order arrays are written in
_SPARSE_ARRAYS = ("values", "offsets", "weights", "valid")

Buffer = Union[bytes, bytearray, memoryview]


class CorruptBlock(ValueError):
    """A segment or block that fails a check: the message names the segment and block."""


class Unverifiable(ValueError):
    """A keyed segment read without the key: it cannot be checked, so it is a miss, not corrupt."""


class BlockSigner:
    """Computes and checks block MACs. ``plain()`` is a checksum anyone can compute (it
    catches storage faults); ``keyed(secret)`` is a MAC only holders of the cluster
    secret can compute. A keyed signer rejects plain segments (anyone could have written
    them); a plain signer cannot check keyed ones (unverifiable, a miss)."""

    def __init__(self, key: Optional[bytes]):
        self._key = key
        self.scheme = PLAIN if key is None else KEYED
        # Names the key without revealing it, so another cluster's segments read as
        # unverifiable here rather than corrupt (and `verify --delete` leaves them alone).
        self.key_id = None if key is None else hashlib.blake2b(key, digest_size=8, person=b"rlseg-id").hexdigest()

    @classmethod
    def plain(cls) -> "BlockSigner":
        return cls(None)

    @classmethod
    def keyed(cls, secret: bytes) -> "BlockSigner":
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        if not secret:
            raise ValueError("a keyed block signer needs a non-empty secret")
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_HKDF_INFO).derive(bytes(secret))
        return cls(key)

    @classmethod
    def for_credentials(cls, credentials: Optional["Credentials"]) -> "BlockSigner":
        """The signer of a process started with ``--auth`` (keyed by the cluster secret, as
        stored in the key directory) or without it (plain): one derivation for workers,
        the loader and ``remoteloader cache``, so they all agree."""
        return cls.plain() if credentials is None else cls.keyed(credentials.secret_key)

    def check(self, footer: "Footer") -> None:
        """Whether this signer can vouch for ``footer``'s blocks: ``CorruptBlock`` for a
        plain segment under a keyed signer, ``Unverifiable`` for a segment keyed with
        another key (or any key, under a plain signer)."""
        if footer.scheme == self.scheme and footer.key_id == self.key_id:
            return
        if self.scheme == KEYED and footer.scheme == PLAIN:
            raise CorruptBlock(f"{footer.path}: written without the cluster key (plain checksums), rejected")
        raise Unverifiable(f"{footer.path}: blocks keyed with {'another' if self._key else 'a'} key "
                           f"({footer.key_id}), cannot be checked here")

    def mac(self, split_key: str, block: "BlockDesc", data: list[Buffer]) -> str:
        descriptor = json.dumps([split_key, block.key, block.kind, block.rows,
                                 [[a.name, a.dtype, list(a.shape)] for a in block.arrays]],
                                separators=(",", ":")).encode()
        head = struct.pack("<I", len(descriptor)) + descriptor
        if self._key is None:
            crc = zlib.crc32(head)
            for buf in data:
                crc = zlib.crc32(buf, crc)
            return f"{crc:08x}"
        h = hmac.new(self._key, head, hashlib.sha256)
        for buf in data:
            h.update(buf)
        return h.hexdigest()[:2 * _DIGEST]


@dataclass(frozen=True)
class ArrayDesc:
    name: str
    dtype: str  # numpy dtype.str, little endian
    shape: tuple[int, ...]
    offset: int  # absolute in the segment file
    length: int


@dataclass(frozen=True)
class BlockDesc:
    key: str
    kind: str  # "dense" | "sparse"
    rows: int
    arrays: tuple[ArrayDesc, ...]
    mac: str

    @property
    def start(self) -> int:
        return min((a.offset for a in self.arrays), default=0)

    @property
    def end(self) -> int:
        return max((a.offset + a.length for a in self.arrays), default=0)


@dataclass(frozen=True)
class Footer:
    path: str  # for messages
    split_key: str
    scheme: str
    key_id: Optional[str]
    blocks: dict[str, BlockDesc]
    nbytes: int  # footer JSON + trailer


# -- writing ---------------------------------------------------------------------------


def _arrays(column: Column) -> list[tuple[str, np.ndarray]]:
    if isinstance(column, DenseColumn):
        named = [("values", column.values), ("valid", column.valid)]
    elif isinstance(column, SparseColumn):
        named = [("values", column.values), ("offsets", column.offsets), ("weights", column.weights),
                 ("valid", column.valid)]
    else:
        raise TypeError(f"a block is a DenseColumn or SparseColumn, not {type(column).__name__}")
    return [(name, _stored(name, a)) for name, a in named if a is not None]


def _stored(name: str, array: np.ndarray) -> np.ndarray:
    """``array`` as written: little endian and C-contiguous (a copy only when it is not)."""
    array = np.asarray(array)
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder != "|" else array.dtype
    if dtype.str not in DTYPES or array.ndim > MAX_DIMS:
        raise ValueError(f"array {name!r}: dtype {array.dtype} / {array.ndim} dims cannot be cached")
    return np.ascontiguousarray(array, dtype=dtype)


def _bytes_of(array: np.ndarray) -> memoryview:
    return memoryview(array.reshape(-1).view(np.uint8))


def encode_segment(split_key: str, blocks: Mapping[str, Column], signer: BlockSigner) -> list[Buffer]:
    """A segment of ``blocks`` as buffers to write in order (the arrays' own memory, no
    copy; ``b"".join`` them for one bytes object). Blocks are written sorted by key."""
    check_key(split_key, "split key")
    pieces: list[Buffer] = []
    descs = []
    pos = 0
    for key in sorted(blocks):
        check_key(key, "block key")
        column = blocks[key]
        kind = "dense" if isinstance(column, DenseColumn) else "sparse"
        arrays, data = [], []
        for name, array in _arrays(column):
            pad = -pos % ALIGN
            if pad:
                pieces.append(bytes(pad))
                pos += pad
            buf = _bytes_of(array)
            arrays.append(ArrayDesc(name, array.dtype.str, tuple(int(n) for n in array.shape), pos, buf.nbytes))
            pieces.append(buf)
            data.append(buf)
            pos += buf.nbytes
        desc = BlockDesc(key, kind, len(column), tuple(arrays), "")
        descs.append(BlockDesc(key, kind, desc.rows, desc.arrays, signer.mac(split_key, desc, data)))
    footer = {"version": VERSION, "split": split_key, "mac": signer.scheme, "key_id": signer.key_id,
              "blocks": [{"key": d.key, "kind": d.kind, "rows": d.rows, "mac": d.mac,
                          "arrays": [{"name": a.name, "dtype": a.dtype, "shape": list(a.shape), "offset": a.offset,
                                      "length": a.length} for a in d.arrays]} for d in descs]}
    raw = json.dumps(footer, sort_keys=True, separators=(",", ":")).encode()
    pieces += [raw, struct.pack("<I", len(raw)), MAGIC]
    return pieces


def check_key(key: str, what: str) -> None:
    """Keys become paths and footer entries: only ``[0-9a-z._-]``, at most 128, no leading dot."""
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise ValueError(f"invalid {what} {key!r}: expected 1-128 characters of [0-9a-z._-], not starting with '.'")


# -- reading ---------------------------------------------------------------------------


def footer_length(tail: Buffer, size: int, path: str) -> int:
    """How many bytes at the end of the file the footer and trailer take, from the
    file's last bytes ``tail`` (at least ``TRAILER`` of them)."""
    tail = memoryview(tail)
    if size < TRAILER or len(tail) < TRAILER or bytes(tail[-len(MAGIC):]) != MAGIC:
        raise CorruptBlock(f"{path}: not a segment (no {MAGIC.decode()} trailer)")
    (length,) = struct.unpack("<I", tail[-TRAILER:-len(MAGIC)])
    if length > MAX_FOOTER or length + TRAILER > size:
        raise CorruptBlock(f"{path}: footer of {length} bytes does not fit (file {size} bytes, at most {MAX_FOOTER})")
    return length + TRAILER


def read_footer(tail: Buffer, size: int, path: str) -> Footer:
    """The checked footer of a segment of ``size`` bytes from its last bytes ``tail``
    (at least ``footer_length`` of them). Offsets and lengths are checked to lie in the
    data part of the file; MACs are checked per block by ``decode_block``."""
    total = footer_length(tail, size, path)
    tail = memoryview(tail)
    if len(tail) < total:
        raise CorruptBlock(f"{path}: footer needs {total} bytes, given {len(tail)}")
    try:
        doc = json.loads(bytes(tail[len(tail) - total:len(tail) - TRAILER]).decode("utf-8"))
        return _footer(doc, size - total, path, total)
    except CorruptBlock:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:  # RecursionError: [[[[...
        raise CorruptBlock(f"{path}: bad footer: {e}") from None


def _footer(doc: dict, data_end: int, path: str, nbytes: int) -> Footer:
    _expect(isinstance(doc, dict) and doc.keys() == _FOOTER_FIELDS and doc["version"] == VERSION, path, "",
            "not a version 1 footer")
    split_key, scheme, key_id, entries = doc["split"], doc["mac"], doc["key_id"], doc["blocks"]
    _expect(isinstance(split_key, str) and KEY_PATTERN.fullmatch(split_key) is not None, path, "", "bad split key")
    _expect(scheme in (PLAIN, KEYED) and (key_id is None) == (scheme == PLAIN)
            and (key_id is None or isinstance(key_id, str)), path, "", "bad MAC scheme")
    _expect(isinstance(entries, list) and len(entries) <= MAX_BLOCKS, path, "", "bad block list")
    blocks: dict[str, BlockDesc] = {}
    for entry in entries:
        desc = _block(entry, data_end, path)
        _expect(desc.key not in blocks, path, desc.key, "listed twice")
        blocks[desc.key] = desc
    return Footer(path, split_key, scheme, key_id, blocks, nbytes)


def _block(entry: dict, data_end: int, path: str) -> BlockDesc:
    _expect(isinstance(entry, dict) and entry.keys() == _BLOCK_FIELDS, path, "", "a block entry is not one")
    key, kind, rows, mac, arrays = entry["key"], entry["kind"], entry["rows"], entry["mac"], entry["arrays"]
    _expect(isinstance(key, str) and KEY_PATTERN.fullmatch(key) is not None, path, str(key)[:130], "bad block key")
    _expect(kind in ("dense", "sparse") and _is_count(rows) and isinstance(mac, str) and _HEX_MAC.fullmatch(mac) is not None,
            path, key, "bad kind, rows or mac")
    _expect(isinstance(arrays, list) and len(arrays) <= len(_SPARSE_ARRAYS), path, key, "bad array list")
    descs = tuple(_array(a, data_end, path, key) for a in arrays)
    names = [a.name for a in descs]
    allowed = _DENSE_ARRAYS if kind == "dense" else _SPARSE_ARRAYS
    _expect(names == [n for n in allowed if n in names] and "values" in names
            and (kind == "dense" or "offsets" in names), path, key, f"bad arrays {names} for a {kind} block")
    desc = BlockDesc(key, kind, rows, descs, mac)
    _check_shapes(desc, path)
    return desc


def _array(entry: dict, data_end: int, path: str, key: str) -> ArrayDesc:
    _expect(isinstance(entry, dict) and entry.keys() == _ARRAY_FIELDS, path, key, "an array entry is not one")
    name, dtype, shape, offset, length = (entry["name"], entry["dtype"], entry["shape"], entry["offset"],
                                          entry["length"])
    _expect(name in _SPARSE_ARRAYS and dtype in DTYPES, path, key, f"array {name!r}: dtype {dtype!r} not allowed")
    _expect(isinstance(shape, list) and 1 <= len(shape) <= MAX_DIMS and all(_is_count(n) for n in shape),
            path, key, f"array {name!r}: bad shape")
    _expect(_is_count(offset) and _is_count(length) and offset + length <= data_end, path, key,
            f"array {name!r} outside the data")
    _expect(int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize == length, path, key,
            f"array {name!r}: shape {shape} x {dtype} is not {length} bytes")
    return ArrayDesc(name, dtype, tuple(shape), offset, length)


def _check_shapes(desc: BlockDesc, path: str) -> None:
    """Shapes and dtypes the footer alone can check (the offsets' values wait for the data)."""
    a = {x.name: x for x in desc.arrays}
    values, rows = a["values"], desc.rows
    if "valid" in a:
        _expect(a["valid"].shape == (rows,) and a["valid"].dtype == "|b1", path, desc.key, "valid is not bool[rows]")
    if desc.kind == "dense":
        _expect(values.shape[0] == rows, path, desc.key, "dense values do not have one entry per row")
        return
    _expect(len(values.shape) == 1, path, desc.key, "sparse values are not 1-D")
    _expect(a["offsets"].shape == (rows + 1,) and a["offsets"].dtype == "<i8", path, desc.key,
            "offsets are not int64[rows + 1]")
    if "weights" in a:
        _expect(a["weights"].shape == values.shape, path, desc.key, "weights do not match values")


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62


def _expect(ok: bool, path: str, key: str, what: str) -> None:
    if not ok:
        raise CorruptBlock(f"{path}: block {key!r}: {what}" if key else f"{path}: {what}")


def decode_block(footer: Footer, key: str, data: Buffer, signer: BlockSigner) -> Column:
    """Block ``key`` of ``footer``'s segment from ``data``, the file's bytes
    ``[desc.start, desc.end)``: its MAC checked, then its structure. The arrays are
    read-only views of ``data`` (no copy). ``CorruptBlock`` / ``Unverifiable`` otherwise."""
    signer.check(footer)
    desc = footer.blocks[key]
    data = memoryview(data)
    _expect(len(data) == desc.end - desc.start, footer.path, key, "fetched bytes do not match the block")
    views = [data[a.offset - desc.start:a.offset - desc.start + a.length] for a in desc.arrays]
    if not hmac.compare_digest(signer.mac(footer.split_key, desc, views), desc.mac):
        raise CorruptBlock(f"{footer.path}: block {key!r}: MAC mismatch")
    arrays = {a.name: np.frombuffer(v, dtype=a.dtype).reshape(a.shape) for a, v in zip(desc.arrays, views)}
    for array in arrays.values():
        array.flags.writeable = False  # a view of shared fetched bytes: columns are never mutated
    valid = arrays.get("valid")
    _expect(valid is None or not valid.size or int(valid.view(np.uint8).max()) <= 1, footer.path, key,
            "valid holds bytes other than 0 and 1")
    if desc.kind == "dense":
        return DenseColumn(arrays["values"], valid)
    offsets = arrays["offsets"]
    _expect(int(offsets[0]) == 0 and int(offsets[-1]) == len(arrays["values"])
            and not bool(np.any(offsets[1:] < offsets[:-1])), footer.path, key,
            "offsets are not non-decreasing from 0 to len(values)")
    return SparseColumn(arrays["values"], offsets, arrays.get("weights"), valid)
