"""Red team: hostile peers against a real, authenticated cluster on 127.0.0.1.

Starts a master (``--auth``, an allowlist in its environment, a journal, ``--autoscale``,
metrics) with two workers, then runs the cases of issues 11 and 23 one by one:
outsiders (no key, or a key of their own), local users (what a process list or a key
directory shows), and insiders (holding the cluster key, sending what a buggy or
hostile member might: reading tables outside the allowlist, taking or wrecking another
rank's epoch, bloating the master's state, emptying the fleet), plus a long run of
generated messages at the master and a worker. After every case it checks that every
process is still the same process and that the master answers ``status`` within a
second; at the end, how long the master takes to answer while idle (20 ``status``
calls). A legitimate client reads an epoch before the insiders' cases and two after,
each of which must hold every row exactly once. "rows exposed" counts rows of a table
outside the allowlist, or of another rank's epoch, that an attacker received.

Run: ``.venv/bin/python -m benchmarks.redteam [--messages 10000]``. Prints one table:
case, survived, clear error, hang, rows exposed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import os
import re
import statistics
import subprocess
import threading
import urllib.error
import urllib.request
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import msgpack
import msgspec
import numpy as np
import psutil
import zmq

from remoteloader import RemoteDataLoader
from remoteloader.core.redact import ENV_ALLOW_TABLE
from remoteloader.protocol import auth, seal, wire
from remoteloader.protocol import messages as M
from remoteloader.protocol.rpc import MasterUnavailable, RemoteError, RpcClient
from remoteloader.spec import DatasetSpec, SpecError
from remoteloader.tools.datagen import generate_table

V = wire.PROTOCOL_VERSION
SECRET = "wJalrXUtnREDTEAMbPxRfiCYEXAMPLEKEY"  # a credential that must show nowhere
SECRET_ROWS = 1_000  # rows of the table outside the allowlist
ROWS = [20_000]  # rows of the allowed table (set from --rows)


@dataclass
class Outcome:
    clear_error: bool  # refused with an error that says why (or, for outsiders, nothing at all)
    rows_exposed: int = 0
    note: str = ""


@dataclass
class Row:
    case: str
    survived: bool
    clear_error: bool
    hang: bool
    rows_exposed: int
    note: str = ""


class Target:
    """The cluster under attack and the sockets to reach it."""

    def __init__(self, tmp: Path, table: Path) -> None:
        self.tmp, self.table = tmp, table
        self.keys = auth.load(auth.keygen(tmp / "keys"))
        self.rogue = auth.load(auth.keygen(tmp / "rogue-keys"))  # a key pair the cluster never saw
        self.ctx = zmq.Context.instance()
        self.log = tmp / "master.log"
        # The allowlist travels in the environment: a table URI may hold a credential, and a
        # command line is readable by every local user.
        env = {**os.environ, ENV_ALLOW_TABLE: json.dumps([str(table)])}
        with open(self.log, "w") as log:
            self.master = subprocess.Popen(
                [sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0", "--auth",
                 self.keys.directory, "--workers", "2", "--journal", str(tmp / "journal"), "--autoscale",
                 "--min-workers", "2", "--max-workers", "2", "--heartbeat-timeout", "5", "--metrics-port", "0"],
                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.addr = self.master.stdout.readline().rsplit(" ", 1)[1].strip()
        self.metrics = re.search(r"metrics on (http://\S+)", self.log.read_text()).group(1)
        self.rpc = RpcClient(self.ctx, self.addr, 5.0, auth=self.keys)

    def status(self, timeout_s: float = 1.0) -> Optional[dict]:
        try:
            return self.rpc.call(M.Status(), timeout_s=timeout_s).status
        except (MasterUnavailable, RemoteError):
            return None

    def pids(self) -> list[int]:
        # recursive: the local workers are children of the master's worker fork server
        return sorted([self.master.pid, *(c.pid for c in psutil.Process(self.master.pid).children(recursive=True))])

    def socket(self, addr: str, creds: Optional[auth.Credentials]) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 200)  # an outsider's handshake never completes: sends would block
        # Protocol 10: a worker's data socket is plain (its messages are sealed), whoever connects.
        if creds is not None and addr == self.addr:
            auth.secure_client(sock, creds, server_public=self.keys.public_key)
        sock.connect(addr)
        return sock

    def ask(self, addr: str, parts: list, creds: Optional[auth.Credentials], wait_s: float = 1.0) -> Optional[dict]:
        """Send one message; the decoded header of the reply, or None if nothing came."""
        sock = self.socket(addr, creds)
        try:
            send(sock, parts)
            if not sock.poll(int(wait_s * 1000)):
                return None
            return header_of(sock.recv_multipart())
        finally:
            sock.close()

    def stop(self) -> None:
        pids = self.pids() if self.master.poll() is None else [self.master.pid]
        self.master.terminate()
        try:
            self.master.wait(20)
        except subprocess.TimeoutExpired:
            self.master.kill()
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, 9)


def send(sock: zmq.Socket, parts: list) -> bool:
    try:
        sock.send_multipart(parts)
        return True
    except zmq.Again:  # not connected (refused handshake) or the peer's pipe is full
        return False


def msg(t: str, **fields) -> list:
    return [msgpack.packb({"v": V, "t": t, **fields}, use_bin_type=True)]


def header_of(parts: list) -> dict:
    """A reply's header as the map it travels as."""
    return msgspec.to_builtins(wire.decode(parts)[0])


def is_error(reply: Optional[dict], *codes: str) -> bool:
    return reply is not None and reply["t"] == "error" and (not codes or reply.get("code") in codes)


def spec_for(path: str) -> dict:
    return {"table": {"path": path}, "features": {"label": "label", "dense": ["float_0"],
                                                  "sparse": [{"name": "s0", "column": "idlist_0"}]},
            "batch_size": 256}


def hello(spec: dict, world_size: int = 1, rank: int = 0) -> list:
    try:
        fingerprint = DatasetSpec.from_dict(spec).fingerprint()
    except SpecError:  # a spec the client library refuses still goes to the master, as an attacker's would
        fingerprint = "hostile"
    return msg("hello", rank=rank, world_size=world_size, spec=spec, fingerprint=fingerprint)


def job_spec(t: "Target") -> dict:
    """The spec of the job the legitimate client started (row ids, to count rows)."""
    return {**spec_for(str(t.table)), "features": {**spec_for(str(t.table))["features"], "passthrough": ["row_id"]}}


# -- cases ----------------------------------------------------------------------------------
def before_the_job(t: Target) -> dict[str, Callable[[], Outcome]]:
    """Cases that need a master without a job: what a client's spec may make it do."""
    def oracle() -> Outcome:
        shadow = t.ask(t.addr, hello(spec_for("/etc/shadow")), t.keys)
        missing = t.ask(t.addr, hello(spec_for("/nonexistent/table")), t.keys)
        same = is_error(shadow, "bad_spec") and is_error(missing, "bad_spec") and shadow["message"] == missing["message"]
        return Outcome(same)

    def endpoint() -> Outcome:
        start = time.monotonic()
        reply = t.ask(t.addr, hello(spec_for("s3://bucket/t?endpoint_override=10.255.255.1:9000")), t.keys, 3.0)
        return Outcome(is_error(reply, "bad_spec") and time.monotonic() - start < 1.0)

    def outsider_spec() -> Outcome:  # a spec naming the table, from a peer without the key
        replies = [t.ask(t.addr, hello(spec_for(str(t.table))), creds) for creds in (None, t.rogue)]
        return Outcome(replies == [None, None])

    def traversal() -> Outcome:  # issue 23, finding 1: a real table outside the allowlist
        outside = t.ask(t.addr, hello(spec_for(f"file://{t.table}/%2e%2e/secret/t")), t.keys, 3.0)
        missing = t.ask(t.addr, hello(spec_for(f"file://{t.table}/%2e%2e/missing/t")), t.keys, 3.0)
        same = is_error(outside, "bad_spec") and is_error(missing, "bad_spec") and \
            outside["message"] == missing["message"]
        return Outcome(same, 0 if is_error(outside) else SECRET_ROWS)

    def credentials() -> Outcome:  # finding 2: refused naming the key, the secret never echoed
        reply = t.ask(t.addr, hello(spec_for(f"s3://AKIAREDTEAM:{SECRET}@bucket/t")), t.keys, 3.0)
        said = str(reply)
        return Outcome(is_error(reply, "bad_spec") and "table.path" in said and SECRET not in said)

    def huge_borders() -> Outcome:  # finding 5: a 100,000-border onehot pushed a worker to 4.5 GB
        spec = spec_for(str(t.table))
        spec["features"]["dense"] = [{"name": "oh", "column": "float_0",
                                      "transforms": [{"op": "onehot", "borders": list(range(100_000))}]}]
        start = time.monotonic()
        reply = t.ask(t.addr, hello(spec), t.keys, 5.0)
        return Outcome(is_error(reply, "bad_spec") and "oh" in reply["message"] and time.monotonic() - start < 2.0)

    return {"outsider: hello with the table, no key / own key": outsider_spec,
            "insider: spec naming /etc/shadow vs a missing path (oracle)": oracle,
            "insider: spec pointing at another object-store endpoint": endpoint,
            "insider: table outside the allowlist via %2e%2e": traversal,
            "insider: table URI with credentials": credentials,
            "insider: onehot with 100,000 borders": huge_borders}


def spec_files(t: Target) -> dict[str, Callable[[], Outcome]]:
    def refused(name: str, text: bytes) -> Outcome:
        path = t.tmp / name
        path.write_bytes(text)
        start = time.monotonic()
        try:
            DatasetSpec.from_file(str(path))
        except SpecError as e:
            return Outcome(str(path) in str(e) and time.monotonic() - start < 1.0)
        return Outcome(False)

    laughs = b"a: &a [x,x,x,x,x,x,x,x,x]\n" + b"".join(
        b"%c: &%c [*%c,*%c,*%c,*%c,*%c,*%c,*%c,*%c,*%c]\n" % ((ord("a") + i + 1,) * 2 + (ord("a") + i,) * 9)
        for i in range(9))
    return {"spec file: billion laughs (YAML aliases)": lambda: refused("laughs.yaml", laughs),
            "spec file: not UTF-8": lambda: refused("latin1.yaml", b"table: {path: caf\xe9}\n"),
            "spec file: 5,000-deep nesting": lambda: refused("deep.yaml", b"[" * 5000 + b"]" * 5000)}


def with_the_job(t: Target, worker_addr: str) -> dict[str, Callable[[], Outcome]]:
    def outsider_master() -> Outcome:
        asks = [msg("status"), msg("get_spec"), msg("register", addr="tcp://127.0.0.1:9", pid=1, fingerprint="x")]
        return Outcome(all(t.ask(t.addr, m, c) is None for m in asks for c in (None, t.rogue)))

    def outsider_worker() -> Outcome:
        rows = 0
        for creds in (None, t.rogue):
            sock = t.socket(worker_addr, creds)
            for _ in range(40):
                send(sock, msg("credit", session="s-0", token="", seq=0, pieces=1, bytes=1 << 30))
            while sock.poll(500):
                sock.recv_multipart()
                rows += 1
            send(sock, msg("drain", worker_id="w-x", token=""))
            sock.close()
        return Outcome(rows == 0, rows)

    def bad_stats(stats: dict) -> Callable[[], Outcome]:
        return lambda: Outcome(is_error(t.ask(t.addr, msg("heartbeat", worker_id="w-x", token="", buffered=0,
                                                          stats=stats),
                                              t.keys), "protocol"))

    def huge_frames() -> Outcome:  # 1,500 frames of 1 MiB in one message, more than any request has
        master = psutil.Process(t.master.pid)
        rss, peak = master.memory_info().rss, 0
        sock = t.socket(t.addr, t.keys)
        send(sock, msg("status") + [b"x" * (1 << 20)] * 1500)
        for _ in range(40):
            time.sleep(0.1)
            peak = max(peak, master.memory_info().rss - rss)
        sock.close()
        time.sleep(1.0)
        left = master.memory_info().rss - rss
        return Outcome(peak < 256 << 20, note=f"master memory +{peak >> 20} MiB at peak, +{left >> 20} MiB after: "
                                              "libzmq holds a multipart message whole before the first part is "
                                              "readable, so only the size of each frame is bounded")

    def register_flood() -> Outcome:
        sock = t.socket(t.addr, t.keys)
        codes = []
        for i in range(150):
            send(sock, msg("register", addr=f"tcp://127.0.0.1:{20000 + i}", pid=1, fingerprint="x"))
            if sock.poll(2000):
                codes.append(header_of(sock.recv_multipart()).get("code"))
        sock.close()
        time.sleep(6.0)  # the fakes never heartbeat: past --heartbeat-timeout they are gone again
        return Outcome("flood" in codes)

    def never_reads() -> Outcome:  # a member asking for rank 0's batches and never reading them
        sock = t.socket(worker_addr, t.keys)
        sock.setsockopt(zmq.RCVHWM, 10)
        for _ in range(5000):
            send(sock, msg("credit", session="s-5", token="", seq=0, pieces=1, bytes=1 << 30))
        time.sleep(1.0)
        sock.close()
        return Outcome(True)

    def command_lines() -> Outcome:  # finding 2: /proc/PID/cmdline is every local user's to read
        shown = [pid for pid in t.pids() if str(t.table) in " ".join(psutil.Process(pid).cmdline())]
        return Outcome(not shown, note=f"table path on the command line of {shown}" if shown else "")

    def planted_key() -> Outcome:  # finding 6: a public_keys/ another user may write to
        copy = t.tmp / "keys-group-writable"
        shutil.copytree(t.keys.directory, copy)
        os.chmod(copy / "public_keys", 0o770)
        try:
            auth.load(str(copy))
        except auth.AuthError as e:
            return Outcome("public_keys" in str(e))
        return Outcome(False)

    def metrics_page() -> Outcome:  # finding 7: any path answered, the table named
        try:
            urllib.request.urlopen(t.metrics.rsplit("/", 1)[0] + "/anything", timeout=5)
            other_path = False
        except urllib.error.HTTPError as e:
            other_path = e.code == 404
        page = urllib.request.urlopen(t.metrics, timeout=5).read().decode()
        return Outcome(other_path and str(t.table) not in page)

    def resume_flood() -> Outcome:  # finding 4: done lists of 2**20 ranges grew a master by 322 MB
        welcome = t.ask(t.addr, hello(job_spec(t)), t.keys, 5.0)
        master = psutil.Process(t.master.pid)
        rss = master.memory_info().rss
        fragments = [[0, 2 * i, 2 * i + 1] for i in range(1 << 20)]
        refused = all(is_error(t.ask(t.addr, msg("start_epoch", session=welcome["session"], epoch=e, done=fragments),
                                     t.keys, 30.0)) for e in range(10))
        grown = (master.memory_info().rss - rss) >> 20
        t.ask(t.addr, msg("goodbye", session=welcome["session"]), t.keys)
        return Outcome(refused and grown < 64, note=f"master memory +{grown} MiB after 10 messages of 2**20 ranges")

    def bad_address() -> Outcome:  # finding 5: tcp://*:1 was accepted and crashed every client
        return Outcome(is_error(t.ask(t.addr, msg("register", addr="tcp://*:1", pid=1,
                                                  fingerprint=t.status()["job"]["fingerprint"]), t.keys)))

    def drain_all() -> Outcome:  # finding 5: drain sent for every worker emptied a fixed pool for good
        replies = [t.ask(t.addr, msg("drain", worker_id=w["id"], token="forged"), t.keys)
                   for w in t.status()["workers"]]
        time.sleep(2.0)
        return Outcome(all(is_error(r) for r in replies) and not any(w["draining"] for w in t.status()["workers"]))

    def take_another_ranks_epoch() -> Outcome:  # finding 3: a member's credit took a victim's rows
        spec = job_spec(t)
        # The attacker holds the key and a session token of its own (from a hello before the
        # victim's, which then takes the rank over), and learns the victim's session id.
        own = t.ask(t.addr, hello(spec), t.keys, 5.0)
        token = own.get("token", "") if own and own["t"] == "welcome" else ""
        victim = RemoteDataLoader(spec, master=t.addr, auth=t.keys.directory, timeout=120)
        len(victim)  # hello: the victim has its session, not yet an epoch
        workers = [w["addr"] for w in t.status()["workers"]]
        socks = [t.socket(addr, t.keys) for addr in workers]

        def steal() -> int:
            rows = 0
            for sock in socks:
                for seq in range(3):
                    send(sock, msg("credit", session=victim.session.id, token=token, seq=seq, pieces=1 << 20,
                                   bytes=1 << 40))
            for sock in socks:
                while sock.poll(300):
                    header = header_of(sock.recv_multipart())
                    rows += sum(header["rows"]) if header["t"] == "batch" else 0
            return rows

        taken = steal()  # before the victim starts
        rows: list[int] = []
        started = threading.Event()

        def read() -> None:
            for b in victim:
                rows.extend(b.passthrough["row_id"].tolist())
                started.set()
                time.sleep(0.005)
        reader = threading.Thread(target=read)
        reader.start()
        started.wait(60)
        taken += steal()  # during its epoch
        reader.join(120)
        victim.close()
        for sock in socks:
            sock.close()
        exact = sorted(rows) == list(range(ROWS[0]))
        note = ("" if exact else f"the victim got {len(rows)} rows; ") + ("" if token else "the attacker had no token")
        return Outcome(exact and taken == 0 and bool(token), taken, note)

    def sealed_credit_forgeries() -> Outcome:  # issue 26: the token and key a victim's credit shows
        spec = job_spec(t)
        captured: list[list] = []
        real = seal.Sealer.seal_frames

        def capture(self, make_header, frames):  # what an on-path observer sees of the victim's credit
            parts = real(self, make_header, frames)
            if not frames:
                captured.append([bytes(p) for p in parts])
            return parts

        seal.Sealer.seal_frames = capture
        try:
            victim = RemoteDataLoader(spec, master=t.addr, auth=t.keys.directory, timeout=120)
            rows = sum(len(b) for b in victim)
        finally:
            seal.Sealer.seal_frames = real
        session, token, key = victim.session.id, victim.session.token, victim.session.seals.pair.public_hex
        workers = [w["addr"] for w in t.status()["workers"]]
        mine = seal.KeyPair()
        taken = 0
        for addr in workers:
            sock = t.socket(addr, None)
            # the victim's token with the attacker's key; the victim's key, sealed under the attacker's own
            send(sock, msg("credit", session=session, token=token, seq=0, pieces=1 << 20, bytes=1 << 40,
                           key=mine.public_hex))
            for wid in [w["id"] for w in t.status()["workers"]]:
                peer = seal.PeerBook(mine, seal.TO_WORKER, seal.TO_CLIENT).peer(session, wid, mine.public_hex)
                send(sock, peer.sealer.seal_frames(lambda g, n: msg("credit", session=session, token=token, seq=0,
                                                                       pieces=1 << 20, bytes=1 << 40, key=key,
                                                                       gen=g, nonce=n)[0], []))
            for parts in captured[-8:]:  # the victim's own sealed credit, replayed
                send(sock, parts)
            while sock.poll(500):
                header = header_of(sock.recv_multipart())
                taken += sum(header["rows"]) if header["t"] == "batch" else 0
            sock.close()
        victim.close()
        return Outcome(taken == 0 and rows == ROWS[0] and bool(captured), taken,
                       "" if captured else "no credit captured")

    def made_up_sessions() -> Outcome:  # finding 3: credit for made-up ranks filled the table
        sock = t.socket(t.status()["workers"][0]["addr"], t.keys)
        for i in range(20_000):
            send(sock, msg("credit", session=f"s-{i:012x}", token="", seq=0, pieces=1, bytes=1))
        time.sleep(1.0)
        sock.close()
        return Outcome(True)

    return {
        "local user: the table path in a process's command line": command_lines,
        "local user: a key directory with group-writable public_keys/": planted_key,
        "outsider: metrics at another path, and the table on the page": metrics_page,
        "insider: 10 start_epoch with 2**20-range done lists": resume_flood,
        "insider: register tcp://*:1": bad_address,
        "insider: drain every worker": drain_all,
        "insider: credit for another rank's session (before and during)": take_another_ranks_epoch,
        "insider: credit from 20,000 made-up sessions": made_up_sessions,
        "outsider: a victim's token with its own key, its key sealed under another, its sealed credit replayed":
            sealed_credit_forgeries,
        "outsider: status / get_spec / register at the master": outsider_master,
        "outsider: credit x40 and drain at a worker": outsider_worker,
        "insider: credit for run 2**62": lambda: Outcome(
            t.ask(worker_addr, msg("credit", session="s-0", token="", seq=2**62, pieces=1, bytes=1 << 30), t.keys,
                  0.5) is None),
        "insider: heartbeat stats cpu='x'": bad_stats({"cpu": "x"}),
        "insider: heartbeat stats rows='x'": bad_stats({"rows": "x"}),
        "insider: heartbeat stats split of two items": bad_stats({"split": [0, 1]}),
        "insider: start_epoch -1": lambda: Outcome(is_error(t.ask(t.addr, msg(
            "start_epoch", session="redteam", epoch=-1), t.keys))),
        "insider: hello with world_size 3e7": lambda: Outcome(is_error(t.ask(t.addr, hello(
            spec_for(str(t.table)), world_size=30_000_000), t.keys), "bad_rank", "spec_mismatch")),
        "insider: split_failed for a split it does not hold": lambda: Outcome(is_error(t.ask(t.addr, msg(
            "split_failed", worker_id="w-x", token="", epoch=0, split_id=0, error="forged"), t.keys), "unknown_worker")),
        "insider: 1,500 x 1 MiB frames": huge_frames,
        "insider: 150 registers from one peer": register_flood,
        "insider: 5,000 credits, never read": never_reads,
    }


def random_messages(rng: np.random.Generator, n: int) -> list[list]:
    """Generated messages: every documented type with random or hostile fields, random
    bytes, truncated msgpack, extra frames."""
    fields = {M.tag(c): [f for f in c.__struct_fields__ if f != "v"] for c in M.MESSAGE_TYPES}
    kinds = sorted(fields)
    pool: list = [0, 1, -1, 2**62, -(2**63), 3.5, float("nan"), "", "w-x", "x" * 5000, None, True, [], {},
                  [[0, 1]], [[0, 1, 2]], {"cpu": "x"}, {"split": [0]}, b"\x00"]
    out = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.1:
            out.append([rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes()])
            continue
        t = kinds[int(rng.integers(len(kinds)))]
        header = {"v": V, "t": t}
        for name in fields[t]:
            if rng.random() < 0.8:
                header[name] = pool[int(rng.integers(len(pool)))]
        raw = msgpack.packb(header, use_bin_type=True)
        if roll < 0.2:
            raw = raw[: int(rng.integers(0, len(raw) + 1))]
        out.append([raw] + [b"y" * int(rng.integers(0, 100))] * int(rng.integers(0, 3) if roll < 0.9 else 70))
    return out


def blast(t: Target, addr: str, messages: list[list]) -> Outcome:
    sock = t.socket(addr, t.keys)
    sock.setsockopt(zmq.SNDHWM, 0)
    start = time.monotonic()
    for m in messages:
        send(sock, m)
    last = time.monotonic()
    while sock.poll(1000):  # every message that gets an answer has been handled
        sock.recv_multipart()
        last = time.monotonic()
    took = last - start
    sock.close()
    return Outcome(True, note=f"{len(messages) / took:,.0f} messages/s")


# -- the run ---------------------------------------------------------------------------------
def run_case(t: Target, name: str, case: Callable[[], Outcome]) -> Row:
    pids = t.pids()
    try:
        outcome = case()
    except Exception as e:  # the harness itself failing is reported, not hidden
        print(f"{name}: harness error {type(e).__name__}: {e}", file=sys.stderr)
        outcome = Outcome(False)
    status = t.status()
    survived = t.master.poll() is None and t.pids() == pids
    if not survived:
        outcome.note += (f" processes before {pids}, after {t.pids() if t.master.poll() is None else 'master gone'}; "
                         f"workers the master knows: {[w['pid'] for w in (status or {}).get('workers', [])]}")
    return Row(name, survived, outcome.clear_error, status is None, outcome.rows_exposed, outcome.note)


def run_case_alone(name: str, case: Callable[[], Outcome]) -> Row:
    """A case with a cluster of its own (started and stopped by the case)."""
    started = time.monotonic()
    try:
        out = case()
    except Exception as e:  # noqa: BLE001 (a red-team harness reports, never dies)
        out = Outcome(False, 0, f"{type(e).__name__}: {e}")
    return Row(name, True, out.clear_error, time.monotonic() - started > 120, out.rows_exposed, out.note)


def idle_latency_ms(t: Target) -> float:
    """Median round trip of ``status`` to an idle master: its loop's pass time, from outside."""
    times = []
    for _ in range(20):
        start = time.perf_counter()
        t.status(5.0)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def exact_epochs(t: Target, epochs: int, rows: int) -> bool:
    with RemoteDataLoader(job_spec(t), master=t.addr, auth=t.keys.directory, timeout=120) as loader:
        return all(sorted(r for b in loader for r in b.passthrough["row_id"].tolist()) == list(range(rows))
                   for _ in range(epochs))


def tampered_batches(tmp: Path, table: Path, kind: str) -> Outcome:
    """Issue 26: a worker (test hook) sends an extra replayed or bit-flipped copy of every
    third batch message; the client refuses each, and reads every row once."""
    keys = tmp / "keys"
    env = {**os.environ, ENV_ALLOW_TABLE: json.dumps([str(table)]), "REMOTELOADER_TEST_SEAL_TAMPER": f"{kind}:3"}
    master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0", "--auth",
                               str(keys), "--workers", "1"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        addr = master.stdout.readline().rsplit(" ", 1)[1].strip()
        spec = {"table": {"path": str(table)}, "features": {"label": "label", "dense": ["float_0"],
                "sparse": [{"name": "s0", "column": "idlist_0"}], "passthrough": ["row_id"]}, "batch_size": 256}
        with RemoteDataLoader(spec, master=addr, auth=str(keys), timeout=120) as loader:
            seen = [r for b in loader for r in b.passthrough["row_id"].tolist()]
            refused = loader.session.seals.refusals.total
        exact = sorted(seen) == list(range(ROWS[0]))
        return Outcome(exact and refused > 0, 0, f"{refused} refused, epoch {'exact' if exact else 'NOT exact'}")
    finally:
        master.terminate()
        master.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=10_000, help="generated messages, each at the master and a worker")
    p.add_argument("--rows", type=int, default=20_000)
    args = p.parse_args()
    ROWS[0] = args.rows
    tmp = Path(tempfile.mkdtemp(prefix="rl-redteam-"))
    generate_table(str(tmp / "t"), rows=args.rows, partitions=2, dense=2, sparse=2, format="orc", seed=5,
                   progress=False)
    # A table beside the allowed one, that no client may read (mode 0600, as the red team's).
    generate_table(str(tmp / "secret" / "t"), rows=SECRET_ROWS, partitions=1, dense=2, sparse=2, format="orc",
                   seed=6, progress=False)
    for f in (tmp / "secret").rglob("*"):
        f.chmod(0o700 if f.is_dir() else 0o600)
    t = Target(tmp, tmp / "t")
    rows: list[Row] = []
    try:
        deadline = time.monotonic() + 60
        while len((t.status() or {}).get("workers", [])) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        for name, case in {**before_the_job(t), **spec_files(t)}.items():
            rows.append(run_case(t, name, case))
        exact = exact_epochs(t, 1, args.rows)  # the job now exists
        worker_addr = t.status()["workers"][0]["addr"]
        for name, case in with_the_job(t, worker_addr).items():
            rows.append(run_case(t, name, case))
        rng = np.random.default_rng(11)
        rows.append(run_case(t, f"generated: {args.messages:,} messages at the master",
                             lambda: blast(t, t.addr, random_messages(rng, args.messages))))
        rows.append(run_case(t, f"generated: {args.messages:,} messages at a worker",
                             lambda: blast(t, worker_addr, random_messages(rng, args.messages))))
        exact = exact and exact_epochs(t, 2, args.rows)
        idle_ms = idle_latency_ms(t)
    finally:
        t.stop()
    for kind in ("replay", "flip", "reorder"):
        rows.append(run_case_alone(f"worker hook: a {dict(flip='bit-flipped').get(kind, kind + 'ed')} copy of every 3rd batch message",
                                   lambda kind=kind: tampered_batches(tmp, tmp / "t", kind)))
    from .redteam_cache import cases as cache_cases  # issue 37, findings 2, 4 and 6: clusters of their own

    for name, case in cache_cases(tmp, str(tmp / "keys"), args.rows).items():
        rows.append(run_case_alone(name, lambda case=case: Outcome(*case())))
    from .redteam_cache_store import cases as cache_store_cases  # issue 37, findings 1, 5, 7 and 8

    for name, case in cache_store_cases(tmp, str(tmp / "keys"), args.rows).items():
        rows.append(run_case_alone(name, lambda case=case: Outcome(*case())))
    width = max(len(r.case) for r in rows)
    print(f"{'case':<{width}}  survived  clear error  hang  rows exposed")
    for r in rows:
        print(f"{r.case:<{width}}  {'yes' if r.survived else 'NO':<8}  {'yes' if r.clear_error else 'NO':<11}  "
              f"{'YES' if r.hang else 'no':<4}  {r.rows_exposed}")
    for r in rows:
        if r.note:
            print(f"  {r.case}: {r.note}")
    crashes, hangs, exposed = (sum(not r.survived for r in rows), sum(r.hang for r in rows),
                               sum(r.rows_exposed for r in rows))
    print(f"\n{len(rows)} cases: {crashes} crashes, {hangs} hangs, {exposed} rows exposed without the key, "
          f"{sum(not r.clear_error for r in rows)} without a clear error; "
          f"legitimate epochs afterwards exact: {'yes' if exact else 'NO'}; idle master answers in {idle_ms:.2f} ms "
          "(median of 20 status calls)")
    return 0 if crashes == hangs == exposed == 0 and exact else 1


if __name__ == "__main__":
    sys.exit(main())
