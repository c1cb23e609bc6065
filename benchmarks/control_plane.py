"""The control plane under a large job's load: a real master process, simulated peers.

Simulated workers and clients speak the real protocol (no data, no transforms): W
workers heartbeat every 0.5 s and R ranks acknowledge every 0.25 s, as the real ones do.
The same load runs against this tree's master and against a baseline commit's master
(a git worktree), one after the other in the same run. Reported per master:

* master CPU (cores) and request latency p50 / p99, measured by the load generator;
* journal bytes written per hour at that load, and the time to replay the journal a
  24-hour job would leave (the journal of the run, replayed and scaled to 24 hours
  where it grows with time).

A second measure, the **idle pass** of a large job: a master (in a child process, per
tree) whose job has ``--files`` files and ``--splits`` splits, with ``--journal``, doing
nothing but its periodic duties (``tick`` and the journal ``sync`` the loop runs each
pass): milliseconds per pass, median and worst. The journal's compaction rule decides it
(a rule on the snapshot's own size compacts a large job's state on every pass). Then the
time to replay that compacted journal (decode and apply), what a restart of the master costs.

Run: ``.venv/bin/python -m benchmarks.control_plane [--workers 1000 --ranks 256 --seconds 20]
[--files 3000 --splits 100000]``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Iterator

import msgpack
import numpy as np
import psutil
import zmq

from remoteloader.spec import DatasetSpec
from remoteloader.tools.datagen import generate_table

ROOT = Path(__file__).resolve().parent.parent
SOCKETS = 32  # simulated peers share these DEALER sockets (replies come back in order per socket)


def encode_request(version: int, t: str, **fields) -> bytes:
    return msgpack.packb({"v": version, "t": t, **fields}, use_bin_type=True)


class Peers:
    """The simulated peers' requests in the protocol version of the master under test (from 7
    on, the master issues client sessions and runs, and workers name their job; from 8 on, a
    worker proves who it is with the token ``registered`` gave it)."""

    def __init__(self, version: int, fingerprint: str) -> None:
        self.version, self.fingerprint = version, fingerprint
        self.request = partial(encode_request, version)
        self.sessions: dict[int, str] = {}
        self.seqs: dict[int, int] = {}
        self.workers: dict[int, dict] = {}  # worker -> its worker_id (and token, from 8 on)

    def register(self, i: int) -> bytes:
        extra = {"fingerprint": self.fingerprint} if self.version >= 7 else {}
        return self.request("register", addr=f"tcp://127.0.0.1:{10000 + i}", pid=1000 + i, **extra)

    def registered(self, i: int, reply: dict) -> None:
        self.workers[i] = {"worker_id": reply["worker_id"], **({"token": reply["token"]} if self.version >= 8 else {})}

    def heartbeat(self, i: int, stats: dict) -> bytes:
        return self.request("heartbeat", buffered=4, stats=stats, **self.workers[i])

    def hello(self, r: int, ranks: int, spec: dict) -> bytes:
        extra = {} if self.version >= 7 else {"client_id": f"c{r}"}
        return self.request("hello", rank=r, world_size=ranks, spec=spec, fingerprint=self.fingerprint, **extra)

    def welcomed(self, r: int, reply: dict) -> None:
        self.sessions[r] = reply.get("session", f"c{r}")

    def start_epoch(self, r: int) -> bytes:
        return self.request("start_epoch", epoch=0, **self._client(r))

    def started(self, r: int, reply: dict) -> None:
        self.seqs[r] = reply.get("seq", 0)

    def client_heartbeat(self, r: int, acks: list, stats: dict) -> bytes:
        run = {"seq": self.seqs[r]} if self.version >= 7 else {"epoch": 0}
        return self.request("client_heartbeat", acks=acks, stats=stats, **self._client(r), **run)

    def _client(self, r: int) -> dict:
        return {"session": self.sessions[r]} if self.version >= 7 else {"client_id": self.sessions[r]}


def protocol_version(src: Path) -> int:
    """The protocol version the master under ``src`` speaks (the baseline may be older)."""
    for name in ("messages.py", "wire.py"):  # protocol 9 moved it into messages.py
        path = src / "remoteloader" / "protocol" / name
        match = path.exists() and re.search(r"^PROTOCOL_VERSION = (\d+)", path.read_text(), re.M)
        if match:
            return int(match.group(1))
    raise ValueError(f"no PROTOCOL_VERSION under {src}")


class Load:
    """Sends each peer's requests on schedule over a few sockets and times every reply."""

    def __init__(self, addr: str) -> None:
        self.ctx = zmq.Context.instance()
        self.socks = []
        for _ in range(SOCKETS):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
            self.socks.append(s)
        self.sent: list[deque] = [deque() for _ in self.socks]
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)
        self.latencies: list[float] = []

    def call(self, i: int, body: bytes) -> dict:
        sock = self.socks[i % SOCKETS]
        sock.send(body)
        if not sock.poll(30_000):
            raise TimeoutError("the master did not answer in 30 s")
        return msgpack.unpackb(sock.recv(), raw=False)

    def send(self, i: int, body: bytes) -> None:
        self.socks[i % SOCKETS].send(body)
        self.sent[i % SOCKETS].append(time.perf_counter())

    def drain(self, timeout_ms: int) -> None:
        for sock, _ in self.poller.poll(timeout_ms):
            k = self.socks.index(sock)
            while sock.poll(0):
                sock.recv()
                self.latencies.append(time.perf_counter() - self.sent[k].popleft())

    def close(self) -> None:
        for s in self.socks:
            s.close()


def run_load(src: Path, spec_path: Path, workers: int, ranks: int, seconds: float) -> dict:
    journal = Path(tempfile.mkdtemp(prefix="rl-cp-journal-"))
    env = {**os.environ, "PYTHONPATH": str(src)}
    master = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                               "--spec", str(spec_path), "--journal", str(journal), "--heartbeat-timeout", "30",
                               "--max-workers-per-client", "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=src)
    addr = master.stdout.readline().rsplit(" ", 1)[1].strip()
    load = Load(addr)
    try:
        spec = DatasetSpec.from_file(spec_path)
        peers = Peers(protocol_version(src), spec.fingerprint())
        for i in range(workers):
            peers.registered(i, load.call(i, peers.register(i)))
        splits = {}
        for r in range(ranks):
            peers.welcomed(r, load.call(r, peers.hello(r, ranks, spec.to_dict())))
            reply = load.call(r, peers.start_epoch(r))
            peers.started(r, reply)
            splits[r] = [s[0] for s in reply["splits"]]
        stats = {"rows": 0, "batches": 0, "splits": 0, "busy_s": 0.0, "cpu": 0.5, "capacity": 16, "ahead": 0,
                 "mem": 1e8, "time": 0.0}
        size0 = sum(f.stat().st_size for f in journal.iterdir())
        proc = psutil.Process(master.pid)
        cpu0, start = proc.cpu_times(), time.perf_counter()
        next_worker = np.arange(workers) * 0.5 / workers + start  # spread evenly over the period
        next_rank = np.arange(ranks) * 0.25 / ranks + start
        acked = {r: 0 for r in range(ranks)}
        while (now := time.perf_counter()) - start < seconds:
            for i in np.flatnonzero(next_worker <= now):
                stats["rows"] += 1000
                load.send(i, peers.heartbeat(i, stats))
                next_worker[i] += 0.5
            for r in np.flatnonzero(next_rank <= now):
                acked[r] += 1  # one more piece of the rank's first split consumed, as a training loop does
                load.send(r, peers.client_heartbeat(r, [[splits[r][0], acked[r]]],
                                                    {"batches": acked[r], "wait_s": 0.0}))
                next_rank[r] += 0.25
            load.drain(1)
        elapsed = time.perf_counter() - start  # the load's period: the last replies are collected after it
        cpu1 = proc.cpu_times()
        load.drain(2000)
        cpu = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / elapsed
        lat = np.array(load.latencies) * 1000
        written = sum(f.stat().st_size for f in journal.iterdir()) - size0
    finally:
        load.close()
        master.terminate()
        master.wait(30)
    # Replay: what this run's journal costs, scaled to a 24-hour job where it grows with time.
    records, replay_s = replay_journal(src, journal)
    size = sum(f.stat().st_size for f in journal.iterdir())
    per_hour = written / elapsed * 3600
    return {"requests": len(lat), "rate": len(lat) / elapsed, "cpu": cpu, "p50": float(np.percentile(lat, 50)),
            "p99": float(np.percentile(lat, 99)), "journal_bytes_per_hour": per_hour, "records": records,
            "journal_24h_bytes": size + per_hour * 24, "replay_24h_s": replay_s * (size + per_hour * 24) / max(size, 1)}


IDLE_SPEC = {"batch_size": 64, "seed": 0, "shuffle": True, "drop_last": False, "even_batches": "pad",
             "on_error": "fail", "table": {"path": "/synthetic"}, "features": {"dense": ["x"]}}


def measure_idle_pass(files: int, splits: int, passes: int) -> dict:
    """Runs in the child, against whichever ``remoteloader`` its PYTHONPATH names: a journaled
    master whose job has ``files`` files and ``splits`` splits, timed over idle passes."""
    import statistics

    from remoteloader.formats import DataFile, Unit
    from remoteloader.master import updates as U
    from remoteloader.master.journal import Journal
    from remoteloader.master.service import MasterConfig, MasterService
    from remoteloader.master.state import JobState

    units_per_file = -(-splits // files)
    # Paths and partitions as long as a warehouse's (an object store URI, a date partition).
    data_files = [DataFile(f"s3://warehouse/ads/impressions_flat/ds=2026-11-{f % 28 + 1:02d}/"
                           f"part-{f:05d}-7d5c1e2a-4b3f-4e8e-9a41-0c6d2f5b8e13.c000.orc", "orc",
                           f"ds=2026-11-{f % 28 + 1:02d}", units_per_file * 640, units_per_file * 64 << 10,
                           tuple(Unit(u, u * 640, 640, 64 << 10) for u in range(units_per_file)))
                  for f in range(files)]
    rows = [[i // units_per_file, i % units_per_file, i % units_per_file + 1, 640, 640, 640 * i] for i in range(splits)]
    if hasattr(U, "file_record"):  # typed updates (issue 24): the spec and records as such
        job = U.JobSubmitted(DatasetSpec.from_dict(IDLE_SPEC), "fp", {"x": "float"},
                             [U.file_record(f) for f in data_files], [U.SplitRecord(*r) for r in rows], [])
    else:
        job = U.JobSubmitted(IDLE_SPEC, "fp", {"x": "float"}, [f.to_wire() for f in data_files], rows, [])
    journal = Path(tempfile.mkdtemp(prefix="rl-idle-"))
    service = MasterService(MasterConfig(heartbeat_timeout=3600.0), Journal(journal))
    service._commit(job)
    for w in range(16):
        service._commit(U.WorkerRegistered(f"w{w}", f"tcp://127.0.0.1:{7000 + w}", w, service.clock()))
    service.sync()  # the job is durable (and compacted, past the threshold)
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        service.tick()
        service.sync()
        times.append(time.perf_counter() - t)
    snapshot = service.journal.size
    # The journal a restart replays: one snapshot (before issue 24, a dict that Snapshot wraps).
    snap = service.state.snapshot()
    service.journal.compact(U.Snapshot(snap) if isinstance(snap, dict) else snap)
    service.journal.close()
    replays = []
    for _ in range(3):
        t = time.perf_counter()
        state = JobState()
        for update in Journal(journal).replay():
            state.apply(update)
        replays.append(time.perf_counter() - t)
    assert len(state.job.splits) == splits
    return {"pass_ms": statistics.median(times) * 1e3, "worst_ms": max(times) * 1e3, "journal_mb": snapshot / 2**20,
            "replay_ms": min(replays) * 1e3}


def run_in_tree(src: Path, module_file: str, call: str) -> dict:
    """``call`` (an expression on ``mod``, the benchmark module at ``module_file``) in a child
    whose only ``remoteloader`` is the one under ``src``; it must return JSON-able data."""
    code = ("import importlib.util, json, sys\n"
            f"spec = importlib.util.spec_from_file_location('bench', {module_file!r})\n"
            "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
            f"print(json.dumps({call}))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(src)}, cwd=src,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_idle_pass(src: Path, files: int, splits: int, passes: int) -> dict:
    """``measure_idle_pass`` in a child whose only ``remoteloader`` is the one under ``src``."""
    return run_in_tree(src, __file__, f"mod.measure_idle_pass({files}, {splits}, {passes})")


def replay_journal(src: Path, journal: Path) -> tuple[int, float]:
    """Records in ``journal`` and the seconds its replay takes, by the code under ``src`` (its
    own record types: another tree's journal would be quarantined record by record)."""
    code = ("import json, sys, time\n"
            "from remoteloader.master.journal import Journal\n"
            "t = time.perf_counter(); n = sum(1 for _ in Journal(sys.argv[1]).replay())\n"
            "print(json.dumps([n, time.perf_counter() - t]))")
    out = subprocess.run([sys.executable, "-c", code, str(journal)], env={**os.environ, "PYTHONPATH": str(src)},
                         cwd=src, capture_output=True, text=True, check=True)
    records, seconds = json.loads(out.stdout)
    return records, seconds


@contextmanager
def baseline_tree(ref: str) -> Iterator[Path]:
    """A git worktree of ``ref`` (the code to compare with in the same run), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="rl-base-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--baseline", default="d6ca469", help="git ref of the master to compare with (today's code)")
    p.add_argument("--files", type=int, default=3000, help="files of the idle-pass job")
    p.add_argument("--splits", type=int, default=100_000, help="splits of the idle-pass job")
    p.add_argument("--passes", type=int, default=20, help="idle passes timed")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rl-cp-"))
    generate_table(str(tmp / "t"), rows=args.ranks * 4 * 64, partitions=1, dense=1, sparse=1, format="orc", seed=3,
                   progress=False)
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps({"table": {"path": str(tmp / "t")},
                                     "features": {"label": "label", "dense": ["float_0"],
                                                  "sparse": [{"name": "s0", "column": "idlist_0"}]},
                                     "batch_size": 1, "split_rows": 64}))
    with baseline_tree(args.baseline) as base:
        results = {"baseline " + args.baseline: run_load(base, spec_path, args.workers, args.ranks, args.seconds),
                   "this tree": run_load(ROOT, spec_path, args.workers, args.ranks, args.seconds)}
        idle = {"baseline " + args.baseline: run_idle_pass(base, args.files, args.splits, args.passes),
                "this tree": run_idle_pass(ROOT, args.files, args.splits, args.passes)}
    print(f"{args.workers} workers heartbeating at 2/s, {args.ranks} ranks acknowledging at 4/s, "
          f"{args.seconds:g} s each\n")
    print(f"{'master':<18} {'req/s':>7} {'CPU cores':>9} {'p50 ms':>7} {'p99 ms':>7} {'journal MB/h':>12} "
          f"{'24h journal MB':>14} {'24h replay s':>12}")
    for name, r in results.items():
        print(f"{name:<18} {r['rate']:>7.0f} {r['cpu']:>9.2f} {r['p50']:>7.2f} {r['p99']:>7.2f} "
              f"{r['journal_bytes_per_hour'] / 2**20:>12.1f} {r['journal_24h_bytes'] / 2**20:>14.1f} "
              f"{r['replay_24h_s']:>12.2f}")
    print(f"\nidle passes of a journaled master: {args.files} files, {args.splits} splits, {args.passes} passes\n")
    print(f"{'master':<18} {'pass ms':>8} {'worst ms':>9} {'journal MB':>10} {'replay ms':>9}")
    for name, r in idle.items():
        print(f"{name:<18} {r['pass_ms']:>8.2f} {r['worst_ms']:>9.2f} {r['journal_mb']:>10.1f} "
              f"{r['replay_ms']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
