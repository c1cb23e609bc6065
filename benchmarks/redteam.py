"""Red team: hostile peers against a real, authenticated cluster on 127.0.0.1.

Starts a master (``--auth``, ``--allow-table``, a journal, ``--autoscale``) with two
workers, then runs the cases of issue 11 one by one: outsiders (no key, or a key of
their own) and insiders (holding the cluster key, sending what a buggy or hostile
member might), plus a long run of generated messages at the master and a worker. After
every case it checks that every process is still the same process and that the master
answers ``status`` within a second. At the end a legitimate client reads two epochs,
which must hold every row exactly once.

Run: ``.venv/bin/python -m benchmarks.redteam [--messages 10000]``. Prints one table:
case, survived, clear error, hang, rows exposed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import msgpack
import numpy as np
import psutil
import zmq

from remoteloader import RemoteDataLoader
from remoteloader.protocol import auth, wire
from remoteloader.protocol.rpc import MasterUnavailable, RemoteError, RpcClient
from remoteloader.spec import DatasetSpec, SpecError
from remoteloader.tools.datagen import generate_table

V = wire.PROTOCOL_VERSION


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
        self.master = subprocess.Popen(
            [sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0", "--auth", self.keys.directory,
             "--allow-table", str(table), "--workers", "2", "--journal", str(tmp / "journal"), "--autoscale",
             "--min-workers", "2", "--max-workers", "2", "--heartbeat-timeout", "5"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.addr = self.master.stdout.readline().rsplit(" ", 1)[1].strip()
        self.rpc = RpcClient(self.ctx, self.addr, 5.0, auth=self.keys)

    def status(self, timeout_s: float = 1.0) -> Optional[dict]:
        try:
            return self.rpc.call("status", timeout_s=timeout_s)["status"]
        except (MasterUnavailable, RemoteError):
            return None

    def pids(self) -> list[int]:
        return sorted([self.master.pid, *(c.pid for c in psutil.Process(self.master.pid).children())])

    def socket(self, addr: str, creds: Optional[auth.Credentials]) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 200)  # an outsider's handshake never completes: sends would block
        if creds is not None:
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
            return wire.decode(sock.recv_multipart())[0]
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


def is_error(reply: Optional[dict], *codes: str) -> bool:
    return reply is not None and reply["t"] == "error" and (not codes or reply.get("code") in codes)


def spec_for(path: str) -> dict:
    return {"table": {"path": path}, "features": {"label": "label", "dense": ["float_0"],
                                                  "sparse": [{"name": "s0", "column": "idlist_0"}]},
            "batch_size": 256}


def hello(spec: dict, world_size: int = 1, rank: int = 0) -> list:
    return msg("hello", rank=rank, world_size=world_size, spec=spec,
               fingerprint=DatasetSpec.from_dict(spec).fingerprint())


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

    return {"outsider: hello with the table, no key / own key": outsider_spec,
            "insider: spec naming /etc/shadow vs a missing path (oracle)": oracle,
            "insider: spec pointing at another object-store endpoint": endpoint}


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
                send(sock, msg("credit", session="s-0", seq=0, batches=1, bytes=1 << 30))
            while sock.poll(500):
                sock.recv_multipart()
                rows += 1
            send(sock, msg("drain", worker_id="w-x"))
            sock.close()
        return Outcome(rows == 0, rows)

    def bad_stats(stats: dict) -> Callable[[], Outcome]:
        return lambda: Outcome(is_error(t.ask(t.addr, msg("heartbeat", worker_id="w-x", buffered=0, stats=stats),
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
                codes.append(wire.decode(sock.recv_multipart())[0].get("code"))
        sock.close()
        time.sleep(6.0)  # the fakes never heartbeat: past --heartbeat-timeout they are gone again
        return Outcome("flood" in codes)

    def never_reads() -> Outcome:  # a member asking for rank 0's batches and never reading them
        sock = t.socket(worker_addr, t.keys)
        sock.setsockopt(zmq.RCVHWM, 10)
        for _ in range(5000):
            send(sock, msg("credit", session="s-5", seq=0, batches=1, bytes=1 << 30))
        time.sleep(1.0)
        sock.close()
        return Outcome(True)

    return {
        "outsider: status / get_spec / register at the master": outsider_master,
        "outsider: credit x40 and drain at a worker": outsider_worker,
        "insider: credit for run 2**62": lambda: Outcome(
            t.ask(worker_addr, msg("credit", session="s-0", seq=2**62, batches=1, bytes=1 << 30), t.keys, 0.5) is None),
        "insider: heartbeat stats cpu='x'": bad_stats({"cpu": "x"}),
        "insider: heartbeat stats rows='x'": bad_stats({"rows": "x"}),
        "insider: heartbeat stats split of two items": bad_stats({"split": [0, 1]}),
        "insider: start_epoch -1": lambda: Outcome(is_error(t.ask(t.addr, msg(
            "start_epoch", session="redteam", epoch=-1), t.keys))),
        "insider: hello with world_size 3e7": lambda: Outcome(is_error(t.ask(t.addr, hello(
            spec_for(str(t.table)), world_size=30_000_000), t.keys), "bad_rank", "spec_mismatch")),
        "insider: split_failed for a split it does not hold": lambda: Outcome(is_error(t.ask(t.addr, msg(
            "split_failed", worker_id="w-x", epoch=0, split_id=0, error="forged"), t.keys), "unknown_worker")),
        "insider: 1,500 x 1 MiB frames": huge_frames,
        "insider: 150 registers from one peer": register_flood,
        "insider: 5,000 credits, never read": never_reads,
    }


def random_messages(rng: np.random.Generator, n: int) -> list[list]:
    """Generated messages: every documented type with random or hostile fields, random
    bytes, truncated msgpack, extra frames."""
    kinds = sorted(wire.SCHEMAS)
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
        for name in wire.SCHEMAS[t]:
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


def exact_epochs(t: Target, epochs: int, rows: int) -> bool:
    spec = {**spec_for(str(t.table)), "features": {**spec_for(str(t.table))["features"], "passthrough": ["row_id"]}}
    with RemoteDataLoader(spec, master=t.addr, auth=t.keys.directory, timeout=120) as loader:
        return all(sorted(r for b in loader for r in b.passthrough["row_id"].tolist()) == list(range(rows))
                   for _ in range(epochs))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=10_000, help="generated messages, each at the master and a worker")
    p.add_argument("--rows", type=int, default=20_000)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rl-redteam-"))
    generate_table(str(tmp / "t"), rows=args.rows, partitions=2, dense=2, sparse=2, format="orc", seed=5,
                   progress=False)
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
    finally:
        t.stop()
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
          f"legitimate epochs afterwards exact: {'yes' if exact else 'NO'}")
    return 0 if crashes == hangs == exposed == 0 and exact else 1


if __name__ == "__main__":
    sys.exit(main())
