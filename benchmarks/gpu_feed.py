"""Feeding a GPU (issue 36 part 4): a DLRM trained on the device, fed five ways side by side in
one run, printing training rows/s and the share of step time spent waiting on data.

The job: a table from ``generate_table(..., dense=13, sparse=26, stripe_size=16 << 20)``, the spec
``clamp`` on each dense feature and ``firstx 20`` then ``sigrid_hash`` (into ``--hash-size``
buckets) on each sparse one, batch 4096. The model: 26 ``nn.EmbeddingBag(200_000, 64, mode="sum")``
(one per sparse key), a bottom MLP (13-512-256-64) for the dense features, the 27 vectors
concatenated into a 3-layer top MLP (1728-512-256-1), BCE loss, one SGD step per batch.

The embedding lookups never leave the device: each key's ids are gathered from the batch's
flat ``values`` into a ``[B, 20]`` matrix at the offsets of its ``lengths`` (``firstx 20``
bounds a row's ids), with ``per_sample_weights`` 1 for real ids and 0 for the padding, so no
step reads a length back to the host (a ``.tolist()`` per key would stall every step).

Modes (``--modes``, default the first five; ``--auth`` adds the last two):

* ``gpu``: the GPU alone: 48 batches (``--prestaged``) read once and copied to the device, cycled;
* ``device``: ``RemoteDataLoader(spec, num_workers=N, device="cuda")``;
* ``pinned``: ``RemoteDataLoader(spec, num_workers=N, pin_memory=True)`` + ``.to(dev, non_blocking=True)``;
* ``host``: ``RemoteDataLoader(spec, num_workers=N)``, host batches + ``.to(dev)``;
* ``torch``: ``torch.utils.data.DataLoader(LocalDataset(spec), batch_size=None, num_workers=N,
  pin_memory=True, persistent_workers=True)`` + ``.to(dev, non_blocking=True)``;
* ``tcp`` / ``sealed``: a standing master with N workers on loopback TCP (as
  ``benchmarks.auth_cost``), without keys / with a ``remoteloader keygen`` key directory
  (``--auth``: CURVE control, sealed AES-GCM data frames), fed as ``--transport-feed`` says
  (default ``host``): the sealed-vs-plain comparison the issue asks for at 8 or more workers.

How it is measured: each mode runs in its own child process (its own CUDA context, master and
workers), watched by this one: a mode that delivers no first batch within ``--start-timeout``,
no batch for ``--stall`` seconds, or runs past ``--mode-timeout`` is reported as hung (with the
batches it managed), its process and every process under it are stopped by pid, and the run goes
on. In the child: warm-up (``--warmup`` batches and at least ``--warmup-seconds``: workers
start, kernels compile), then a window of at most ``--seconds`` or ``--batches``. Every step
ends with a synchronize of the training (current) stream (``--no-sync`` turns it off; the
loader's side-stream copies of later batches go on), so the time the training
loop spends getting the next batch (``next()``, plus the ``.to()`` where the mode makes one) is
time the GPU sat idle: the wait share is that time over the window's wall time. Rows/s are the
window's rows over its wall time. "trainer process cores" is the child's own CPU (``getrusage``: training
loop, I/O, assembly and staging threads; not the master and workers, nor torch's DataLoader
workers) over the window's wall time, and "s/GB" the same CPU per GB of batch tensors delivered.

``--device cpu`` runs the modes that need no CUDA (``gpu`` is then "the model alone") with
tiny sizes for a smoke test; ``device`` and ``pinned`` are skipped with the reason.

Run (GPU host): ``python -m benchmarks.gpu_feed --rows 800000 --workers 12 [--auth]``;
CPU smoke: ``.venv/bin/python -m benchmarks.gpu_feed --device cpu --rows 20000 --workers 2
--seconds 5 --hash-size 20000``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import queue
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import psutil

REPO = Path(__file__).resolve().parents[1]
MAX_IDS = 20  # firstx 20: no row has more ids in any key

MODES = ("gpu", "device", "pinned", "host", "torch", "tcp", "sealed")
DEFAULT_MODES = ("gpu", "device", "pinned", "host", "torch")
NEEDS_CUDA = {"device": 'device="cuda" copies on a side CUDA stream',
              "pinned": "pin_memory=True needs an accelerator (ignored with a warning without one)"}


def label(mode: str, workers: int, feed: str, prestaged: int) -> str:
    n = workers
    feeds = {"host": "host batches + `.to(dev)`", "pinned": "`pin_memory=True` + `.to(dev, non_blocking=True)`",
             "device": '`device="cuda"`'}
    return {
        "gpu": f"the GPU alone ({prestaged} batches pre-staged on the device, cycled)",
        "device": f'`RemoteDataLoader(spec, num_workers={n}, device="cuda")`',
        "pinned": f"`RemoteDataLoader(spec, num_workers={n}, pin_memory=True)` + `.to(dev, non_blocking=True)`",
        "host": f"`RemoteDataLoader(spec, num_workers={n})`, host batches + `.to(dev)`",
        "torch": f"torch `DataLoader(LocalDataset(spec), num_workers={n}, pin_memory=True)`",
        "tcp": f"standing master, {n} workers, plain TCP (no keys), {feeds[feed]}",
        "sealed": f"standing master, {n} workers, `--auth`: sealed frames, {feeds[feed]}",
    }[mode]


# -- the job -----------------------------------------------------------------------------------------

def dlrm_spec(table: str, dense: int = 13, sparse: int = 26, batch_size: int = 4096, hash_size: int = 200_000,
              split_rows: Optional[int] = None, shuffle: bool = True) -> dict:
    """13 dense (clamp) + 26 sparse (firstx 20, then sigrid_hash into ``hash_size`` buckets)."""
    spec = {
        "table": {"path": table},
        "features": {
            "label": "label",
            "dense": [{"name": f"d{i}", "column": f"float_{i}",
                       "transforms": [{"op": "clamp", "min": 0.0, "max": 1e6}]} for i in range(dense)],
            "sparse": [{"name": f"s{i}", "column": f"idlist_{i}",
                        "transforms": [{"op": "firstx", "x": MAX_IDS},
                                       {"op": "sigrid_hash", "salt": i, "max_value": hash_size}]}
                       for i in range(sparse)],
        },
        "batch_size": batch_size,
        "shuffle": shuffle,
    }
    if split_rows:
        spec["split_rows"] = split_rows
    return spec


def ensure_table(path: Path, rows: int, dense: int = 13, sparse: int = 26) -> float:
    """Generate the table at ``path`` unless one is there; the seconds it took (0 if reused).
    Written beside it and renamed into place, so a killed generation leaves no half table."""
    from remoteloader.tools.datagen import generate_table
    if path.exists() and any(path.rglob("*.orc")):
        return 0.0
    start = time.perf_counter()
    part = path.with_name(f"{path.name}.part-{os.getpid()}")
    try:
        generate_table(str(part), rows=rows, partitions=1, dense=dense, sparse=sparse, format="orc", seed=36,
                       stripe_size=16 << 20, progress=False)
        if path.exists():
            shutil.rmtree(path)
        part.rename(path)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return time.perf_counter() - start


def batch_tensors(b: Any) -> list:
    kjt = b.sparse_features
    out = [b.dense_features, b.labels, kjt.values(), kjt.lengths(), kjt.weights_or_none(), b.weights,
           getattr(b, "padding", None), *b.passthrough.values()]
    return [t for t in out if t is not None]


def batch_nbytes(b: Any) -> int:
    """Bytes of the batch's tensors (as ``benchmarks.pinning.nbytes`` counts them)."""
    return sum(t.numel() * t.element_size() for t in batch_tensors(b))


def make_model(dense: int, sparse: int, hash_size: int, dim: int):
    import torch
    from torch import nn

    class DLRM(nn.Module):
        """26 embedding bags (sum), a bottom MLP for the dense features, a 3-layer top MLP."""

        def __init__(self) -> None:
            super().__init__()
            self.sparse = sparse
            self.bags = nn.ModuleList(nn.EmbeddingBag(hash_size, dim, mode="sum") for _ in range(sparse))
            self.bottom = nn.Sequential(nn.Linear(dense, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                        nn.Linear(256, dim), nn.ReLU())
            self.top = nn.Sequential(nn.Linear(dim * (sparse + 1), 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                     nn.Linear(256, 1))
            self.register_buffer("slots", torch.arange(MAX_IDS), persistent=False)

        def forward(self, dense_x, values, lengths):
            rows = dense_x.shape[0]
            lengths = lengths.view(self.sparse, rows).to(torch.int64)
            starts = torch.cumsum(lengths.flatten(), 0) - lengths.flatten()            # [K*B], on the device
            pos = starts.view(self.sparse, rows, 1) + self.slots                      # [K, B, 20]
            real = self.slots < lengths.unsqueeze(-1)                                 # [K, B, 20]
            ids = torch.where(real, values[torch.where(real, pos, 0)], 0)
            weights = real.to(dense_x.dtype)
            parts = [self.bottom(torch.log1p(dense_x))]
            parts += [bag(ids[k], per_sample_weights=weights[k]) for k, bag in enumerate(self.bags)]
            return self.top(torch.cat(parts, dim=1)).squeeze(1)

    return DLRM()


# -- the child: one mode --------------------------------------------------------------------------

def emit(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def cycle_epochs(loader: Any, set_epoch: Optional[Callable[[int], None]] = None) -> Iterator[Any]:
    epoch = 0
    while True:
        if set_epoch is not None:
            set_epoch(epoch)
        got = 0
        for b in loader:
            got += 1
            yield b
        if not got:
            raise RuntimeError(f"epoch {epoch} yielded no batch")
        epoch += 1


def child(cfg: dict) -> None:
    import torch
    from torch import nn

    mode, workers, dev = cfg["mode"], cfg["workers"], torch.device(cfg["device"])
    cuda = dev.type == "cuda"
    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    torch.manual_seed(0)
    if cuda and dev.index is not None:
        torch.cuda.set_device(dev)
    spec = dlrm_spec(cfg["table"], cfg["dense"], cfg["sparse"], cfg["batch_size"], cfg["hash_size"],
                     cfg["split_rows"], shuffle=True)
    model = make_model(cfg["dense"], cfg["sparse"], cfg["hash_size"], cfg["dim"]).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.BCEWithLogitsLoss()
    # The training stream only: the loader's side-stream copies of later batches may go on.
    sync = (lambda: torch.cuda.current_stream(dev).synchronize()) if cuda and cfg["sync"] else (lambda: None)

    def step(dense_x, values, lengths, labels) -> None:
        loss = loss_fn(model(dense_x, values, lengths), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def unpack(b):
        kjt = b.sparse_features
        return b.dense_features, kjt.values(), kjt.lengths(), b.labels

    held: collections.deque = collections.deque()  # host batches whose async copy may be in flight

    def hold(host_batch) -> None:
        if not cuda:
            return
        ev = torch.cuda.Event()
        ev.record()
        held.append((ev, host_batch))
        while held and held[0][0].query():
            held.popleft()

    with contextlib.ExitStack() as stack:
        feed = cfg["feed"]
        get: Callable[[], tuple]
        if mode == "gpu":
            from remoteloader import LocalDataset
            ds = LocalDataset(spec)
            staged: list[tuple] = []
            epoch = 0
            while len(staged) < cfg["prestaged"]:
                ds.set_epoch(epoch)
                n0 = len(staged)
                for b in ds:
                    staged.append(tuple(t.to(dev, copy=True) for t in unpack(b)))
                    if len(staged) >= cfg["prestaged"]:
                        break
                if len(staged) == n0:
                    raise RuntimeError("the table yielded no batch")
                epoch += 1
            sync()
            index = [0]

            def get() -> tuple:
                t = staged[index[0] % len(staged)]
                index[0] += 1
                return t
        elif mode == "torch":
            from torch.utils.data import DataLoader

            from remoteloader import LocalDataset
            ds = LocalDataset(spec)
            dl = DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=cuda,
                            persistent_workers=workers > 0)
            it = cycle_epochs(dl, ds.set_epoch)
            stack.callback(it.close)

            def get() -> tuple:
                b = next(it)
                d = b.to(dev, non_blocking=True) if cuda else b
                return (*unpack(d), batch_nbytes(b))
        else:
            from remoteloader import RemoteDataLoader
            opts: dict[str, Any] = {"timeout": cfg["loader_timeout"]}
            if mode in ("tcp", "sealed"):
                from benchmarks.auth_cost import tcp_master
                keys = cfg["keys"] if mode == "sealed" else None
                addr = stack.enter_context(tcp_master(Path(cfg["table"]), keys, workers))
                opts.update(master=addr, auth=keys)
                how = feed
            else:
                opts["num_workers"] = workers
                how = mode
            if how == "device":
                opts["device"] = str(dev)
            elif how == "pinned":
                opts["pin_memory"] = True
            loader = stack.enter_context(RemoteDataLoader(spec, **opts))
            it = cycle_epochs(loader)
            stack.callback(it.close)

            if how == "device":
                def get() -> tuple:
                    b = next(it)
                    return (*unpack(b), batch_nbytes(b))
            elif how == "pinned":
                def get() -> tuple:
                    b = next(it)
                    d = b.to(dev, non_blocking=True)
                    hold(b)
                    return (*unpack(d), batch_nbytes(b))
            else:
                def get() -> tuple:
                    b = next(it)
                    d = b.to(dev)
                    return (*unpack(d), batch_nbytes(b))

        # warm-up: workers start and compile, CUDA initialises
        start = time.perf_counter()
        n = 0
        last_emit = 0.0
        while n < cfg["warmup"] or time.perf_counter() - start < cfg["warmup_seconds"]:
            got = get()
            step(*got[:4])
            sync()
            n += 1
            now = time.perf_counter()
            if now - last_emit > 0.5:
                emit(progress=n, phase="warm-up")
                last_emit = now
        sync()
        emit(progress=n, phase="measure", warmup_s=round(time.perf_counter() - start, 2))

        # the measured window
        rows = batches = nbytes = 0
        wait = 0.0
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        deadline = t0 + cfg["seconds"]
        while batches < cfg["batches"] and time.perf_counter() < deadline:
            a = time.perf_counter()
            got = get()
            wait += time.perf_counter() - a
            step(*got[:4])
            sync()
            rows += int(got[0].shape[0])
            nbytes += got[4] if len(got) > 4 else 0
            batches += 1
            now = time.perf_counter()
            if now - last_emit > 0.5:
                emit(progress=n + batches, phase="measure")
                last_emit = now
        if cuda:
            torch.cuda.current_stream(dev).synchronize()
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        result = {"rows": rows, "batches": batches, "wall": wall, "rows_s": rows / wall, "wait_share": wait / wall,
                  "cpu": cpu, "cores": cpu / wall, "bytes": nbytes,
                  "cpu_s_gb": cpu / (nbytes / 1e9) if nbytes else None}
        if mode not in ("gpu", "torch") and hasattr(loader, "pin_stats") and loader.pin_stats is not None:
            st = loader.pin_stats
            result["staging"] = {k: getattr(st, k) for k in ("staged", "taken", "waited", "wait_s")
                                 if isinstance(getattr(st, k, None), (int, float))}
        held.clear()
    emit(result=result)


# -- the parent: run each mode in a watched child ----------------------------------------------

def stop_tree(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop ``proc`` and every process under it, by pid (SIGTERM, then SIGKILL)."""
    from benchmarks.auth_cost import reap
    under: list[int] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        under = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    reap([proc.pid], timeout=timeout)
    with contextlib.suppress(Exception):
        proc.wait(timeout=1)
    reap(under, timeout=timeout)


def run_child(module: str, cfg: dict, start_timeout: float, stall: float, total: float,
              log: Callable[[str], None]) -> dict:
    """Run ``python -m module --child JSON`` and watch its JSON lines: ``{"progress": n}`` and at
    the end ``{"result": {...}}`` or ``{"error": "..."}``. Returns the result, or
    ``{"status": "hung"|"crashed", "detail": ...}``; the child's tree is always stopped."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.Popen([sys.executable, "-m", module, "--child", json.dumps(cfg)], cwd=str(REPO),
                            stdout=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    began = last = time.monotonic()
    progress, phase, first = 0, "start", False
    answered = False  # the child said how it ended: give it time to close its cluster itself
    try:
        while True:
            now = time.monotonic()
            if now - began > total:
                return {"status": "hung", "detail": f"past the mode's {total:g} s limit ({progress} batches, {phase})"}
            if not first and now - began > start_timeout:
                return {"status": "hung", "detail": f"no first batch in {start_timeout:g} s"}
            if first and now - last > stall:
                return {"status": "hung", "detail": f"no batch for {stall:g} s after {progress} batches ({phase})"}
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                try:
                    rc: Any = proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    rc = "none (its output closed)"
                return {"status": "crashed", "detail": f"exited with code {rc} without a result"}
            try:
                msg = json.loads(line)
            except ValueError:
                log(line.rstrip())
                continue
            if not isinstance(msg, dict):
                log(line.rstrip())
                continue
            if "progress" in msg:
                if msg["progress"] != progress or msg.get("phase") != phase:
                    last = time.monotonic()
                progress, phase, first = msg["progress"], msg.get("phase", phase), first or msg["progress"] > 0
            elif "result" in msg:
                answered = True
                return {"status": "ok", **msg["result"]}
            elif "error" in msg:
                answered = True
                return {"status": "crashed", "detail": msg["error"]}
            else:
                log(line.rstrip())
    finally:
        if answered:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        stop_tree(proc)


def exit_on_sigterm() -> None:
    """The first SIGTERM unwinds (``finally`` blocks and context managers stop what was started);
    later ones are ignored so that they cannot cut that cleanup short (``timeout`` signals the
    whole process group, the parent its child: two arrive). SIGKILL still ends it."""
    def handler(*_: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, handler)


def child_main(module_child: Callable[[dict], None], cfg_json: str) -> None:
    exit_on_sigterm()  # unwind: context managers stop the cluster
    cfg = json.loads(cfg_json)
    try:
        module_child(cfg)
    except BaseException as e:  # reported to the parent, which decides
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        tb = traceback.format_exc(limit=6)
        print(tb, file=sys.stderr, flush=True)
        emit(error=f"{type(e).__name__}: {e}"[:400])
        sys.exit(1)


def fmt_status(r: dict) -> str:
    return f"**{r['status']}**: {r.get('detail', '')}".strip()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, default=800_000, help="rows of the generated table")
    p.add_argument("--table", help="the table's directory (reused when it holds ORC files; default: a temp dir)")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--hash-size", type=int, default=200_000, help="sigrid_hash buckets = rows of each EmbeddingBag")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--split-rows", type=int, default=None, help="the spec's split_rows (default: the spec's)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--auth", "--transport-compare", dest="auth", action="store_true",
                   help="also run tcp and sealed: a standing master on TCP without and with --auth keys")
    p.add_argument("--transport-feed", choices=("host", "pinned", "device"), default="host",
                   help="how the tcp/sealed modes feed the device")
    p.add_argument("--seconds", type=float, default=10.0, help="the measured window per mode (at most)")
    p.add_argument("--batches", type=int, default=100_000, help="the measured window per mode (at most, batches)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up batches (at least)")
    p.add_argument("--warmup-seconds", type=float, default=3.0, help="warm-up seconds (at least)")
    p.add_argument("--prestaged", type=int, default=48)
    p.add_argument("--no-sync", dest="sync", action="store_false",
                   help="no synchronize of the training stream per step (the wait share is then CPU-side only)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="per mode: the first batch within this")
    p.add_argument("--stall", type=float, default=45.0, help="per mode: hung when no batch for this long")
    p.add_argument("--mode-timeout", type=float, default=None,
                   help="per mode, all in (default: start-timeout + warm-up + 2 x seconds + 30)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--only-table", action="store_true", help="generate the table at --table and exit")
    args = p.parse_args(argv)
    if args.child:
        child_main(child, args.child)
        return 0
    if args.only_table:
        if not args.table:
            p.error("--only-table needs --table")
        took = ensure_table(Path(args.table), args.rows)
        print(f"table {args.table}: {args.rows:,} rows, " + (f"generated in {took:.0f} s" if took else "already there"))
        return 0

    exit_on_sigterm()  # a timeout unwinds: the children are stopped
    os.environ.setdefault("REMOTELOADER_QUIET", "1")
    import torch

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.auth:
        modes += [m for m in ("tcp", "sealed") if m not in modes]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad}; choose from {','.join(MODES)}")
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but this torch sees no CUDA device (use --device cpu for a smoke run)")
    feed = args.transport_feed if cuda else "host"
    total = args.mode_timeout or (args.start_timeout + args.warmup_seconds + 2 * args.seconds + 30)

    tmp = Path(tempfile.mkdtemp(prefix="rl-gpufeed-"))
    results: dict[str, dict] = {}
    gpu_name = torch.cuda.get_device_name(dev) if cuda else platform.processor() or platform.machine()
    interrupted = False
    try:
        table = Path(args.table) if args.table else tmp / "t"
        gen_s = ensure_table(table, args.rows)
        keys = None
        if any(m == "sealed" for m in modes):
            from remoteloader.protocol import auth
            keys = str(auth.keygen(tmp / "keys"))
        print(f"# {gpu_name}; {os.cpu_count()} CPUs (load {os.getloadavg()[0]:.1f}); torch {torch.__version__}; "
              f"table {table} ({args.rows:,} rows{', generated in %.0f s' % gen_s if gen_s else ', reused'}); "
              f"{args.workers} workers; batch {args.batch_size}; hash {args.hash_size:,} x dim {args.dim}; "
              f"per-step sync {'on' if args.sync and cuda else 'off'}", file=sys.stderr, flush=True)
        for mode in modes:
            if not cuda and mode in NEEDS_CUDA:
                results[mode] = {"status": "skipped", "detail": f"needs CUDA ({NEEDS_CUDA[mode]}); --device {dev}"}
                print(f"# {mode}: skipped: {results[mode]['detail']}", file=sys.stderr, flush=True)
                continue
            if not cuda and mode in ("tcp", "sealed") and args.transport_feed != "host":
                print(f"# {mode}: --transport-feed {args.transport_feed} needs CUDA: feeding host batches",
                      file=sys.stderr, flush=True)
            cfg = {"mode": mode, "workers": args.workers, "device": str(dev), "table": str(table),
                   "dense": 13, "sparse": 26, "batch_size": args.batch_size, "hash_size": args.hash_size,
                   "dim": args.dim, "split_rows": args.split_rows, "sync": args.sync, "feed": feed,
                   "keys": keys, "seconds": args.seconds, "batches": args.batches, "warmup": args.warmup,
                   "warmup_seconds": args.warmup_seconds, "prestaged": args.prestaged,
                   "loader_timeout": max(60.0, args.stall + 30)}
            t = time.perf_counter()
            r = run_child("benchmarks.gpu_feed", cfg, args.start_timeout, args.stall, total,
                          lambda s, mode=mode: print(f"#   [{mode}] {s}", file=sys.stderr, flush=True))
            results[mode] = r
            took = time.perf_counter() - t
            if r["status"] == "ok":
                print(f"# {mode}: {r['rows_s']:,.0f} rows/s, wait {r['wait_share']:.0%}, {r['batches']} batches in "
                      f"{r['wall']:.1f} s, client {r['cores']:.2f} cores ({took:.0f} s with start-up)",
                      file=sys.stderr, flush=True)
            else:
                print(f"# {mode}: {r['status']}: {r.get('detail')} ({took:.0f} s)", file=sys.stderr, flush=True)
    except SystemExit:  # SIGTERM (a timeout): stop the children, print what was measured
        interrupted = True
        print("# interrupted (SIGTERM): the modes left are marked so", file=sys.stderr, flush=True)
    finally:
        from benchmarks.auth_cost import descendants, reap
        reap(descendants())
        shutil.rmtree(tmp, ignore_errors=True)

    base = results.get("gpu", {})
    base_rate = base.get("rows_s") if base.get("status") == "ok" else None
    where = "the GPU" if cuda else "the device (CPU smoke run: NOT GPU figures)"
    print(f"DLRM 13 dense + 26 sparse (26 EmbeddingBag {args.hash_size:,} x {args.dim}), batch {args.batch_size}, "
          f"{args.rows:,}-row table, {args.workers} workers, on {where} ({gpu_name}), torch {torch.__version__}; "
          f"window {args.seconds:g} s / {args.batches} batches after warm-up; wait share = time in next() "
          f"(+ .to()) / wall{', every step synchronized' if args.sync and cuda else ''}; trainer process = "
          f"training loop + loader threads (not the master, workers or DataLoader workers), per GB of batches")
    print()
    print("| how the GPU was fed | training rows/s | vs GPU alone | share of step time waiting on data "
          "| trainer process cores | trainer CPU s/GB | batches |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode in modes:
        r = results.get(mode, {"status": "interrupted", "detail": "not measured (SIGTERM)"})
        name = label(mode, args.workers, feed, args.prestaged)
        if r["status"] != "ok":
            print(f"| {name} | {fmt_status(r)} | - | - | - | - | - |")
            continue
        ratio = f"{r['rows_s'] / base_rate:.2f}" if base_rate else "-"
        wait = "-" if mode == "gpu" else f"{r['wait_share']:.0%}"
        s_gb = f"{r['cpu_s_gb']:.2f}" if r.get("cpu_s_gb") else "-"
        cores = "-" if mode == "gpu" else f"{r['cores']:.2f}"
        print(f"| {name} | {r['rows_s']:,.0f} | {ratio} | {wait} | {cores} | {s_gb} | {r['batches']} |")
    if results.get("tcp", {}).get("status") == "ok" and results.get("sealed", {}).get("status") == "ok":
        a, b = results["tcp"]["rows_s"], results["sealed"]["rows_s"]
        print(f"\nsealed / plain TCP: {b / a:.2f} (target >= 0.9 at 8+ workers)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 143 if interrupted else 0


if __name__ == "__main__":
    raise SystemExit(main())
