"""Red-team cases of issue 37 (findings 1, 5, 7 and 8) for ``benchmarks/redteam.py``: the
cache location as another local user, or an unlucky operator, leaves it. Each case starts
what it attacks (a master with ``--cache`` and local workers, the ``remoteloader cache``
command, or the embedded default) and reports whether the defence held, with the numbers
in a note. Another user is uid 65534 (``setpriv``, the system Python only), or a layout
made directly as the issue's red team left it.

* **planted links**: ``v1/zz`` and a split directory linked to a root-owned 0700
  directory, a segment and a stale temp file linked to a root-owned 0600 file, then
  ``cache gc --max-bytes 10G``, ``cache ls``, ``cache verify --delete``, ``cache gc
  --max-bytes 1`` and a master's ``--cache-max-bytes`` janitor. Holds at 0 files outside
  the cache touched or listed.
* **planted markers** (``--auth``): after a job wrote its blocks, every split's ``used``
  marker is a link to a root-owned 0600 file of 1,200 bytes; a second job reads the
  cache. Holds when the file keeps its 1,200 bytes and modification time.
* **the embedded default's cache** (root only): a job through ``RemoteDataLoader(spec)``
  with ``XDG_CACHE_HOME`` in a 0755 directory and umask 022, then uid 65534 reads every
  segment it can reach and counts their rows (footers parsed with the standard library).
  Holds at 0 rows exposed.
* **a location another user made first** (root only): uid 65534 makes the location in a
  1777 directory; a master and a worker are started on it (refused?), then the same
  location shared on purpose (``--cache-shared --auth``) after the stranger planted
  segments whose integer blocks repeat each split's first value. Holds when both are
  refused, naming the location, and the shared job's epoch holds every row once.
* **--cache-max-bytes 100K**: the bytes under the location after one ``write-all`` epoch
  on two workers. Holds at <= 100 KiB.

Run alone: ``.venv/bin/python -m benchmarks.redteam_cache_store [--rows 20000]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import psutil

from remoteloader import RemoteDataLoader
from remoteloader.columns import DenseColumn
from remoteloader.core.cache.segments import BlockSigner, decode_block, encode_segment, read_footer
from remoteloader.core.redact import ENV_ALLOW_TABLE
from remoteloader.protocol import auth
from remoteloader.tools.datagen import generate_table

Result = tuple[bool, int, str]  # defence held, rows exposed, note
NOBODY = 65534
BOUND = 100 << 10
CLI = [sys.executable, "-m", "remoteloader.tools.cli"]


def _spec(table: Path, mode: str) -> dict:
    return {"table": {"path": str(table)}, "shuffle": True, "seed": 3, "batch_size": 256, "split_rows": 1000,
            "features": {"label": "label", "dense": ["float_0"], "sparse": [{"name": "s0", "column": "idlist_0"}],
                         "passthrough": ["row_id"]}, "cache": {"mode": mode}}


def _env(table: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTELOADER_")}
    return {**env, ENV_ALLOW_TABLE: json.dumps([str(table)]), "REMOTELOADER_QUIET": "1", **extra}


class Master:
    """``remoteloader-master`` on loopback with local workers and the given cache options."""

    def __init__(self, table: Path, *args: str, workers: int = 2) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                                      "--workers", str(workers), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=_env(table))
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.wait(30)
            raise RuntimeError(f"master did not start: {self.proc.stderr.read().strip()[-400:]}")
        self.addr = line.rsplit(" ", 1)[1].strip()

    def stop(self) -> None:
        pids = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pid in pids:
            try:
                psutil.Process(pid).wait(30)
            except psutil.NoSuchProcess:
                pass


def _epoch(master: Master, spec: dict, keys: Optional[str]) -> list[int]:
    with RemoteDataLoader(spec, master=master.addr, auth=keys, timeout=300) as loader:
        return [r for b in loader for r in b.passthrough["row_id"].tolist()]


def _exact(ids: list[int], rows: int) -> bool:
    return len(ids) == rows and len(set(ids)) == rows


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``, never through a link: type, size, mode, mtime, content."""
    out: dict[str, tuple] = {}
    for path in [root, *(Path(d) / n for d, ds, fs in os.walk(root) for n in ds + fs)]:
        st = os.lstat(path)
        data = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
        out[str(path)] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mode, st.st_mtime_ns, data)
    return out


def _touched(before: dict[str, tuple], after: dict[str, tuple]) -> int:
    return sum(before.get(p) != after.get(p) for p in before.keys() | after.keys())


def _private_target(root: Path) -> Path:
    """A root-owned 0700 directory (two subdirectories, a 0600 file of 1,200 bytes)."""
    for sub in ("alpha-precious", "beta-precious"):
        (root / sub).mkdir(parents=True)
        (root / sub / "data.txt").write_bytes(b"keep me\n" * 10)
    (root / "secret").write_bytes(b"x" * 1200)
    for p in [root, *root.rglob("*")]:
        p.chmod(0o700 if p.is_dir() else 0o600)
    return root


def _size(root: Path) -> int:
    return sum(os.lstat(Path(d) / n).st_size for d, _, fs in os.walk(root) for n in fs
               if stat.S_ISREG(os.lstat(Path(d) / n).st_mode))


def _split_dirs(cache: Path) -> list[Path]:
    return [Path(d) for d, _, fs in os.walk(cache / "v1") if any(f.endswith(".seg") for f in fs)]


# -- finding 1 --------------------------------------------------------------------------------------
def planted_links(tmp: Path, table: Path) -> Result:
    root = tmp / "issue37-links"
    outside = _private_target(root / "outside")
    cache = root / "cache"
    master = Master(table, "--cache", str(cache))
    try:
        _epoch(master, _spec(table, "write-all"), None)
    finally:
        master.stop()
    split = _split_dirs(cache)[0]
    (cache / "v1" / "zz").symlink_to(outside)
    (split.parent / (split.name[:2] + "ffff")).symlink_to(outside)
    (split / "000000000000001-x.seg").symlink_to(outside / "secret")
    temp = split / ".tmp-000000000000001-x.seg"
    temp.symlink_to(outside / "secret")
    old = time.time() - 7200
    os.utime(temp, (old, old), follow_symlinks=False)
    before = _snapshot(outside)
    listed = 0
    for args in (["ls"], ["gc", "--max-bytes", "10G"], ["verify", "--delete"], ["ls"], ["gc", "--max-bytes", "1"]):
        out = subprocess.run([*CLI, "cache", args[0], str(cache), *args[1:]], capture_output=True, text=True,
                             timeout=120, env=_env(table))
        listed += out.stdout.count("precious") + out.stdout.count("ffff")
    janitor = Master(table, "--cache", str(cache), "--cache-max-bytes", "1", workers=0)  # its first pass at start
    time.sleep(3)
    janitor.stop()
    touched = _touched(before, _snapshot(outside))
    links = sum(p.is_symlink() for p in (cache / "v1" / "zz", temp))
    return touched == listed == 0, 0, (f"{touched} files outside the cache touched, {listed} listed "
                                       f"(ls, gc 10G, verify --delete, gc 1, a --cache-max-bytes janitor); "
                                       f"{links} of 2 planted links left in place")


def planted_markers(tmp: Path, table: Path, keys: str, rows: int) -> Result:
    root = tmp / "issue37-markers"
    target = root / "outside" / "victim"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"v" * 1200)
    target.chmod(0o600)
    cache = root / "cache"
    master = Master(table, "--cache", str(cache), "--auth", keys)
    try:
        _epoch(master, _spec(table, "write-all"), keys)
    finally:
        master.stop()
    splits = _split_dirs(cache)
    for split in splits:
        (split / "used").unlink(missing_ok=True)
        (split / "used").symlink_to(target)
    before = target.stat().st_size, target.stat().st_mtime_ns, target.read_bytes()
    master = Master(table, "--cache", str(cache), "--auth", keys)
    try:
        ids = _epoch(master, _spec(table, "read"), keys)
    finally:
        master.stop()
    after = target.stat().st_size, target.stat().st_mtime_ns, target.read_bytes()
    held = after == before and _exact(ids, rows)
    return held, 0, (f"{len(splits)} split directories with a linked used marker: the root-owned 0600 file has "
                     f"{after[0]:,} of {before[0]:,} bytes, modification time "
                     f"{'unchanged' if after[1] == before[1] else 'CHANGED'}; epoch "
                     f"{'exact' if _exact(ids, rows) else 'NOT exact'}")


# -- finding 5 --------------------------------------------------------------------------------------
PEEK = r"""
import json, os, struct, sys
rows = segments = readable = 0
for d, _, files in os.walk(sys.argv[1]):
    for name in files:
        if not name.endswith(".seg"):
            continue
        segments += 1
        try:
            with open(os.path.join(d, name), "rb") as f:
                data = f.read()
        except OSError:
            continue
        readable += 1
        try:
            (length,) = struct.unpack("<I", data[-12:-8])
            footer = json.loads(data[-12 - length:-12])
            blocks = footer["blocks"].values() if isinstance(footer["blocks"], dict) else footer["blocks"]
            rows += max(int(b["rows"]) for b in blocks)
        except Exception:
            pass
print(json.dumps({"segments": segments, "readable": readable, "rows": rows}))
"""


def _as_nobody(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", *args],
                          capture_output=True, text=True, timeout=120, cwd="/")


def default_cache_exposed(tmp: Path, table: Path, rows: int) -> Result:
    home = Path(tempfile.mkdtemp(prefix="rl-issue37-home-"))  # a 0755 home other users can enter
    try:
        home.chmod(0o755)
        xdg = home / ".cache"
        old_env, old_umask = dict(os.environ), os.umask(0o022)
        os.environ.update({"XDG_CACHE_HOME": str(xdg), "REMOTELOADER_QUIET": "1"})
        for name in ("REMOTELOADER_CACHE", "REMOTELOADER_CACHE_SHARED", auth.ENV_AUTH):
            os.environ.pop(name, None)
        try:
            with RemoteDataLoader(_spec(table, "write-all"), num_workers=2, timeout=300) as loader:
                ids = [r for b in loader for r in b.passthrough["row_id"].tolist()]
        finally:
            os.umask(old_umask)
            os.environ.clear()
            os.environ.update(old_env)
        written = sum(1 for _, _, fs in os.walk(xdg) for f in fs if f.endswith(".seg"))
        peek = _as_nobody("/usr/bin/python3", "-c", PEEK, str(xdg))
        seen = json.loads(peek.stdout) if peek.returncode == 0 else {"segments": 0, "readable": 0, "rows": 0}
        modes = sorted({f"{stat.S_IMODE(os.lstat(Path(d) / n).st_mode):04o}" for d, ds, fs in os.walk(xdg)
                        for n in ds + fs})
        return seen["rows"] == 0 and written > 0 and _exact(ids, rows), seen["rows"], (
            f"{written} segments written; uid {NOBODY} listed {seen['segments']}, read {seen['readable']}, "
            f"{seen['rows']:,} rows; modes under the cache: {', '.join(modes)}")
    finally:
        shutil.rmtree(home, ignore_errors=True)


# -- finding 7 --------------------------------------------------------------------------------------
def _forge(source: Path, location: Path) -> int:
    """Segments for ``location`` made from ``source``'s: every integer block repeats its
    first value (a row_id block delivers one id for the whole split), plain checksums,
    owned by uid 65534 as if that user had written them. How many were planted."""
    plain, planted = BlockSigner.plain(), 0
    for split in _split_dirs(source):
        for seg in split.glob("*.seg"):
            data = seg.read_bytes()
            footer = read_footer(data, len(data), str(seg))
            blocks = {}
            for key, desc in footer.blocks.items():
                column = decode_block(footer, key, memoryview(data)[desc.start:desc.end], plain)
                if isinstance(column, DenseColumn) and column.values.dtype.kind in "iu" and len(column.values):
                    column = DenseColumn(np.full_like(column.values, column.values.flat[0]), column.valid)
                blocks[key] = column
            target = location / split.relative_to(source)
            target.mkdir(parents=True, exist_ok=True)
            (target / f"9{seg.name[1:]}").write_bytes(b"".join(encode_segment(split.name, blocks, plain)))
            planted += 1
    for p in [location, *location.rglob("*")]:
        os.chown(p, NOBODY, NOBODY)
        p.chmod(0o777 if p.is_dir() else 0o666)
    return planted


def stranger_location(tmp: Path, table: Path, keys: str, rows: int) -> Result:
    sticky = Path(tempfile.mkdtemp(prefix="rl-issue37-sticky-"))  # like /tmp: 1777, reachable by everyone
    try:
        sticky.chmod(0o1777)
        return _stranger_location(tmp / "issue37-stranger", sticky, table, keys, rows)
    finally:
        shutil.rmtree(sticky, ignore_errors=True)


def _stranger_location(root: Path, sticky: Path, table: Path, keys: str, rows: int) -> Result:
    location = sticky / "rl-cache"
    made = _as_nobody("mkdir", "-m", "777", str(location))
    if made.returncode != 0:
        return False, 0, f"uid {NOBODY} could not make the location: {made.stderr.strip()}"
    refusals = []
    for program, args in (("master", ["--bind", "tcp://127.0.0.1:0", "--workers", "0"]),
                          ("worker", ["--master", "tcp://127.0.0.1:9"]),
                          ("master", ["--bind", "tcp://127.0.0.1:0", "--workers", "0", "--cache-shared"])):
        out = subprocess.run([sys.executable, "-m", f"remoteloader.{program}", "--cache", str(location), *args],
                             capture_output=True, text=True, timeout=120, env=_env(table))
        refusals.append(out.returncode == 2 and (str(location) in out.stderr or "--auth" in out.stderr))
    # The same location shared on purpose, with --auth, after the stranger planted forged blocks.
    honest = root / "honest"
    master = Master(table, "--cache", str(honest))
    try:
        _epoch(master, _spec(table, "write-all"), None)
    finally:
        master.stop()
    planted = _forge(honest, location)
    master = Master(table, "--cache", str(location), "--cache-shared", "--auth", keys)
    try:
        ids = _epoch(master, _spec(table, "read"), keys)
    finally:
        master.stop()
    forged = len(ids) - len(set(ids))
    held = all(refusals) and _exact(ids, rows)
    return held, 0, (f"refused at start: master {refusals[0]}, worker {refusals[1]}, --cache-shared without --auth "
                     f"{refusals[2]}; shared with --auth over {planted} forged segments: {len(set(ids)):,} distinct "
                     f"of {len(ids):,} rows, {forged} repeated")


# -- finding 8 --------------------------------------------------------------------------------------
def bounded(tmp: Path, table: Path, rows: int) -> Result:
    cache = tmp / "issue37-bound" / "cache"
    master = Master(table, "--cache", str(cache), "--cache-max-bytes", str(BOUND))
    try:
        ids = _epoch(master, _spec(table, "write-all"), None)
        counters = _settled_counters(master.addr)
    finally:
        master.stop()
    size = _size(cache)
    return size <= BOUND and _exact(ids, rows), 0, (
        f"{size:,} bytes under the location after one write-all epoch on 2 workers, bound {BOUND:,} "
        f"({counters.get('puts', 0):.0f} segments put, {counters.get('put_bytes', 0):,.0f} bytes, "
        f"{counters.get('dropped', 0):.0f} dropped); epoch {'exact' if _exact(ids, rows) else 'NOT exact'}")


def _settled_counters(addr: str, timeout: float = 20.0) -> dict:
    """The workers' cache counters once two readings 2 s apart agree (every write reported)."""
    import zmq

    from remoteloader.protocol import messages as M
    from remoteloader.protocol.rpc import RpcClient

    rpc = RpcClient(zmq.Context.instance(), addr, 10)
    try:
        last, deadline = None, time.monotonic() + timeout
        while time.monotonic() < deadline:
            counters = (rpc.call(M.Status()).status.get("cache") or {}).get("counters", {})
            if counters and counters == last:
                return counters
            last = counters
            time.sleep(2.0)
        return last or {}
    finally:
        rpc.close()


def _table(tmp: Path, rows: int) -> Path:
    """The cases' table: stripes of 1,000 rows, so a job has many small splits (made once)."""
    table = tmp / "issue37-t"
    if not table.exists():
        generate_table(str(table), rows=rows, partitions=2, dense=2, sparse=2, format="orc", seed=5,
                       progress=False, stripe_rows=1000)
    return table


def cases(tmp: Path, keys: str, rows: int) -> dict[str, Callable[[], Result]]:
    table = _table(tmp, rows)
    out = {
        "issue 37: links planted in the cache (gc, ls, verify, the janitor)": lambda: planted_links(tmp, table),
        "issue 37: a linked used marker, --auth (a root-owned 0600 file)":
            lambda: planted_markers(tmp, table, keys, rows),
        "issue 37: --cache-max-bytes 100K, one write-all epoch": lambda: bounded(tmp, table, rows),
    }
    if os.geteuid() == 0:
        out["issue 37: the embedded default's cache, read by another uid"] = \
            lambda: default_cache_exposed(tmp, table, rows)
        out["issue 37: a cache location another uid made first"] = lambda: stranger_location(tmp, table, keys, rows)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20_000)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rl-redteam-cache-"))
    try:
        generate_table(str(tmp / "t"), rows=args.rows, partitions=2, dense=2, sparse=2, format="orc", seed=5,
                       progress=False)
        keys = auth.keygen(tmp / "keys")
        failed = 0
        for name, case in cases(tmp, keys, args.rows).items():
            start = time.monotonic()
            try:
                held, exposed, note = case()
            except Exception as e:  # noqa: BLE001 (a red-team harness reports, never dies)
                held, exposed, note = False, 0, f"{type(e).__name__}: {e}"
            failed += not held
            print(f"{name}: {'held' if held else 'NOT HELD'}, {exposed} rows exposed, "
                  f"{time.monotonic() - start:.0f} s\n  {note}", flush=True)
        return 1 if failed else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
