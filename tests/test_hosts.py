"""Across hosts for real (issue 41): master, workers and trainers each on their own host, a
network namespace with its own address on a bridge (tests/hostnet.py), talking over veth
links that the tests cut. Every test skips, saying why, where namespaces cannot be made.

* the harness itself: a cut link carries nothing until restored, the root namespace never
  sees a link or address of it, and ``close`` kills even a process that left its group and
  deletes every namespace, as the next run deletes those of a run that died;
* sealed frames over the link: a standing master with ``--auth`` on h1, two workers on h2,
  two ranks on h3 read every row exactly once; a capture of h3's link holds no row id in
  the clear; a peer on h4 without the keys (or with another cluster's) gets nothing;
* a worker host's link cut mid-epoch: the epoch ends on the other worker host, exactly once,
  the cut worker's pieces produced again there;
* the trainer's link cut for 5 s mid-epoch, then restored: no loss, no duplicate, no hang;
* a master bound to a host address without ``--auth`` refuses to start unless ``--insecure``;
  with it, the same capture does find row ids in the clear (which shows the capture would
  have seen them in the sealed test).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import pytest

from remoteloader.protocol import auth
from tests.conftest import BIN, ROWS, MasterProcess, master_status, spec_dict, wait_gone
from tests.hostnet import PREFIX, Host, HostNet, namespaces, sweep_stale

ROOT = Path(__file__).resolve().parent.parent  # where ``python -m tests.host_roles`` runs
T = TypeVar("T")


@pytest.fixture(autouse=True)
def _no_ambient_keys(monkeypatch):
    monkeypatch.delenv(auth.ENV_AUTH, raising=False)


@pytest.fixture
def keys(tmp_path) -> str:
    return str(auth.keygen(tmp_path / "keys"))


@pytest.fixture
def spec(tables, tmp_path) -> Path:
    """The tests' ORC table in 10 splits of 5 batches: both workers of a test get some."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec_dict(tables["orc"], batch_size=100, split_rows=500)))
    return path


def master_on(host: Host, *args: str) -> MasterProcess:
    """A standing master bound to ``host``'s address (a 2 s heartbeat timeout), no local workers."""
    return MasterProcess(*args, workers=0, bind=f"tcp://{host.addr}:0", popen=host.popen)


def workers_on(host: Host, master: MasterProcess, n: int, *args: str) -> list[subprocess.Popen]:
    return [host.popen([BIN / "remoteloader-worker", "--master", master.addr, "--bind-host", host.addr, *args])
            for _ in range(n)]


def trainer_on(host: Host, spec: Path, master: MasterProcess, out: Path, *args: str) -> subprocess.Popen:
    return host.popen([sys.executable, "-m", "tests.host_roles", "trainer", "--spec", spec,
                       "--master", master.addr, "--out", out, *args], cwd=ROOT)


def wait_for(probe: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    """``probe()`` once it is truthy; a bound against a hang, not a timing."""
    deadline = time.monotonic() + timeout
    while not (got := probe()):
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.2)
    return got


def batches_in(out: Path) -> int:
    return len(out.read_text().splitlines()) if out.exists() else 0


def epoch_rows(trainer: subprocess.Popen, out: Path, timeout: float = 90.0) -> list[int]:
    """The row ids a trainer read, once it ended its epoch; fails on a hang (``timeout``)."""
    try:
        code = trainer.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the trainer did not end its epoch within {timeout:g} s ({batches_in(out)} batches read)")
    assert code == 0, f"the trainer exited with {code} (its stderr is in the captured output)"
    *batches, summary = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary == {"batches": len(batches), "len": len(batches)}, summary  # every batch len() promised
    return [r for b in batches for r in b]


def plaintext_row_runs(wire: bytes, rows: int, run: int = 8) -> int:
    """Places in ``wire`` holding ``run`` consecutive row ids as little-endian int64: a batch's
    ``row_id`` tensor in the clear (ids are consecutive within a split)."""
    found = 0
    for offset in range(8):
        ids = np.frombuffer(wire, "<i8", count=(len(wire) - offset) // 8, offset=offset)
        step = (np.diff(ids) == 1) & (ids[:-1] >= 0) & (ids[:-1] < rows)
        found += int((np.convolve(step, np.ones(run - 1, np.int64), "valid") == run - 1).sum())
    return found


ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], 7000))
while True:
    conn, _ = server.accept()
    conn.sendall(conn.recv(16))
    conn.close()
"""
REACH = """
import socket, sys
with socket.create_connection((sys.argv[1], 7000), timeout=1) as s:
    s.sendall(b"ping")
    assert s.recv(16) == b"ping"
"""


def root_namespace() -> str:
    """The root namespace's links and addresses, as ``ip`` prints them."""
    return "".join(subprocess.run(["ip", "-o", what, "show"], capture_output=True, text=True, check=True).stdout
                   for what in ("link", "addr"))


def test_the_harness_cuts_and_restores_links_and_leaves_nothing_behind(hostnet):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"{PREFIX}{dead.pid:x}.00s", f"{PREFIX}{os.getpid():x}.00s"  # a run that died; this one
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        sweep_stale()  # (a HostNet made in parallel may have swept it first)
        left = namespaces()
        assert stale not in left and live in left  # only the dead run's: a live run's namespaces are its own
    finally:
        subprocess.run(["ip", "netns", "del", live], check=True)

    net: HostNet = hostnet(2)
    h1, h2 = net.hosts.values()
    h2.popen([sys.executable, "-c", ECHO, h2.addr])

    def reaches() -> bool:
        return h1.run([sys.executable, "-c", REACH, h2.addr], capture_output=True, timeout=30).returncode == 0

    wait_for(reaches, "h1 reaches h2's echo server")
    net.cut("h2")
    assert not reaches()
    net.restore("h2")
    wait_for(reaches, "h1 reaches h2 again once its link is restored")
    if net.slow("h2", 20, rate="10mbit"):  # False where the kernel has no netem (then nothing changed)
        assert reaches()
        net.restore("h2")
    seen_from_root = root_namespace()
    assert not any(name in seen_from_root for name in [net.switch, *(h.ns for h in net.hosts.values())])
    assert not any(h.addr in seen_from_root for h in net.hosts.values())

    # A process that left the process group it was started in: only the namespace knows it.
    escaped = int(h2.run(["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                         check=True).stdout)
    names = [net.switch, *(h.ns for h in net.hosts.values())]
    net.close()
    net.close()  # idempotent
    assert not set(names) & set(namespaces())
    wait_gone([escaped])


def test_sealed_frames_across_hosts_and_a_peer_without_keys_gets_nothing(spec, keys, hostnet, tmp_path):
    net = hostnet(4)
    h1, h2, h3, h4 = net.hosts.values()
    master = master_on(h1, "--auth", keys)
    workers_on(h2, master, 2, "--auth", keys)

    def status() -> dict:
        return master_status(master.addr, keys, run=h1.run)

    capture = tmp_path / "h3.frames"
    net.capture("h3", capture)
    outs = [tmp_path / f"rank{r}.jsonl" for r in (0, 1)]
    trainers = [trainer_on(h3, spec, master, out, "--auth", keys, "--rank", str(r), "--world-size", "2")
                for r, out in enumerate(outs)]
    rows = [r for trainer, out in zip(trainers, outs) for r in epoch_rows(trainer, out)]
    assert sorted(rows) == list(range(ROWS))
    wire = capture.read_bytes()
    assert len(wire) > ROWS * 8  # every batch crossed h3's link ...
    assert plaintext_row_runs(wire, ROWS) == 0  # ... and none of it in the clear

    # h4 has no keys, then another cluster's: the master refuses the handshake and says so;
    # a worker's data socket answers nothing to a credit that no session token backs.
    keyless = h4.run([BIN / "remoteloader", "status", "--master", master.addr], capture_output=True, text=True)
    assert keyless.returncode != 0 and "requires the cluster's keys" in keyless.stderr, keyless.stderr
    other = str(auth.keygen(tmp_path / "other-keys"))
    wrong = h4.run([BIN / "remoteloader", "status", "--master", master.addr, "--auth", other],
                   capture_output=True, text=True)
    assert wrong.returncode != 0 and "refused" in wrong.stderr and "workers" not in wrong.stdout, wrong.stderr
    workers = [arg for w in status()["workers"] for arg in ("--worker", w["addr"])]
    tried = h4.run([sys.executable, "-m", "tests.host_roles", "intruder", *workers], capture_output=True, text=True,
                   cwd=ROOT, check=True)
    assert json.loads(tried.stdout) == {"replied": [False, False]}


def test_a_worker_hosts_link_cut_mid_epoch_moves_its_splits_to_the_other_host(spec, keys, hostnet, tmp_path):
    net = hostnet(4)
    h1, h2, h3, h4 = net.hosts.values()
    master = master_on(h1, "--auth", keys)
    for host in (h2, h3):
        workers_on(host, master, 1, "--auth", keys)

    def status() -> dict:
        return master_status(master.addr, keys, run=h1.run)

    out, go = tmp_path / "rank0.jsonl", tmp_path / "go"
    trainer = trainer_on(h4, spec, master, out, "--auth", keys, "--pause-after", "5", "--go", go)
    wait_for(lambda: batches_in(out) >= 5, "the trainer's first 5 batches")
    # The trainer waits; the h3 worker holds pieces it has not sent: once h3 is cut they
    # can only reach the trainer by being produced again on h2.
    wait_for(lambda: any(h3.addr in w["addr"] and w["buffered"] > 0 for w in status()["workers"]),
             "the h3 worker holding pieces for the trainer")
    net.cut("h3")
    go.touch()
    rows = epoch_rows(trainer, out)
    assert sorted(rows) == list(range(ROWS))
    wait_for(lambda: [h2.addr in w["addr"] for w in status()["workers"]] == [True],
             "the master dropping the h3 worker (its heartbeat timeout)")


def test_the_trainers_link_cut_for_5_s_mid_epoch(spec, keys, hostnet, tmp_path):
    net = hostnet(3)
    h1, h2, h3 = net.hosts.values()
    master = master_on(h1, "--auth", keys)
    # A 2 s client timeout: during the cut the workers give up what they held for the trainer.
    workers_on(h2, master, 2, "--auth", keys, "--client-timeout", "2")
    out, go = tmp_path / "rank0.jsonl", tmp_path / "go"
    trainer = trainer_on(h3, spec, master, out, "--auth", keys, "--pause-after", "5", "--go", go)
    wait_for(lambda: batches_in(out) >= 5, "the trainer's first 5 batches")
    net.cut("h3")
    go.touch()  # the trainer asks for its next batches with its link down
    time.sleep(5)
    net.restore("h3")
    rows = epoch_rows(trainer, out)
    assert sorted(rows) == list(range(ROWS))


def test_a_master_on_a_host_address_needs_auth_or_insecure(spec, hostnet, tmp_path):
    net = hostnet(3)
    h1, h2, h3 = net.hosts.values()
    refused = h1.run([BIN / "remoteloader-master", "--bind", f"tcp://{h1.addr}:0"], capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stdout == ""
    assert h1.addr in refused.stderr and "--auth" in refused.stderr and "--insecure" in refused.stderr, refused.stderr
    master = master_on(h1, "--insecure")
    workers_on(h2, master, 1, "--insecure")
    capture = tmp_path / "h3.frames"
    net.capture("h3", capture)
    out = tmp_path / "rank0.jsonl"
    assert sorted(epoch_rows(trainer_on(h3, spec, master, out), out)) == list(range(ROWS))
    # What --insecure means: anyone on the link reads the rows (and what the sealed test's
    # capture would have found there, had they been in the clear).
    assert plaintext_row_runs(capture.read_bytes(), ROWS) > 0
