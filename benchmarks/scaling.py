"""How the loader scales with its workers (issue 36 part 4): rows/s, the client's CPU per GB
and the workers' CPU per row for 1, 2, 4, 8 and 12 local workers (those the host has cores
for, or ``--workers 1,2,4``), with the 13 dense + 26 sparse job of ``benchmarks.gpu_feed``
(clamp; firstx 20 then sigrid_hash), batch 4096, one table; then the knee of the curve and
what looks like its cause.

Each worker count runs in its own child process (an embedded ``RemoteDataLoader(spec,
num_workers=N)``: a master and N workers under it), watched as ``gpu_feed`` watches its modes
(a hung count is reported and stopped by pid, the run goes on). In the child: warm-up
(``--warmup`` batches and at least ``--warmup-seconds``), then a window of ``--seconds`` of
iterating (epochs follow each other), no training:

* rows/s: the window's rows over its wall time;
* client CPU per GB: this child's CPU (``resource.getrusage``: every thread of the loader)
  over the window, per GB of batch tensors delivered (``gpu_feed.batch_nbytes``, as
  ``benchmarks.pinning.nbytes``); "client cores" is that CPU over wall time and "busiest
  thread" the share of one core its busiest thread used (``psutil`` per-thread times);
* worker CPU per row: the user + system CPU of the master's descendants (the workers, by
  ``psutil``) over the window per row delivered; "worker busy" is that CPU over wall time x N
  (1.0: every worker busy all the time); the master's own CPU is shown apart;
* host busy: the whole host's CPU (all processes, other users' too) over the window.

The knee is the last count before rows/s stops growing 1.5x per doubling of workers (growth
between counts that are not a doubling is scaled to one); its cause is read at the count after
the knee: the host's cores all busy, the workers busy ~100% each, the client ~1 core (or its
busiest thread ~1 core), the master ~1 core, or neither (then waiting: storage, the credit
window, memory bandwidth).

Run: ``python -m benchmarks.scaling [--rows 800000] [--workers 1,2,4,8,12] [--table DIR]``;
CPU smoke: ``.venv/bin/python -m benchmarks.scaling --workers 1,2 --rows 40000 --seconds 4``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

from benchmarks.gpu_feed import (batch_nbytes, child_main, cycle_epochs, dlrm_spec, emit, ensure_table,
                                 exit_on_sigterm, run_child)

BUSY = 0.85  # a resource this busy (share of its cores) counts as saturated


def _times(p: psutil.Process) -> Optional[float]:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


class TreeCPU:
    """CPU seconds of the master (this process's direct children) and of the processes under
    it (the workers), between ``start()`` and ``stop()``; a worker that exits in between
    keeps its last reading, one that starts in between counts from zero."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.role: dict[int, str] = {}

    def _read(self) -> dict[int, float]:
        out = {}
        for master in self.me.children():
            t = _times(master)
            if t is not None:
                out[master.pid] = t
                self.role[master.pid] = "master"
            with contextlib.suppress(psutil.NoSuchProcess):
                for w in master.children(recursive=True):
                    t = _times(w)
                    if t is not None:
                        out[w.pid] = t
                        self.role[w.pid] = "worker"
        return out

    def start(self) -> None:
        self.first = self._read()
        self.last = dict(self.first)

    def sample(self) -> None:
        self.last.update(self._read())

    def stop(self) -> dict[str, float]:
        self.sample()
        spent = {"master": 0.0, "worker": 0.0}
        for pid, t in self.last.items():
            spent[self.role[pid]] += t - self.first.get(pid, 0.0)
        return spent


def thread_times() -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def child(cfg: dict) -> None:
    from remoteloader import RemoteDataLoader

    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    spec = dlrm_spec(cfg["table"], 13, 26, cfg["batch_size"], cfg["hash_size"], cfg["split_rows"], shuffle=True)
    workers = cfg["workers"]
    with RemoteDataLoader(spec, num_workers=workers, timeout=cfg["loader_timeout"]) as loader:
        it = cycle_epochs(loader)
        try:
            start, n, last_emit = time.perf_counter(), 0, 0.0
            while n < cfg["warmup"] or time.perf_counter() - start < cfg["warmup_seconds"]:
                next(it)
                n += 1
                if time.perf_counter() - last_emit > 0.5:
                    emit(progress=n, phase="warm-up")
                    last_emit = time.perf_counter()
            emit(progress=n, phase="measure")
            tree = TreeCPU()
            tree.start()
            th0, host0 = thread_times(), psutil.cpu_times()
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            rows = nbytes = batches = 0
            while time.perf_counter() - t0 < cfg["seconds"] or batches < cfg["min_batches"]:
                b = next(it)
                rows += len(b)
                nbytes += batch_nbytes(b)
                batches += 1
                if time.perf_counter() - last_emit > 0.5:
                    emit(progress=n + batches, phase="measure")
                    tree.sample()
                    last_emit = time.perf_counter()
            wall = time.perf_counter() - t0
            r1, th1, host1 = resource.getrusage(resource.RUSAGE_SELF), thread_times(), psutil.cpu_times()
            spent = tree.stop()
        finally:
            it.close()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    busiest = max((t - th0.get(tid, 0.0) for tid, t in th1.items()), default=0.0)
    host_total = sum(host1) - sum(host0)
    host_idle = (host1.idle + getattr(host1, "iowait", 0.0)) - (host0.idle + getattr(host0, "iowait", 0.0))
    emit(result={"workers": workers, "rows": rows, "batches": batches, "bytes": nbytes, "wall": wall,
                 "rows_s": rows / wall, "client_cpu": cpu, "client_cores": cpu / wall,
                 "client_s_gb": cpu / (nbytes / 1e9), "busiest_thread": busiest / wall,
                 "worker_cpu": spent["worker"], "worker_us_row": spent["worker"] / rows * 1e6,
                 "worker_busy": spent["worker"] / (wall * workers), "master_cores": spent["master"] / wall,
                 "host_busy": 1 - host_idle / host_total if host_total > 0 else None})


def knee(points: list[dict], cores: int) -> str:
    """The knee (the last count before rows/s grows < 1.5x per doubling) and its likely cause."""
    ok = [p for p in points if p.get("status") == "ok"]
    if len(ok) < 2:
        return "knee: too few points to tell"
    for a, b in zip(ok, ok[1:]):
        doublings = math.log2(b["workers"] / a["workers"])
        per_doubling = (b["rows_s"] / a["rows_s"]) ** (1 / doublings)
        if per_doubling < 1.5:
            causes = []
            if b.get("host_busy") is not None and b["host_busy"] >= BUSY:
                causes.append(f"the host's CPU ({cores} cores {b['host_busy']:.0%} busy: workers "
                              f"{b['worker_cpu'] / b['wall']:.1f} cores, client {b['client_cores']:.2f}, "
                              f"master {b['master_cores']:.2f})")
            if b["worker_busy"] >= BUSY:
                causes.append(f"workers' CPU saturated ({b['worker_busy']:.0%} busy per worker)")
            if b["client_cores"] >= BUSY or b["busiest_thread"] >= BUSY:
                causes.append(f"client CPU (~1 core: {b['client_cores']:.2f} cores, busiest thread "
                              f"{b['busiest_thread']:.0%})")
            if b["master_cores"] >= BUSY:
                causes.append(f"the master ({b['master_cores']:.2f} cores)")
            if not causes:
                causes.append(f"neither workers ({b['worker_busy']:.0%} busy each) nor client "
                              f"({b['client_cores']:.2f} cores, busiest thread {b['busiest_thread']:.0%}) saturated: "
                              "waiting (storage, credit window, memory bandwidth, the master)")
            return (f"knee: {a['workers']} workers ({a['rows_s']:,.0f} rows/s); {b['workers']} workers grow "
                    f"{per_doubling:.2f}x per doubling; likely cause: " + "; ".join(causes))
    last = ok[-1]
    return (f"knee: none up to {last['workers']} workers (rows/s still grows >= 1.5x per doubling; "
            f"{last['rows_s']:,.0f} rows/s)")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, default=800_000)
    p.add_argument("--table", help="the table's directory (reused when it holds ORC files; default: a temp dir)")
    p.add_argument("--workers", default=None,
                   help="comma-separated worker counts (default: those of 1,2,4,8,12 the host has cores for)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--hash-size", type=int, default=200_000)
    p.add_argument("--split-rows", type=int, default=None)
    p.add_argument("--seconds", type=float, default=6.0, help="the measured window per count")
    p.add_argument("--min-batches", type=int, default=5, help="and at least this many batches")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--warmup-seconds", type=float, default=2.0)
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--stall", type=float, default=45.0)
    p.add_argument("--count-timeout", type=float, default=None,
                   help="per count, all in (default: start-timeout + warm-up + 2 x seconds + 30)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.child:
        child_main(child, args.child)
        return 0

    exit_on_sigterm()
    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    cores = os.cpu_count() or 1
    counts = sorted({int(x) for x in args.workers.split(",") if x.strip()}) if args.workers else \
        [n for n in (1, 2, 4, 8, 12) if n <= max(1, cores)]
    if not counts or counts[0] < 1:
        p.error("--workers: positive counts, comma-separated")
    total = args.count_timeout or (args.start_timeout + args.warmup_seconds + 2 * args.seconds + 30)
    tmp = Path(tempfile.mkdtemp(prefix="rl-scaling-"))
    points: list[dict] = []
    interrupted = False
    try:
        table = Path(args.table) if args.table else tmp / "t"
        gen_s = ensure_table(table, args.rows)
        print(f"# {platform.processor() or platform.machine()}, {cores} CPUs (load {os.getloadavg()[0]:.1f}); "
              f"table {table} ({args.rows:,} rows{', generated in %.0f s' % gen_s if gen_s else ', reused'})",
              file=sys.stderr, flush=True)
        for n in counts:
            cfg = {"workers": n, "table": str(table), "batch_size": args.batch_size, "hash_size": args.hash_size,
                   "split_rows": args.split_rows, "seconds": args.seconds, "min_batches": args.min_batches,
                   "warmup": args.warmup, "warmup_seconds": args.warmup_seconds,
                   "loader_timeout": max(60.0, args.stall + 30)}
            t = time.perf_counter()
            r = run_child("benchmarks.scaling", cfg, args.start_timeout, args.stall, total,
                          lambda s, n=n: print(f"#   [{n} workers] {s}", file=sys.stderr, flush=True))
            r.setdefault("workers", n)
            points.append(r)
            if r["status"] == "ok":
                print(f"# {n:>2} workers: {r['rows_s']:,.0f} rows/s, client {r['client_s_gb']:.2f} s/GB, "
                      f"workers {r['worker_busy']:.0%} busy ({time.perf_counter() - t:.0f} s with start-up)",
                      file=sys.stderr, flush=True)
            else:
                print(f"# {n:>2} workers: {r['status']}: {r.get('detail')}", file=sys.stderr, flush=True)
    except SystemExit:  # SIGTERM (a timeout): stop the children, print what was measured
        interrupted = True
        print("# interrupted (SIGTERM): the counts left are marked so", file=sys.stderr, flush=True)
        done = {r["workers"] for r in points}
        points += [{"status": "interrupted", "detail": "not measured (SIGTERM)", "workers": n}
                   for n in counts if n not in done]
    finally:
        from benchmarks.auth_cost import descendants, reap
        reap(descendants())
        shutil.rmtree(tmp, ignore_errors=True)

    ok = [r for r in points if r["status"] == "ok"]
    gb_per_mrow = (ok[0]["bytes"] / ok[0]["rows"] * 1e6 / 1e9) if ok else 0.0
    print(f"embedded RemoteDataLoader, 13 dense + 26 sparse (clamp; firstx 20, sigrid_hash), batch {args.batch_size}, "
          f"{args.rows:,}-row table, no training; {args.seconds:g} s window per count after warm-up; "
          f"{cores} CPUs ({platform.processor() or platform.machine()})"
          + (f"; {gb_per_mrow:.2f} GB of tensors per million rows" if ok else ""))
    print()
    print("| workers | rows/s | x 1st | client CPU s/GB | client cores | busiest client thread | worker CPU µs/row "
          "| worker busy | master cores | host busy |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in points:
        if r["status"] != "ok":
            print(f"| {r['workers']} | **{r['status']}**: {r.get('detail', '')} | | | | | | | | |")
            continue
        hb = "-" if r.get("host_busy") is None else f"{r['host_busy']:.0%}"
        print(f"| {r['workers']} | {r['rows_s']:,.0f} | {r['rows_s'] / ok[0]['rows_s']:.2f} | {r['client_s_gb']:.2f} "
              f"| {r['client_cores']:.2f} | {r['busiest_thread']:.0%} | {r['worker_us_row']:.1f} "
              f"| {r['worker_busy']:.0%} | {r['master_cores']:.2f} | {hb} |")
    print()
    print(knee(points, cores))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "points": points}, indent=1))
    return 143 if interrupted else 0


if __name__ == "__main__":
    raise SystemExit(main())
