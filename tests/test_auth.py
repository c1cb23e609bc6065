"""CURVE on every socket (issue 11, item 1): a peer without the cluster key gets nothing."""
from __future__ import annotations

import os
import stat
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from remoteloader import RemoteDataLoader
from remoteloader.protocol import auth
from remoteloader.protocol.rpc import RpcClient
from tests.conftest import BIN, ROWS, spec_dict
from tests.wire_helpers import encode
from remoteloader.protocol import messages as M

SILENCE_S = 2.0  # how long an unauthenticated peer waits for a reply that must never come ...
REFUSED_GRACE_S = 0.2  # ... or, once the server has refused its handshake, how long it still listens
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@pytest.fixture(autouse=True)
def _no_ambient_keys(monkeypatch):
    monkeypatch.delenv(auth.ENV_AUTH, raising=False)


@pytest.fixture
def keys(tmp_path):
    return auth.keygen(tmp_path / "keys")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _replies(addr: str, parts: list, creds=None, timeout_s: float = SILENCE_S, server_public=None) -> bool:
    """Does a DEALER (plain, or a CURVE client with ``creds``) get any reply to ``parts``?
    An attacker knows the servers' public key (it is not a secret): ``server_public``.

    It listens ``timeout_s``, unless ZeroMQ's monitor reports that the server refused the
    handshake: a request is only sent over a completed handshake, so then it listens
    ``REFUSED_GRACE_S`` more (for a reply that could only be a bug) instead of the rest."""
    ctx = zmq.Context()
    sock = monitor = None
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if creds is not None:
            auth.secure_client(sock, creds, server_public)
        # A DEALER's send waits for a peer, and a refused handshake can drop its only one:
        # a send that cannot go out within the listening time got no reply either.
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        monitor = sock.get_monitor_socket()
        sock.connect(addr)
        try:
            sock.send_multipart(parts)
        except zmq.Again:
            return False
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        got = False
        while not got and (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            got = sock in ready
            if monitor in ready and recv_monitor_message(monitor)["event"] in _HANDSHAKE_FAILED:
                deadline = min(deadline, time.monotonic() + REFUSED_GRACE_S)
        return got
    finally:
        # However this ends: the socket first (it stops its monitor), then the monitor's end,
        # then the context (whose term would otherwise wait forever on an open socket).
        for s in (sock, monitor):
            if s is not None:
                s.close(linger=0)
        ctx.destroy(linger=0)


# -- key material and the in-process building blocks ------------------------------------------------
def test_keygen_writes_private_files_and_load_reads_them(keys):
    assert _mode(keys) == 0o700 and _mode(os.path.join(keys, auth.PUBLIC_KEYS)) == 0o700
    for name in ("cluster.key", "cluster.key_secret", os.path.join(auth.PUBLIC_KEYS, "cluster.key")):
        assert _mode(os.path.join(keys, name)) == 0o600, name
    creds = auth.load(keys)
    assert len(creds.public_key) == 40 and len(creds.secret_key) == 40
    with pytest.raises(auth.AuthError, match="refusing to overwrite"):
        auth.keygen(keys)


def test_load_refuses_missing_or_readable_keys(tmp_path, keys):
    with pytest.raises(auth.AuthError, match="remoteloader keygen"):
        auth.load(tmp_path / "nowhere")
    os.chmod(os.path.join(keys, "cluster.key_secret"), 0o644)
    with pytest.raises(auth.AuthError, match="readable by group or others"):
        auth.load(keys)


def test_option_defaults_to_the_environment(keys, monkeypatch):
    assert auth.from_option(None) is None
    monkeypatch.setenv(auth.ENV_AUTH, keys)
    assert auth.from_option(None).directory == keys


def test_is_loopback():
    assert auth.is_loopback("tcp://127.0.0.1:5555") and auth.is_loopback("127.0.0.1")
    assert auth.is_loopback("tcp://[::1]:0") and auth.is_loopback("localhost")
    assert not auth.is_loopback("tcp://0.0.0.0:5555") and not auth.is_loopback("tcp://*:5555")
    assert not auth.is_loopback("10.0.0.3") and not auth.is_loopback("eth0")


def test_curve_router_answers_only_the_cluster_key(keys, tmp_path):
    """The primitive every server uses: ROUTER + secure_server + the context's authenticator."""
    creds = auth.load(keys)
    other = auth.load(auth.keygen(tmp_path / "other"))
    ctx = zmq.Context()
    handle = auth.server_authenticator(ctx, creds)
    second = auth.server_authenticator(ctx, creds)  # one authenticator per context, shared
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    auth.secure_server(router, creds)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    addr = f"tcp://127.0.0.1:{port}"
    stop = False

    def echo():
        while not stop:
            if router.poll(50):
                identity, *body = router.recv_multipart()
                router.send_multipart([identity, *encode("ok")])

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    try:
        status = encode("status")
        assert _replies(addr, status, creds, timeout_s=10)  # the cluster key: answered
        assert not _replies(addr, status)  # plain ZeroMQ: the handshake fails, nothing arrives
        # A CURVE client with its own key pair that knows the server's public key: the
        # handshake succeeds, ZAP refuses the client key. (Once admitted: no ZAP domain.)
        assert not _replies(addr, status, other, server_public=creds.public_key)
        assert len(auth._running) == 1
    finally:
        stop = True
        t.join()
        router.close(linger=0)
        handle.close()
        handle.close()  # idempotent
        assert id(ctx) in auth._running  # still used by `second`
        second.close()
        assert id(ctx) not in auth._running
        ctx.term()


# -- real processes ----------------------------------------------------------------------------------
def _one_epoch(loader) -> Counter:
    return Counter(rid for b in loader for rid in b.passthrough["row_id"].tolist())


@pytest.mark.slow
def test_authenticated_cluster_serves_only_key_holders(tables, cluster, keys, tmp_path):
    master = cluster.master("--auth", keys, workers=2)
    creds = auth.load(keys)
    with RemoteDataLoader(spec_dict(tables["orc"]), master=master.addr, auth=keys, timeout=60) as loader:
        seen = _one_epoch(loader)
        assert len(seen) == ROWS and set(seen.values()) == {1}  # a full, exact epoch: every row once

        rpc = RpcClient(zmq.Context.instance(), master.addr, 10, auth=creds)
        deadline = time.monotonic() + 60  # the epoch may end before the second worker has registered
        while len(workers := rpc.call(M.Status()).status["workers"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        rpc.close()
        assert len(workers) == 2

        # No key, or another cluster's key: no status, no spec, no batches, not even an error.
        # The probes are independent peers, each on its own context: they listen at the same
        # time (a worker's plain handshake succeeds, so each of those listens all SILENCE_S).
        other = auth.load(auth.keygen(tmp_path / "other"))
        probes = []
        for creds_tried in (None, other):
            for t in ("status", "get_spec"):
                probes.append((f"{t} to the master, key {creds_tried is not None}", master.addr, encode(t), creds_tried))
            for w in workers:
                probes.append((f"credit to {w['addr']}, key {creds_tried is not None}", w["addr"],
                               encode("credit", session="s-0", token="", seq=1, pieces=1, bytes=1 << 20), creds_tried))
        with ThreadPoolExecutor(len(probes)) as pool:
            answered = list(pool.map(lambda p: _replies(p[1], p[2], p[3], server_public=creds.public_key), probes))
        assert [name for (name, *_), got in zip(probes, answered) if got] == []
        # ... while a key holder still gets batches of the next epoch from the same processes.
        seen = _one_epoch(loader)
        assert len(seen) == ROWS and set(seen.values()) == {1}

    cli = str(BIN / "remoteloader")
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_AUTH}
    without = subprocess.run([cli, "status", "--master", master.addr, "--timeout", "2"],
                             capture_output=True, text=True, timeout=60, env=env)
    assert without.returncode == 1
    assert len(without.stderr.strip().splitlines()) == 1 and "--auth" in without.stderr, without.stderr
    with_auth = subprocess.run([cli, "status", "--master", master.addr, "--auth", keys, "--json"],
                               capture_output=True, text=True, timeout=60, env=env)
    assert with_auth.returncode == 0, with_auth.stderr
    from_env = subprocess.run([cli, "status", "--master", master.addr],
                              capture_output=True, text=True, timeout=60, env=dict(env, **{auth.ENV_AUTH: keys}))
    assert from_env.returncode == 0 and "workers: 2" in from_env.stdout, from_env.stderr


@pytest.mark.slow
def test_standalone_worker_with_auth_flag(tables, cluster, keys):
    """A worker started by hand (not launched) joins with --auth; one without keys never joins."""
    master = cluster.master("--auth", keys, workers=0)
    cluster.workers(master.addr, 1, "--auth", keys)
    cluster.workers(master.addr, 1)  # no key: its register never reaches the master
    with RemoteDataLoader(spec_dict(tables["parquet"]), master=master.addr, auth=keys, timeout=60) as loader:
        seen = _one_epoch(loader)
        assert len(seen) == ROWS and set(seen.values()) == {1}
        rpc = RpcClient(zmq.Context.instance(), master.addr, 10, auth=auth.load(keys))
        assert len(rpc.call(M.Status()).status["workers"]) == 1
        rpc.close()


@pytest.mark.slow
def test_embedded_default_is_private_to_this_user(tables):
    """One host: no keys, Unix sockets in a 0700 directory of this user's (another uid gets
    nothing: tests/test_ipc_local.py::test_another_uid_cannot_connect_to_the_master_or_a_worker)."""
    loader = RemoteDataLoader(spec_dict(tables["orc"]), num_workers=1, timeout=60)
    try:
        ipc_dir = loader._cluster.ipc_dir
        assert loader.master == f"ipc://{ipc_dir}/master" and loader._auth is None
        assert _mode(ipc_dir) == 0o700 and os.stat(ipc_dir).st_uid == os.geteuid()
        seen = _one_epoch(loader)
        assert len(seen) == ROWS and set(seen.values()) == {1}
    finally:
        loader.close()
    assert not os.path.exists(ipc_dir)  # the private directory is removed with the cluster


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["remoteloader-master", "--bind", "tcp://0.0.0.0:0"],
    ["remoteloader-worker", "--master", "tcp://127.0.0.1:9", "--bind-host", "0.0.0.0"],
])
def test_non_loopback_bind_without_auth_refuses_to_start(argv):
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_AUTH}
    r = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "--insecure" in r.stderr and "--auth" in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["--insecure", "--auth"])
def test_non_loopback_master_starts_with_insecure_or_auth(extra, keys):
    args = [extra] + ([keys] if extra == "--auth" else [])
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_AUTH}
    proc = subprocess.Popen([str(BIN / "remoteloader-master"), "--bind", "tcp://0.0.0.0:0", *args],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert "listening on" in proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(15)
    assert proc.returncode == 0
