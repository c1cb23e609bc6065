"""One host, the kernel is the lock (issue 26 part 1): the embedded default and a master on
``ipc://DIR/NAME`` talk over Unix sockets in a private directory (0700, this user's), with no
CURVE. Another uid cannot connect; a worker cannot register a socket outside the directory;
the directory goes with the cluster."""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

from pathlib import Path

import pytest
import zmq

from remoteloader import RemoteDataLoader
from remoteloader.protocol import auth
from remoteloader.protocol import messages as M
from remoteloader.protocol.address import (AddressError, check_ipc_directory, new_ipc_directory,
                                           prepare_ipc_directory, validate_address)
from remoteloader.protocol.rpc import RpcClient
from tests.conftest import BIN, ROWS, spec_dict
from tests.wire_helpers import encode

from .test_master_service import Clock, call, make_service, spec  # noqa: F401 (spec: a fixture)

NOBODY = 65534
SILENCE_S = 2.0  # how long a peer of another uid waits for a reply that must never come


@pytest.fixture(autouse=True)
def _no_ambient_keys(monkeypatch):
    monkeypatch.delenv(auth.ENV_AUTH, raising=False)
    monkeypatch.setenv("REMOTELOADER_QUIET", "1")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# -- addresses and the directory ------------------------------------------------------------------------
@pytest.mark.parametrize("addr,why", [
    ("ipc://tmp/rl/master", "must be absolute"), ("ipc:///master", "inside a private directory"),
    ("ipc:///tmp/rl/../etc/master", "normalized"), ("ipc:///tmp/rl/", "inside a private directory"),
    ("ipc:///tmp/rl/" + "m" * 100, "more than a Unix socket's 107"), ("ipc:///tmp/rl/*", "must not contain"),
])
def test_ipc_addresses_are_checked_in_one_line(addr, why):
    assert validate_address("ipc:///tmp/rl-1/master", bind=True) == "ipc:///tmp/rl-1/master"
    with pytest.raises(AddressError, match=why) as caught:
        validate_address(addr, "--bind", bind=True)
    assert str(caught.value).startswith("--bind: invalid address") and "\n" not in str(caught.value)


def test_a_directory_others_could_enter_is_refused_naming_it(tmp_path):
    d = tmp_path / "rl"
    assert prepare_ipc_directory(str(d)) is True and _mode(d) == 0o700  # made here: its maker removes it
    assert prepare_ipc_directory(str(d)) is False  # found: checked and kept
    os.chmod(d, 0o750)
    with pytest.raises(AddressError, match=f"ipc directory {d} has mode 0750.*chmod 700 {d}"):
        check_ipc_directory(str(d))
    os.chmod(d, 0o700)
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(AddressError, match=f"{link} is not a directory"):
        check_ipc_directory(str(link))
    with pytest.raises(AddressError, match="does not exist"):
        check_ipc_directory(str(tmp_path / "missing"))
    if os.geteuid() == 0:
        os.chown(d, NOBODY, NOBODY)
        with pytest.raises(AddressError, match=f"{d} is owned by uid {NOBODY}"):
            check_ipc_directory(str(d))


def test_a_fresh_directory_name_is_short_and_unpredictable():
    a, b = new_ipc_directory(), new_ipc_directory()
    assert a != b and not os.path.exists(a)
    assert len(os.path.join(a, "worker-" + "0" * 16).encode()) <= 107


def test_register_refuses_an_ipc_address_outside_the_masters_directory(spec, tmp_path):
    service = make_service(spec, Clock())
    fingerprint = service.state.job.fingerprint
    outside = "ipc:///tmp/elsewhere/worker-1"
    t, reply = call(service, "register", addr=outside, pid=1, fingerprint=fingerprint)
    assert t == "error" and outside in reply["message"] and "none: it listens on tcp" in reply["message"]
    service.config.ipc_dir = str(tmp_path)  # what remoteloader-master sets for --bind ipc://DIR/NAME
    for addr in (outside, f"ipc://{tmp_path}/sub/worker-1", f"ipc://{os.path.dirname(tmp_path)}/worker-1"):
        t, reply = call(service, "register", addr=addr, pid=1, fingerprint=fingerprint)
        assert t == "error" and addr in reply["message"] and str(tmp_path) in reply["message"], reply
    assert not service.state.workers
    t, reply = call(service, "register", addr=f"ipc://{tmp_path}/worker-1", pid=1, fingerprint=fingerprint)
    assert t == "registered", reply


# -- real processes ----------------------------------------------------------------------------------------
def _status(addr: str) -> dict:
    rpc = RpcClient(zmq.Context.instance(), addr, 10)
    try:
        return rpc.call(M.Status()).status
    finally:
        rpc.close()


def _wait_workers(addr: str, n: int) -> list[dict]:
    deadline = time.monotonic() + 60
    while len(workers := _status(addr)["workers"]) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(workers) == n
    return workers


def _one_epoch(loader) -> set:
    seen = [r for b in loader for r in b.passthrough["row_id"].tolist()]
    assert len(seen) == len(set(seen)) == ROWS
    return set(seen)


@pytest.mark.slow
def test_the_embedded_default_uses_ipc_and_no_keys(tables):
    keys_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "remoteloader-auth-*")))
    loader = RemoteDataLoader(spec_dict(tables["orc"]), num_workers=2, timeout=60)
    try:
        ipc_dir = loader._cluster.ipc_dir
        assert loader.master == f"ipc://{ipc_dir}/master" and loader._auth is None and loader._cluster.auth_dir is None
        assert _mode(ipc_dir) == 0o700 and os.stat(ipc_dir).st_uid == os.geteuid()
        _one_epoch(loader)
        workers = _wait_workers(loader.master, 2)
        assert all(w["addr"].startswith(f"ipc://{ipc_dir}/worker-") for w in workers), workers
        for name in os.listdir(ipc_dir):
            assert stat.S_ISSOCK(os.stat(os.path.join(ipc_dir, name)).st_mode) and _mode(os.path.join(ipc_dir, name)) == 0o600
    finally:
        loader.close()
    assert not os.path.exists(ipc_dir)  # removed with the cluster
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "remoteloader-auth-*"))) == keys_before  # no keys made


# Run as uid/gid 65534 with no groups (setpriv): a raw connect to each socket, then a ZeroMQ
# request that must get no reply. Frames are encoded by the test (hex): nothing imported.
PROBE = """
import errno, json, socket, sys, zmq
out = []
for path, frames in json.loads(sys.argv[1]):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        err = None
    except OSError as e:
        err = errno.errorcode.get(e.errno, str(e.errno))
    s.close()
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect("ipc://" + path)
    d.send_multipart([bytes.fromhex(f) for f in frames])
    replied = bool(d.poll(int(float(sys.argv[2]) * 1000)))
    d.close(0)
    ctx.term()
    out.append({"path": path, "connect": err, "replied": replied, "uid": __import__("os").getuid()})
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a probe as another uid")
def test_another_uid_cannot_connect_to_the_master_or_a_worker(tables):
    # The probe runs this checkout's Python as nobody: a checkout under a private directory
    # (a clone in `mktemp -d`, mode 0700) keeps nobody out of its virtual environment.
    can_import = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
                                 sys.executable, "-c", "import zmq"], capture_output=True, timeout=60, cwd="/")
    if can_import.returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot import zmq from {sys.executable} (a private checkout directory)")
    loader = RemoteDataLoader(spec_dict(tables["orc"]), num_workers=1, timeout=60)
    try:
        _one_epoch(loader)
        worker = _wait_workers(loader.master, 1)[0]  # the owner asks the master: it answers
        targets = [(loader.master, encode("status")),
                   (worker["addr"], encode("credit", session="s-0", token="", seq=1, pieces=1, bytes=1 << 20))]
        arg = json.dumps([[a[len("ipc://"):], [bytes(f).hex() for f in frames]] for a, frames in targets])
        probe = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
                                sys.executable, "-c", PROBE, arg, str(SILENCE_S)],
                               capture_output=True, text=True, timeout=60, cwd="/")
        assert probe.returncode == 0, probe.stderr
        results = json.loads(probe.stdout)
        assert len(results) == 2
        for r in results:
            assert r["uid"] == NOBODY and r["connect"] == "EACCES" and not r["replied"], r
        # The same request as the owner is answered; the cluster still serves an exact epoch.
        assert _status(loader.master)["workers"]
        _one_epoch(loader)
    finally:
        loader.close()


OWNER = """
import os, sys, time
from remoteloader.client.embedded import EmbeddedCluster
c = EmbeddedCluster(1)
print(c.ipc_dir, c.proc.pid, flush=True)
time.sleep(600)
"""


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            return  # exited; its parent (killed) left it to init to reap
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"pid {pid} did not exit")


@pytest.mark.slow
def test_the_master_removes_its_directory_when_its_owner_is_killed(tables):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=root,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])))
    try:
        ipc_dir, master_pid = owner.stdout.readline().split()
        assert os.path.isdir(ipc_dir) and os.path.exists(os.path.join(ipc_dir, "master"))
        owner.kill()  # SIGKILL: no close() runs; the master's parent-death signal does the rest
        owner.wait(30)
        _wait_gone(int(master_pid))
        assert not os.path.exists(ipc_dir)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(30)


@pytest.mark.slow
def test_a_master_bind_refuses_an_open_directory_and_a_killed_master_does_not_trip_the_next(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    r = subprocess.run([str(BIN / "remoteloader-master"), "--bind", f"ipc://{open_dir}/master", "--workers", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"ipc directory {open_dir} has mode 0755" in r.stderr

    d = tmp_path / "rl"
    addr = f"ipc://{d}/master"
    first = subprocess.Popen([str(BIN / "remoteloader-master"), "--bind", addr, "--workers", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "listening on " + addr in first.stdout.readline()
        assert _mode(d) == 0o700 and _mode(d / "master") == 0o600
        busy = subprocess.run([str(BIN / "remoteloader-master"), "--bind", addr, "--workers", "0"],
                              capture_output=True, text=True, timeout=60)
        assert busy.returncode == 2 and "address in use" in busy.stderr, busy.stderr
        first.kill()  # SIGKILL of the master itself: its directory and socket file stay ...
        first.wait(30)
        assert os.path.exists(d / "master")
        second = subprocess.Popen([str(BIN / "remoteloader-master"), "--bind", addr, "--workers", "0"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:  # ... and the next master on the same path replaces the stale socket
            assert "listening on " + addr in second.stdout.readline()
            assert _status(addr)["workers"] == []
        finally:
            second.terminate()
            second.wait(30)
        assert os.path.isdir(d)  # found, not made, by the second master: kept
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(30)


# -- issue 37, finding 6: a squatted name is never adopted, and the start still succeeds --------------
class _Names:
    """``secrets`` for ``protocol.address``: the given hex names first, then random ones."""

    def __init__(self, names):
        import secrets

        self._names, self._secrets = list(names), secrets

    def token_hex(self, n: int) -> str:
        return self._names.pop(0) if self._names else self._secrets.token_hex(n)


@pytest.mark.slow  # a real master process (about 4 s)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_squatted_ipc_directory_is_never_adopted_and_the_embedded_start_succeeds(monkeypatch):
    import secrets

    from remoteloader.client.embedded import EmbeddedCluster
    from remoteloader.protocol import address

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # /tmp: where another user can make names too
    squat_dir, squat_link = secrets.token_hex(6), secrets.token_hex(6)
    taken = [f"/tmp/rl-{squat_dir}", f"/tmp/rl-{squat_link}"]
    # Another uid, watching for the next name, makes it first: an open directory, and a
    # symlink to a directory of its own.
    squatter = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", "sh", "-c",
                               f"mkdir -m 0777 {taken[0]} && mkdir -m 0777 {taken[0]}-x && ln -s {taken[0]}-x {taken[1]}"],
                              capture_output=True, text=True, timeout=30, cwd="/")
    assert squatter.returncode == 0, squatter.stderr
    monkeypatch.setattr(address, "secrets", _Names([squat_dir, squat_link]))  # the names it predicted come next
    cluster = None
    try:
        cluster = EmbeddedCluster(0, start_timeout=60)
        assert cluster.ipc_dir not in taken and cluster.addr == f"ipc://{cluster.ipc_dir}/master"
        st = os.lstat(cluster.ipc_dir)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert _status(cluster.addr)["workers"] == []  # the master listens in the fresh directory
        for path in (taken[0], f"{taken[0]}-x"):  # nothing adopted, nothing put in them
            assert os.lstat(path).st_uid == NOBODY and os.listdir(path) == []
        assert os.readlink(taken[1]) == f"{taken[0]}-x"
        ipc_dir = cluster.ipc_dir
        cluster.close()
        cluster = None
        assert not os.path.lexists(ipc_dir)  # the master removed what it was handed
        assert os.path.isdir(taken[0]) and os.path.islink(taken[1])  # another's names are never touched
    finally:
        if cluster is not None:
            cluster.close()
        for path in (taken[1], f"{taken[0]}-x", taken[0]):
            if os.path.islink(path):
                os.unlink(path)
            elif os.path.isdir(path):
                os.rmdir(path)


def test_make_ipc_directory_takes_a_fresh_name_past_any_taken_one(monkeypatch):
    from remoteloader.protocol import address

    # A short base: under xdist tmp_path is too long for a Unix socket's path, and the
    # names would (rightly) go to /tmp instead.
    tmp_path = Path(tempfile.mkdtemp(prefix="rlt-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "rl-000000000001").mkdir(mode=0o700)  # even one of this user's own: never adopted
    (tmp_path / "rl-000000000002").write_text("")
    (tmp_path / "rl-000000000003").symlink_to(tmp_path / "rl-000000000001")
    monkeypatch.setattr(address, "secrets", _Names(["000000000001", "000000000002", "000000000003", "000000000004"]))
    made = address.make_ipc_directory()
    assert made == str(tmp_path / "rl-000000000004") and _mode(made) == 0o700
    monkeypatch.setattr(address, "secrets", _Names(["000000000001"] * 3))
    with pytest.raises(AddressError, match="3 fresh names were taken already"):
        address.make_ipc_directory(attempts=3)
    shutil.rmtree(tmp_path)
