"""Sealed data frames (issue 26 part 2): with cluster keys, a worker's data socket is a plain
socket whose every message is sealed (protocol/seal.py). Unit tests of derive/seal/open,
rotation and bounds; a keyless peer gets nothing; replayed, reordered and bit-flipped
batch messages are refused and counted while the epoch stays exactly once; no (key, nonce)
pair repeats across a worker restart and a master restart (real processes)."""
from __future__ import annotations

import glob
import threading
import time
from collections import Counter
from unittest import mock

import numpy as np
import pytest
import zmq

from remoteloader import RemoteDataLoader
from remoteloader.master.server import MasterServer
from remoteloader.master.service import MasterConfig, MasterService
from remoteloader.protocol import auth, seal
from remoteloader.protocol import messages as M
from remoteloader.protocol import wire
from remoteloader.protocol.capability import MasterKeys, SessionTokens
from remoteloader.worker.faults import Faults

from .conftest import ROWS, spec_dict
from .test_worker_fakes import RunningWorker


@pytest.fixture(autouse=True)
def _no_ambient_keys(monkeypatch):
    monkeypatch.delenv(auth.ENV_AUTH, raising=False)


def _pair(rotate_frames=None, cipher=None):
    """A worker's and a client's books for one session and worker."""
    w, c = seal.KeyPair(), seal.KeyPair()
    worker = seal.PeerBook(w, seal.TO_CLIENT, seal.TO_WORKER, cipher=cipher, rotate_frames=rotate_frames)
    client = seal.PeerBook(c, seal.TO_WORKER, seal.TO_CLIENT, cipher=cipher, rotate_frames=rotate_frames)
    return worker.peer("s-1", "w-1", c.public_hex), client.peer("s-1", "w-1", w.public_hex)


def _message(peer, arrays):
    frames = [memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays]
    parts = peer.sealer.seal_frames(lambda gen, nonce: f"{gen}:{nonce}".encode(), frames)
    gen, nonce = map(int, parts[0].decode().split(":"))
    return parts, gen, nonce, [f.nbytes for f in frames]


# -- unit tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cipher", [seal.AES_GCM, seal.CHACHA])
def test_seal_and_open_round_trip_and_keys_differ_by_every_input(cipher):
    worker, client = _pair(cipher=cipher)
    data = [np.arange(100, dtype=np.int64), np.linspace(0, 1, 7, dtype=np.float32), np.zeros(0, np.int32)]
    parts, gen, nonce, sizes = _message(worker, data)
    assert all(len(p) == s + seal.TAG_BYTES for p, s in zip(parts[1:], sizes))
    assert bytes(parts[1][:800]) != data[0].tobytes()  # encrypted
    opened = client.opener.open(parts[0], gen, nonce, parts[1:], sizes)
    for a, b in zip(data, opened):
        assert b.tobytes() == a.tobytes()
    shared = b"\x01" * 32
    base = seal.derive(shared, "s-1", seal.TO_CLIENT, "w-1", 0)
    assert len({base, seal.derive(shared, "s-2", seal.TO_CLIENT, "w-1", 0),
                seal.derive(shared, "s-1", seal.TO_WORKER, "w-1", 0),
                seal.derive(shared, "s-1", seal.TO_CLIENT, "w-2", 0),
                seal.derive(shared, "s-1", seal.TO_CLIENT, "w-1", 1)}) == 5
    # credit: no frames, one sealed empty frame (a tag over the header)
    parts = client.sealer.seal_frames(lambda g, n: f"{g}:{n}".encode(), [])
    assert len(parts) == 2 and len(parts[1]) == seal.TAG_BYTES
    g, n = map(int, parts[0].decode().split(":"))
    assert [len(b) for b in worker.opener.open(parts[0], g, n, parts[1:], [0])] == [0]


def test_replays_reorders_forgeries_bounds_and_unknown_keys_are_refused_leaving_the_state_as_it_was():
    worker, client = _pair()
    a = _message(worker, [np.arange(10, dtype=np.int64)])
    b = _message(worker, [np.arange(20, dtype=np.int64)])
    parts, gen, nonce, sizes = b
    flipped = bytearray(parts[1])
    flipped[3] ^= 1

    def refused(reason, header, g, n, frames, sz):
        with pytest.raises(seal.SealError) as e:
            client.opener.open(header, g, n, frames, sz)
        assert e.value.reason == reason

    refused(seal.FORGED, parts[0], gen, nonce, [bytes(flipped)], sizes)  # a bit flipped in the frame
    refused(seal.FORGED, parts[0] + b" ", gen, nonce, parts[1:], sizes)  # the header (associated data) altered
    refused(seal.BOUNDS, parts[0], gen, nonce, parts[1:], [sizes[0] + 8])  # declared size off
    refused(seal.BOUNDS, parts[0], gen, nonce, parts[1:], [seal.MAX_FRAME_BYTES + 1])
    refused(seal.BOUNDS, parts[0], gen, nonce, [], [])
    refused(seal.UNKNOWN_KEY, parts[0], seal.MAX_GEN_SKIP + 1, nonce, parts[1:], sizes)
    client.opener.open(parts[0], gen, nonce, parts[1:], sizes)  # the genuine one, after all that: accepted
    refused(seal.REPLAY, parts[0], gen, nonce, parts[1:], sizes)  # replayed
    refused(seal.REPLAY, a[0][0], a[1], a[2], a[0][1:], a[3])  # reordered: an older counter after a newer one
    # a forged message with a fresh counter is refused and does not move the state
    refused(seal.FORGED, parts[0], gen, nonce + 5, [bytes(flipped)], sizes)
    c = _message(worker, [np.arange(3, dtype=np.int64)])
    client.opener.open(c[0][0], c[1], c[2], c[0][1:], c[3])


def test_counters_never_repeat_and_keys_rotate_at_the_injected_threshold():
    worker, client = _pair(rotate_frames=3)
    seen = set()
    for i in range(10):
        parts, gen, nonce, sizes = _message(worker, [np.arange(i + 1, dtype=np.int32), np.ones(2, np.float32)])
        assert (gen, nonce) not in seen and (gen, nonce + 1) not in seen
        seen |= {(gen, nonce), (gen, nonce + 1)}
        client.opener.open(parts[0], gen, nonce, parts[1:], sizes)
    assert worker.sealer.generation >= 5 and client.opener.generation == worker.sealer.generation
    with pytest.raises(seal.SealError) as e:  # a message of a retired generation
        client.opener.open(b"h", 0, 10 ** 9, [b"\x00" * 16], [0])
    assert e.value.reason == seal.UNKNOWN_KEY


def test_cipher_choice_follows_the_cpu_and_can_be_overridden(tmp_path, monkeypatch):
    with_aes, without = tmp_path / "a", tmp_path / "b"
    with_aes.write_text("processor\t: 0\nflags\t\t: fpu sse2 aes avx2\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    assert seal.cpu_has_aes(str(with_aes)) and not seal.cpu_has_aes(str(without))
    monkeypatch.setenv(seal.ENV_CIPHER, seal.CHACHA)
    assert seal.default_cipher() == seal.CHACHA
    monkeypatch.setenv(seal.ENV_CIPHER, seal.AES_GCM)
    assert seal.default_cipher() == seal.AES_GCM
    monkeypatch.setenv(seal.ENV_CIPHER, "aes-cbc")  # a misspelt choice is an error, not another cipher
    with pytest.raises(ValueError, match=seal.ENV_CIPHER):
        seal.default_cipher()


def test_a_session_token_binds_the_sessions_key():
    keys, tokens = MasterKeys.ephemeral(), SessionTokens()
    tokens.set_master(keys.verify_key)
    mine, other = seal.KeyPair().public_hex, seal.KeyPair().public_hex
    token = keys.session_token("s-1", mine)
    assert tokens.allows(b"c", "s-1", token, mine)
    assert not tokens.allows(b"d", "s-1", token, other)  # replayed with another key
    assert not tokens.allows(b"d", "s-1", token)


def test_refusals_are_counted_and_logged_once_per_n(caplog):
    r = seal.Refusals(every=10)
    for _ in range(25):
        r.refuse("worker w-1", seal.SealError(seal.REPLAY, "x"), "batch")
    assert r.total == 25
    assert sum("worker w-1" in m for m in caplog.messages) == 3  # the 1st, 10th and 20th


# -- in-process keyed cluster ---------------------------------------------------------------------------
class KeyedCluster:
    """A master (CURVE) and workers on threads of this process, with cluster keys."""

    def __init__(self, keys: str, **worker_args) -> None:
        self.creds = auth.load(keys)
        self.service = MasterService(MasterConfig(heartbeat_timeout=2.0))
        self.server = MasterServer(self.service, "tcp://127.0.0.1:0", auth=self.creds)
        self.addr = self.server.addr
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        self.ctx = zmq.Context()
        with mock.patch.object(zmq.Context, "instance", return_value=self.ctx):
            self.worker = RunningWorker(self.addr, auth=self.creds, **worker_args)

    def stop(self) -> None:
        try:
            if self.worker.thread.is_alive():
                self.worker.stop()
            self.ctx.destroy(linger=0)
        finally:
            self.server.stop_event.set()
            self._thread.join(10)
        assert self.worker.error is None


@pytest.fixture
def keyed(keys):
    made = []

    def make(**worker_args):
        made.append(KeyedCluster(keys, **worker_args))
        return made[-1]

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def keys(tmp_path):
    return str(auth.keygen(tmp_path / "keys"))


def _epoch(loader) -> Counter:
    return Counter(rid for b in loader for rid in b.passthrough["row_id"].tolist())


def _silent(addr: str, parts: list, wait_ms: int = 500) -> bool:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    try:
        sock.send_multipart(parts)
        return not sock.poll(wait_ms)
    finally:
        sock.close(linger=0)


def test_a_keyless_peer_gets_nothing_from_a_workers_data_socket(tables, keyed):
    cluster = keyed()
    with RemoteDataLoader(spec_dict(tables["orc"]), master=cluster.addr, auth=cluster.creds.directory,
                          timeout=60) as loader:
        seen = _epoch(loader)
        assert len(seen) == ROWS and set(seen.values()) == {1}
        session, token = loader.session.id, loader.session.token
        key = loader.session.seals.pair.public_hex
        worker = cluster.worker.worker
        mine = seal.KeyPair()
        before = worker.seals.refused
        # no token, a made-up token, the real token with the peer's own key, an unsealed credit
        for token_tried, key_tried in (("", ""), ("00" * 64, mine.public_hex), (token, mine.public_hex), (token, key)):
            credit = M.Credit(session=session, token=token_tried, seq=1, pieces=8, bytes=1 << 24, key=key_tried)
            assert _silent(worker.addr, wire.encode(credit))
        # the real token and key, sealed with a key of its own: the tag does not verify
        peer = seal.PeerBook(mine, seal.TO_WORKER, seal.TO_CLIENT).peer(session, worker.current.get().worker_id,
                                                                       worker.pair.public_hex)
        credit = M.Credit(session=session, token=token, seq=1, pieces=8, bytes=1 << 24, key=key)

        def header(gen, nonce):
            credit.gen, credit.nonce = gen, nonce
            return wire.encode(credit)[0]

        assert _silent(worker.addr, peer.sealer.seal_frames(header, []))
        deadline = time.monotonic() + 30  # a guard against a hang, not a timing
        while worker.seals.refused < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.seals.refused >= before + 2  # the unsealed one and the forged one were counted
        seen = _epoch(loader)  # the session itself is still served
        assert len(seen) == ROWS and set(seen.values()) == {1}


@pytest.mark.parametrize("tamper", ["replay", "reorder", "flip"])
def test_tampered_copies_are_refused_counted_and_the_epoch_stays_exactly_once(tables, keyed, tamper):
    cluster = keyed(faults=Faults(seal_tamper=tamper, tamper_every=2))
    with RemoteDataLoader(spec_dict(tables["orc"], batch_size=64), master=cluster.addr,
                          auth=cluster.creds.directory, timeout=60) as loader:
        epochs = 2
        for _ in range(epochs):
            seen = _epoch(loader)
            assert len(seen) == ROWS and set(seen.values()) == {1}
        refused = loader.session.seals.refusals.total
    tampered = cluster.worker.worker.faults.tampered
    assert tampered > 0 and refused > 0
    # Every copy the client opened was refused. Up to two per epoch are never opened: copies
    # of an epoch's last messages that arrive once the client reads the next run (dropped
    # unopened as another run's) or has closed (CI saw 25 refused of 27 with reorder).
    assert refused >= tampered - 2 * epochs, (refused, tampered)


def test_a_replayed_credit_from_another_connection_is_refused(tables, keyed):
    """A captured genuine credit, sent again from another connection, takes nothing."""
    cluster = keyed()
    worker = cluster.worker.worker
    captured = []
    real = worker.pusher.on_request

    def capture(parts):
        captured.append([p.bytes for p in parts[1:]])
        real(parts)

    worker.pusher.on_request = capture
    with RemoteDataLoader(spec_dict(tables["orc"]), master=cluster.addr, auth=cluster.creds.directory,
                          timeout=60) as loader:
        seen = _epoch(loader)
        assert len(seen) == ROWS and set(seen.values()) == {1}
        before = worker.seals.refused
        assert captured and _silent(worker.addr, captured[-1])
        deadline = time.monotonic() + 30  # a guard against a hang, not a timing
        while worker.seals.refused == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.seals.refused > before


# -- real processes: no (key, nonce) pair repeats across a worker and a master restart --------------------
def test_no_key_nonce_pair_repeats_across_a_worker_and_a_master_restart(tables, cluster, keys, tmp_path, monkeypatch):
    log = str(tmp_path / "nonces")
    monkeypatch.setenv(seal.ENV_NONCE_LOG, log)
    monkeypatch.setenv(seal.ENV_ROTATE_FRAMES, "16")  # rotations happen within the test
    seal._NONCE_LOG.reset()
    try:
        args = ("--auth", keys, "--journal", str(tmp_path / "journal"), "--heartbeat-timeout", "3")
        master = cluster.master(*args, workers=0)
        first = cluster.workers(master.addr, 1, "--auth", keys)
        with RemoteDataLoader(spec_dict(tables["orc"], batch_size=50), master=master.addr, auth=keys,
                              timeout=120) as loader:
            seen = _epoch(loader)
            assert len(seen) == ROWS and set(seen.values()) == {1}
            first[0].kill()  # a worker restart: a new process, new keys
            first[0].wait()
            cluster.workers(master.addr, 1, "--auth", keys)
            seen = _epoch(loader)
            assert len(seen) == ROWS and set(seen.values()) == {1}
            master.kill()  # a master restart on its journal: sessions and worker keys kept
            time.sleep(0.5)
            cluster.master(*args, workers=0, bind=master.addr)
            seen = _epoch(loader)
            assert len(seen) == ROWS and set(seen.values()) == {1}
    finally:
        seal._NONCE_LOG.reset(None)
    pairs = []
    files = glob.glob(log + ".*")
    assert len(files) >= 3  # this process and both workers
    for path in files:
        with open(path) as f:
            pairs += [line.split() for line in f if line.strip()]
    fingerprints = {p[0] for p in pairs}
    assert len(fingerprints) >= 4  # credit and batch keys of two workers, rotated
    assert len(pairs) == len({tuple(p) for p in pairs}), "a (key, nonce) pair repeated"
