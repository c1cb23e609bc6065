"""The on-storage format of the block cache: a segment holds some blocks of one split.

Layout: each block's arrays back to back (every array 64-byte aligned, so a decoded
array is an aligned view of the fetched bytes), then an index footer (JSON, utf-8,
sorted keys), then a fixed trailer: the footer's length and block count (u32 little
endian each), the MAC scheme and key id, the footer's own MAC, and the magic
``RLSEG002``. A reader fetches the tail once, then only the byte ranges of the blocks it
wants.

Every block carries a MAC over the split key, the block key, its canonical descriptor
(kind, rows, arrays' names, dtypes and shapes; not the file offsets, which may move
between writers) and its data bytes, so an edit of the footer is caught as surely as an
edit of the data. Without ``--auth`` it is a plain CRC-32 (storage faults and torn
writes, as HDFS checks blocks: anyone can compute it, and at 2.6 GB/s it costs a cached
read little); with it, HMAC-SHA256 (truncated to 128 bits) under a key derived from the
cluster secret (a block written without the key is rejected). Both run at the speed of
the CPU's own instructions (SHA-NI, CLMUL), about twice blake2b's here. Segments are
read from a shared location others may write, so nothing in a footer is trusted before it
is checked, and nothing is parsed before it is bounded: from the trailer alone, the
footer's length (at most 512 bytes plus 1 KiB per block, 4 MiB in all) and block count
(at most 4,096) and whether this reader can vouch for the scheme and key (a keyed reader
refuses a plain segment, any reader one keyed by another key, both unread); then the
footer's MAC over its bytes; then its nesting (at most the containers its block count
allows) before the JSON parser sees it; then sizes, dtypes, shapes, offsets and, after
each block's MAC, the sparse offsets' structure.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
import sys
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Union

import numpy as np

from ...columns import Column, DenseColumn, SparseColumn

if TYPE_CHECKING:
    from ...protocol.auth import Credentials

MAGIC = b"RLSEG002"
OLD_MAGICS = (b"RLSEG001",)  # format 1: its footer was parsed before its MAC scheme was known
VERSION = 2
# footer length, block count (u32 LE each), scheme, 3 zero bytes, key id (8 bytes, zero
# for a plain segment), the footer's MAC (16 bytes: a CRC-32 and 12 zero bytes, or a
# truncated HMAC-SHA256), then the magic.
_TRAILER = struct.Struct("<IIB3x8s16s")
TRAILER = _TRAILER.size + len(MAGIC)
ALIGN = 64
MAX_BLOCKS = 4096  # blocks in one segment (a job's put of more is cut into several segments)
MAX_ENTRY = 1024  # footer bytes one block's entry may take (its largest is under 900)
FOOTER_BASE = 512  # footer bytes besides the entries (under 300)
MAX_FOOTER = FOOTER_BASE + MAX_BLOCKS * MAX_ENTRY  # 4 MiB: a footer longer than this is refused unread
_CONTAINERS = 2 + MAX_BLOCKS * 10  # a footer's JSON objects and arrays: 2, and per block at most 2 + 4 x 2
MAX_DIMS = 2
PLAIN, KEYED = "crc32", "hmac-sha256"
_SCHEME_CODES = {PLAIN: 1, KEYED: 2}
_SCHEMES = {code: scheme for scheme, code in _SCHEME_CODES.items()}
_FOOTER_DOMAIN = b"rlseg footer v2\0"  # a footer MAC never equals a block MAC
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
_SHARED = {x: x for x in (*_SPARSE_ARRAYS, *DTYPES, "dense", "sparse")}

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
        self.check_scheme(footer.scheme, footer.key_id, footer.path)

    def check_scheme(self, scheme: str, key_id: Optional[str], path: str) -> None:
        """``check`` from a segment's trailer, before its footer is read."""
        if scheme == self.scheme and key_id == self.key_id:
            return
        if self.scheme == KEYED and scheme == PLAIN:
            raise CorruptBlock(f"{path}: written without the cluster key (plain checksums), rejected")
        raise Unverifiable(f"{path}: blocks keyed with {'another' if self._key else 'a'} key "
                           f"({key_id}), cannot be checked here")

    def footer_mac(self, trailer_fields: bytes, footer: Buffer) -> bytes:
        """16 bytes over the trailer's fields and the footer's bytes: a CRC-32 (then zeros)
        without a key, a truncated HMAC-SHA256 with one."""
        if self._key is None:
            return struct.pack("<I", zlib.crc32(footer, zlib.crc32(trailer_fields, zlib.crc32(_FOOTER_DOMAIN)))) \
                + bytes(_DIGEST - 4)
        h = hmac.new(self._key, _FOOTER_DOMAIN, hashlib.sha256)
        h.update(trailer_fields)
        h.update(footer)
        return h.digest()[:_DIGEST]

    def _key_id_bytes(self) -> bytes:
        return bytes(8) if self.key_id is None else bytes.fromhex(self.key_id)

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


_PLAIN = BlockSigner.plain()  # checks a plain footer's checksum, which anyone can compute
_FOOTER_OVERHEAD = 512  # a Footer object, its attribute dict and its key id


@dataclass(frozen=True, slots=True)
class ArrayDesc:
    name: str
    dtype: str  # numpy dtype.str, little endian
    shape: tuple[int, ...]
    offset: int  # absolute in the segment file
    length: int


@dataclass(frozen=True, slots=True)
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
    memory: int = 0  # bytes its objects take in memory (what the footer cache's budget counts)


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
    if len(descs) > MAX_BLOCKS:
        raise ValueError(f"{len(descs)} blocks in one segment: at most {MAX_BLOCKS} (write several segments)")
    footer = {"version": VERSION, "split": split_key, "mac": signer.scheme, "key_id": signer.key_id,
              "blocks": [{"key": d.key, "kind": d.kind, "rows": d.rows, "mac": d.mac,
                          "arrays": [{"name": a.name, "dtype": a.dtype, "shape": list(a.shape), "offset": a.offset,
                                      "length": a.length} for a in d.arrays]} for d in descs]}
    raw = json.dumps(footer, sort_keys=True, separators=(",", ":")).encode()
    if len(raw) > _footer_bound(len(descs)):  # cannot happen with checked keys; never write what readers refuse
        raise ValueError(f"a footer of {len(raw)} bytes for {len(descs)} blocks is over the bound readers enforce")
    fields = _trailer_fields(len(raw), len(descs), signer.scheme, signer._key_id_bytes())
    pieces += [raw, fields, signer.footer_mac(fields, raw), MAGIC]
    return pieces


def _trailer_fields(length: int, blocks: int, scheme: str, key_id: bytes) -> bytes:
    """The trailer but its MAC and magic: what the footer MAC covers besides the footer."""
    return _TRAILER.pack(length, blocks, _SCHEME_CODES[scheme], key_id, b"")[:-_DIGEST]


def _footer_bound(blocks: int) -> int:
    return FOOTER_BASE + blocks * MAX_ENTRY


def check_key(key: str, what: str) -> None:
    """Keys become paths and footer entries: only ``[0-9a-z._-]``, at most 128, no leading dot."""
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise ValueError(f"invalid {what} {key!r}: expected 1-128 characters of [0-9a-z._-], not starting with '.'")


# -- reading ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Trailer:
    """A segment's fixed trailer, read before anything else of it."""

    length: int  # footer bytes
    blocks: int
    scheme: str
    key_id: Optional[str]
    mac: bytes  # the footer's
    fields: bytes  # what the footer MAC covers besides the footer

    @property
    def total(self) -> int:
        """Bytes at the end of the file that footer and trailer take."""
        return self.length + TRAILER


def read_trailer(tail: Buffer, size: int, path: str, signer: Optional[BlockSigner] = None) -> Trailer:
    """The trailer of a segment of ``size`` bytes from its last bytes ``tail`` (at least
    ``TRAILER`` of them), bounded and, given a ``signer``, checked to be one it can vouch
    for, all before a byte of the footer is read: ``CorruptBlock`` for anything out of
    bounds or a plain segment under a keyed signer, ``Unverifiable`` for another key."""
    tail = memoryview(tail)
    if size < TRAILER or len(tail) < TRAILER:
        raise CorruptBlock(f"{path}: not a segment (shorter than its trailer)")
    magic = bytes(tail[-len(MAGIC):])
    if magic in OLD_MAGICS:
        raise CorruptBlock(f"{path}: a segment of an older format ({magic.decode()}), not read")
    if magic != MAGIC:
        raise CorruptBlock(f"{path}: not a segment (no {MAGIC.decode()} trailer)")
    raw = bytes(tail[-TRAILER:-len(MAGIC)])
    length, blocks, code, key_bytes, mac = _TRAILER.unpack(raw)
    scheme = _SCHEMES.get(code)
    if scheme is None or (scheme == PLAIN) != (key_bytes == bytes(8)):
        raise CorruptBlock(f"{path}: bad MAC scheme in the trailer")
    if blocks > MAX_BLOCKS or length > min(MAX_FOOTER, _footer_bound(blocks)) or length + TRAILER > size:
        raise CorruptBlock(f"{path}: a footer of {length} bytes for {blocks} blocks is refused unread (file {size} "
                           f"bytes; at most {MAX_BLOCKS} blocks and {FOOTER_BASE} + {MAX_ENTRY} bytes a block)")
    key_id = None if scheme == PLAIN else key_bytes.hex()
    if signer is not None:
        signer.check_scheme(scheme, key_id, path)
    return Trailer(length, blocks, scheme, key_id, mac, raw[:-_DIGEST])


def footer_length(tail: Buffer, size: int, path: str, signer: Optional[BlockSigner] = None) -> int:
    """How many bytes at the end of the file the footer and trailer take, from the
    file's last bytes ``tail`` (``read_trailer``'s checks first)."""
    return read_trailer(tail, size, path, signer).total


def read_footer(tail: Buffer, size: int, path: str, signer: Optional[BlockSigner] = None) -> Footer:
    """The checked footer of a segment of ``size`` bytes from its last bytes ``tail``
    (at least ``footer_length`` of them). In order, each before the next is looked at:
    the trailer (``read_trailer``: bounds, and whether ``signer`` can vouch for the
    scheme); the footer's MAC over its bytes (with ``signer``; without one, only a plain
    segment's checksum, which anyone can compute); the nesting the block count allows;
    then the JSON and every field. Offsets and lengths are checked to lie in the data part
    of the file; block MACs are checked per block by ``decode_block``."""
    trailer = read_trailer(tail, size, path, signer)
    total = trailer.total
    tail = memoryview(tail)
    if len(tail) < total:
        raise CorruptBlock(f"{path}: footer needs {total} bytes, given {len(tail)}")
    raw = tail[len(tail) - total:len(tail) - TRAILER]
    checker = signer if signer is not None else (_PLAIN if trailer.scheme == PLAIN else None)
    if checker is not None and not hmac.compare_digest(checker.footer_mac(trailer.fields, raw), trailer.mac):
        raise CorruptBlock(f"{path}: footer MAC mismatch")
    data = bytes(raw)
    if data.count(b"{") + data.count(b"[") > 2 + 10 * trailer.blocks:  # nesting and containers, unparsed
        raise CorruptBlock(f"{path}: footer has more objects and arrays than {trailer.blocks} blocks need")
    try:
        doc = json.loads(data.decode("utf-8"))
        return _footer(doc, trailer, size - total, path, total)
    except CorruptBlock:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:  # RecursionError: [[[[...
        raise CorruptBlock(f"{path}: bad footer: {e}") from None


def _footer(doc: dict, trailer: Trailer, data_end: int, path: str, nbytes: int) -> Footer:
    _expect(isinstance(doc, dict) and doc.keys() == _FOOTER_FIELDS and doc["version"] == VERSION, path, "",
            f"not a version {VERSION} footer")
    split_key, scheme, key_id, entries = doc["split"], doc["mac"], doc["key_id"], doc["blocks"]
    _expect(isinstance(split_key, str) and KEY_PATTERN.fullmatch(split_key) is not None, path, "", "bad split key")
    _expect(scheme == trailer.scheme and key_id == trailer.key_id, path, "", "MAC scheme differs from the trailer's")
    _expect(isinstance(entries, list) and len(entries) == trailer.blocks, path, "", "bad block list")
    blocks: dict[str, BlockDesc] = {}
    for entry in entries:
        desc = _block(entry, data_end, path)
        _expect(desc.key not in blocks, path, desc.key, "listed twice")
        blocks[desc.key] = desc
    return Footer(path, split_key, trailer.scheme, trailer.key_id, blocks, nbytes, _memory(path, blocks))


def _memory(path: str, blocks: dict[str, BlockDesc]) -> int:
    """What a footer's objects take in memory (``sys.getsizeof`` of each object it alone
    holds; names, dtypes and kinds are shared constants): its budget in the footer cache."""
    size = sys.getsizeof
    total = _FOOTER_OVERHEAD + size(path) + size(blocks)
    for key, desc in blocks.items():
        total += size(desc) + size(key) + size(desc.mac) + size(desc.rows) + size(desc.arrays)
        for a in desc.arrays:
            total += size(a) + size(a.shape) + size(a.offset) + size(a.length) + sum(size(n) for n in a.shape)
    return total


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
    desc = BlockDesc(key, _SHARED[kind], rows, descs, mac)
    _check_shapes(desc, path)
    return desc


def _array(entry: dict, data_end: int, path: str, key: str) -> ArrayDesc:
    _expect(isinstance(entry, dict) and entry.keys() == _ARRAY_FIELDS, path, key, "an array entry is not one")
    name, dtype, shape, offset, length = (entry["name"], entry["dtype"], entry["shape"], entry["offset"],
                                          entry["length"])
    _expect(name in _SPARSE_ARRAYS and dtype in DTYPES, path, key, f"array {name!r}: dtype {dtype!r} not allowed")
    name, dtype = _SHARED[name], _SHARED[dtype]  # one string of each, not one per entry
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


# -- the footer cache ------------------------------------------------------------------


Refusal = Union[CorruptBlock, Unverifiable]


class FooterCache:
    """Parsed footers by (cache location, segment path), and the segments refused, least
    recently used out past a budget of the bytes their objects take in memory
    (``Footer.memory``; a refusal: its message and a little more), not of their JSON.
    Segments are immutable and never renamed, so a path's footer never changes; a refusal
    is kept per signer (another key may vouch for what this one cannot) and file size, so
    a planted segment costs its trailer's or footer's read once per process, not once per
    lookup."""

    def __init__(self, budget: int):
        self._budget = budget
        self._used = 0
        self._items: OrderedDict[tuple, tuple[Union[Footer, Refusal], int]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Bytes held, as the budget counts them."""
        with self._lock:
            return self._used

    def get(self, key: tuple[str, str]) -> Optional[Footer]:
        item = self._get(key)
        return item if isinstance(item, Footer) else None

    def put(self, key: tuple[str, str], footer: Footer) -> None:
        self._put(key, footer, footer.memory or footer.nbytes)

    def refusal(self, key: tuple[str, str], signer: BlockSigner, size: int) -> Optional[Refusal]:
        """The error that refused this segment (of this size) under this signer before, if any."""
        item = self._get((*key, signer.scheme, signer.key_id, size))
        # A fresh instance to raise: one raised again and again would grow its traceback.
        return type(item)(*item.args) if isinstance(item, (CorruptBlock, Unverifiable)) else None

    def refuse(self, key: tuple[str, str], signer: BlockSigner, size: int, error: Refusal) -> None:
        kept = type(error)(*error.args)  # without the traceback (and the frames it holds)
        self._put((*key, signer.scheme, signer.key_id, size), kept, 256 + sys.getsizeof(str(kept)))

    def _get(self, key: tuple) -> Union[Footer, Refusal, None]:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def _put(self, key: tuple, value: Union[Footer, Refusal], cost: int) -> None:
        with self._lock:
            if key in self._items or cost > self._budget:  # what alone exceeds the budget is not kept
                return
            self._items[key] = (value, cost)
            self._used += cost
            while self._used > self._budget:
                _, (_, old) = self._items.popitem(last=False)
                self._used -= old
