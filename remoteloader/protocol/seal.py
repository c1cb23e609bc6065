"""Sealed data frames between clients and workers (protocol 10, docs/security.md).

With cluster keys, control sockets (the master's ROUTER and every DEALER to it) stay CURVE,
but a worker's data socket is a plain socket whose every message is sealed with an AEAD
(AES-256-GCM through AES-NI, ChaCha20-Poly1305 where the CPU has no AES instructions):
CURVE's XSalsa20-Poly1305 cost about 30% of throughput.

Keys, bound to identities the master vouches for over CURVE:

* each loader session makes an X25519 key pair at ``hello``; ``hello.key`` carries its
  public half and the session token (capability.py) signs the session id *and* that key;
* each worker process makes an X25519 key pair at start; ``register.key`` carries it and
  clients learn it from ``membership`` (``WorkerAddr.key``), over CURVE only;
* both ends compute X25519(shared) and derive, with HKDF-SHA256 (salt: the session id;
  info: ``LABEL``, the direction, the worker id, the generation), one key per session,
  worker, direction (``TO_CLIENT``: batch frames; ``TO_WORKER``: credit) and generation.

A message of ``n`` frames (at least one: credit seals an empty one, i.e. a tag) takes ``n``
consecutive counter values; frame ``i`` is sealed with nonce = generation (32 bits) ||
counter + i (64 bits), and the encoded header, which carries ``gen`` and ``nonce`` (the
first counter), is the associated data. Counters come from one process-wide 64-bit counter
(``_COUNTER``), so a (key, nonce) pair never repeats inside a process however often key
state is dropped and made again; a new process has new keys (a worker's new key pair, a
client's new session), so none repeats across restarts either. The receiver takes a
message only if its generation is the one in force or a newer one (at most
``MAX_GEN_SKIP`` ahead), its first counter is above the last one accepted under that key,
its sizes are within bounds, and every frame's tag verifies; only then does it move its
state. A sender moves to a new generation after ``rotate_frames`` frames or
``rotate_bytes`` bytes under one key (injectable for tests).
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import platform
import struct
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

log = logging.getLogger(__name__)

LABEL = b"remoteloader seal v10"
TO_CLIENT = b"data"  # worker -> client: the tensor frames of batch messages
TO_WORKER = b"credit"  # client -> worker: credit
TAG_BYTES = 16
PUBLIC_BYTES = 32
PUBLIC_HEX = 2 * PUBLIC_BYTES
MAX_GENERATION = (1 << 32) - 1
MAX_COUNTER = (1 << 63) - 1  # msgpack ints the decoder bounds; the nonce field is 64 bits
MAX_GEN_SKIP = 16  # a generation further ahead than this is unknown, not derived
ROTATE_FRAMES = 1 << 32
ROTATE_BYTES = 1 << 36
MAX_FRAME_BYTES = 1 << 30  # as messages.MAX_FRAME_BYTES
ENV_CIPHER = "REMOTELOADER_SEAL_CIPHER"  # aes-gcm | chacha20-poly1305: overrides the CPU check
ENV_NONCE_LOG = "REMOTELOADER_TEST_NONCE_LOG"  # tests: append "fingerprint nonce" per sealed frame
ENV_ROTATE_FRAMES = "REMOTELOADER_TEST_SEAL_ROTATE_FRAMES"  # tests: rotate keys this often (real processes)
# Benchmarks only (benchmarks/auth_cost.py): the data socket as before protocol 10, CURVE and
# unsealed, to compare. Worker and clients must agree.
ENV_DATA_CURVE = "REMOTELOADER_BENCH_DATA_CURVE"
AES_GCM, CHACHA = "aes-gcm", "chacha20-poly1305"
LOG_EVERY = 1000  # a refusal is logged for the first of a peer, then once per this many

# Refusal reasons (the stats count them together)
BOUNDS, REPLAY, FORGED, UNKNOWN_KEY = "bounds", "replay", "forged", "unknown_key"


class SealError(ValueError):
    """A message refused: ``reason`` is one of the refusal reasons."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def cpu_has_aes(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """AES instructions (x86 ``aes`` flag, ARM ``aes`` feature) on Linux; elsewhere assume
    them on x86-64 and 64-bit ARM (every such CPU sold for a decade has them)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features") and "aes" in value.split():
                    return True
        return False
    except OSError:
        return platform.machine().lower() in ("x86_64", "amd64", "arm64", "aarch64")


def data_curve() -> bool:
    return os.environ.get(ENV_DATA_CURVE) == "1"


def default_cipher() -> str:
    chosen = os.environ.get(ENV_CIPHER, "").strip().lower()
    if chosen in (AES_GCM, CHACHA):
        return chosen
    if chosen:  # both ends must agree: a misspelt choice must not quietly become another cipher
        raise ValueError(f"${ENV_CIPHER}={chosen!r}: expected {AES_GCM} or {CHACHA}")
    return AES_GCM if cpu_has_aes() else CHACHA


class KeyPair:
    """An X25519 key pair: a loader session's or a worker process's."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw()
        self.public_hex = self.public.hex()

    def shared(self, peer_hex: str) -> bytes:
        """X25519 with a peer's public key (hex); SealError for a key that is not one."""
        try:
            peer = bytes.fromhex(peer_hex)
            if len(peer) != PUBLIC_BYTES:
                raise ValueError(f"{len(peer)} bytes")
            return self._private.exchange(X25519PublicKey.from_public_bytes(peer))
        except ValueError as e:  # also the all-zero result of a low-order point
            raise SealError(UNKNOWN_KEY, f"not an X25519 public key ({e})") from None


_lock = threading.Lock()
_COUNTER = itertools.count(1)


def take_counters(n: int) -> int:
    """The first of ``n`` consecutive counter values no one in this process had before."""
    with _lock:
        first = next(_COUNTER)
        for _ in range(n - 1):
            next(_COUNTER)
    if first + n - 1 > MAX_COUNTER:
        raise SealError(BOUNDS, "the process's nonce counter is spent")
    return first


def nonce(generation: int, counter: int) -> bytes:
    return struct.pack(">IQ", generation, counter)


def derive(shared: bytes, session: str, direction: bytes, worker_id: str, generation: int) -> bytes:
    """The 32-byte AEAD key of one session, worker, direction and generation."""
    info = b"|".join((LABEL, direction, worker_id.encode(), struct.pack(">I", generation)))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=session.encode(), info=info).derive(shared)


def fingerprint(key: bytes) -> str:
    return hashlib.sha256(b"fingerprint" + key).hexdigest()[:16]


class _NonceLog:
    """Tests only (``$REMOTELOADER_TEST_NONCE_LOG``): every (key fingerprint, nonce) sealed."""

    def __init__(self) -> None:
        self._file: Any = None
        self._checked = False

    def reset(self, path: Optional[str] = "") -> None:
        """Tests: read ``$REMOTELOADER_TEST_NONCE_LOG`` again at the next seal (None: log nothing)."""
        with _lock:
            if self._file is not None:
                self._file.close()
            self._file, self._checked = None, path is None

    def write(self, key_fp: str, generation: int, first: int, n: int) -> None:
        if not self._checked:
            self._checked = True
            path = os.environ.get(ENV_NONCE_LOG)
            if path:
                self._file = open(f"{path}.{os.getpid()}", "a", buffering=1)
        if self._file is not None:
            with _lock:
                self._file.write("".join(f"{key_fp} {generation}:{first + i}\n" for i in range(n)))


_NONCE_LOG = _NonceLog()


def _aead(cipher: str, key: bytes) -> Any:
    return AESGCM(key) if cipher == AES_GCM else ChaCha20Poly1305(key)


class Sealer:
    """The sending side of one key (session, worker, direction): generation, rotation, sealing."""

    def __init__(self, shared: bytes, session: str, worker_id: str, direction: bytes, cipher: Optional[str] = None,
                 rotate_frames: Optional[int] = None, rotate_bytes: Optional[int] = None) -> None:
        self._shared, self._session, self._worker_id, self._direction = shared, session, worker_id, direction
        self.cipher = cipher or default_cipher()
        self.rotate_frames = rotate_frames or int(os.environ.get(ENV_ROTATE_FRAMES) or ROTATE_FRAMES)
        self.rotate_bytes = rotate_bytes or ROTATE_BYTES
        self.generation = -1
        self._frames = self._bytes = 0
        self._rotate()

    def _rotate(self) -> None:
        if self.generation >= MAX_GENERATION:
            raise SealError(BOUNDS, "every key generation is spent")
        self.generation += 1
        key = derive(self._shared, self._session, self._direction, self._worker_id, self.generation)
        self._aead, self.key_fingerprint = _aead(self.cipher, key), fingerprint(key)
        self._frames = self._bytes = 0

    def reserve(self, frames: int, nbytes: int) -> tuple[int, int]:
        """(generation, first counter) for a message of ``frames`` frames (at least one) and
        ``nbytes`` bytes; rotates first when the key would pass its limits."""
        frames = max(1, frames)
        if self._frames and (self._frames + frames > self.rotate_frames or self._bytes + nbytes > self.rotate_bytes):
            self._rotate()
        self._frames += frames
        self._bytes += nbytes
        first = take_counters(frames)
        _NONCE_LOG.write(self.key_fingerprint, self.generation, first, frames)
        return self.generation, first

    def seal(self, generation: int, counter: int, aad: bytes, frame: Any) -> np.ndarray:
        """``frame`` encrypted, its tag appended (a new buffer; the frame is not touched)."""
        view = memoryview(frame).cast("B") if not isinstance(frame, bytes) else frame
        out = np.empty(len(view) + TAG_BYTES, dtype=np.uint8)
        if generation != self.generation:
            raise SealError(UNKNOWN_KEY, f"generation {generation} is not the one in force")
        self._aead.encrypt_into(nonce(generation, counter), view, aad, out)
        return out

    def seal_frames(self, make_header: Callable[[int, int], bytes], frames: Sequence[Any]) -> list:
        """A whole message: the header (made with its generation and first counter) and its
        sealed frames (one sealed empty frame, a tag, when there are none)."""
        sizes = [memoryview(f).nbytes for f in frames]
        generation, first = self.reserve(len(frames), sum(sizes))
        header = make_header(generation, first)
        body = frames if frames else [b""]
        return [header, *(self.seal(generation, first + i, header, f) for i, f in enumerate(body))]


class Opener:
    """The receiving side of one key: refuses replays, reorders, forgeries and bad sizes."""

    def __init__(self, shared: bytes, session: str, worker_id: str, direction: bytes,
                 cipher: Optional[str] = None) -> None:
        self._shared, self._session, self._worker_id, self._direction = shared, session, worker_id, direction
        self.cipher = cipher or default_cipher()
        self.generation = 0
        self.last = 0  # the last counter accepted under ``generation`` (counters start at 1)
        self._keys: dict[int, Any] = {}

    def _key(self, generation: int) -> Any:
        aead = self._keys.get(generation)
        if aead is None:
            aead = _aead(self.cipher, derive(self._shared, self._session, self._direction, self._worker_id, generation))
            self._keys = {g: k for g, k in self._keys.items() if g >= self.generation}
            self._keys[generation] = aead
        return aead

    def open(self, aad: bytes, generation: int, first: int, frames: Sequence[Any], sizes: Sequence[int]) -> list:
        """The plaintext of each frame (``sizes``: the bytes the header declares for each);
        SealError, with the state unchanged, for anything off. Checks sizes and counters
        before any allocation beyond one frame's declared bound."""
        n = len(frames)
        if n == 0 or n != len(sizes):
            raise SealError(BOUNDS, f"{n} sealed frames for {len(sizes)} declared")
        for frame, size in zip(frames, sizes):
            if not 0 <= size <= MAX_FRAME_BYTES or memoryview(frame).nbytes != size + TAG_BYTES:
                raise SealError(BOUNDS, f"a frame of {memoryview(frame).nbytes} bytes where {size} + tag are declared")
        if generation < self.generation or generation > self.generation + MAX_GEN_SKIP \
                or generation > MAX_GENERATION:
            raise SealError(UNKNOWN_KEY, f"generation {generation} (in force: {self.generation})")
        if not 0 < first <= MAX_COUNTER - n + 1:
            raise SealError(BOUNDS, f"counter {first}")
        if generation == self.generation and first <= self.last:
            raise SealError(REPLAY, f"counter {first} not above {self.last}")
        aead = self._key(generation)
        out = []
        try:
            for i, (frame, size) in enumerate(zip(frames, sizes)):
                buf = np.empty(size, dtype=np.uint8)
                aead.decrypt_into(nonce(generation, first + i), frame, aad, buf)
                out.append(buf)
        except InvalidTag:
            raise SealError(FORGED, "a tag does not verify") from None
        if generation != self.generation:
            self.generation, self.last = generation, 0
        self.last = first + n - 1
        return out


class Refusals:
    """Counted refusals and their log lines: the first of a peer, then one per ``every``."""

    def __init__(self, every: int = LOG_EVERY, max_peers: int = 1 << 12) -> None:
        self.total = 0
        self.every = every
        self._by_peer: OrderedDict[str, int] = OrderedDict()
        self._max_peers = max_peers

    def refuse(self, peer: str, error: SealError, what: str) -> None:
        self.total += 1
        count = self._by_peer.pop(peer, 0) + 1
        self._by_peer[peer] = count
        if len(self._by_peer) > self._max_peers:
            self._by_peer.popitem(last=False)
        if count == 1 or count % self.every == 0:
            log.warning("refused a sealed %s from %s (%s; %d from it so far)", what, peer, error, count)


class Peer:
    """Both directions between this end and one peer, for one session and worker."""

    __slots__ = ("sealer", "opener", "peer_key")

    def __init__(self, sealer: Sealer, opener: Opener, peer_key: str) -> None:
        self.sealer, self.opener, self.peer_key = sealer, opener, peer_key


class PeerBook:
    """This end's key pair and its peers, keyed by (session, worker id, the peer's public key);
    bounded, oldest out first (a peer made again starts a new generation 0 state, and the
    process-wide counter keeps its nonces new)."""

    def __init__(self, pair: KeyPair, sending: bytes, receiving: bytes, max_peers: int = 1 << 14,
                 cipher: Optional[str] = None, rotate_frames: Optional[int] = None,
                 rotate_bytes: Optional[int] = None) -> None:
        self.pair, self.sending, self.receiving = pair, sending, receiving
        self.max_peers, self.cipher = max_peers, cipher or default_cipher()
        self.rotate_frames, self.rotate_bytes = rotate_frames, rotate_bytes
        self._peers: OrderedDict[tuple[str, str, str], Peer] = OrderedDict()
        self.refusals = Refusals()

    def peer(self, session: str, worker_id: str, peer_key: str) -> Peer:
        """SealError (unknown_key) for a peer key that is not an X25519 public key."""
        index = (session, worker_id, peer_key)
        peer = self._peers.get(index)
        if peer is None:
            shared = self.pair.shared(peer_key)
            peer = Peer(Sealer(shared, session, worker_id, self.sending, self.cipher, self.rotate_frames,
                               self.rotate_bytes),
                        Opener(shared, session, worker_id, self.receiving, self.cipher), peer_key)
            self._peers[index] = peer
            if len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(index)
        return peer
