"""Red-team cases of issue 37 (findings 2, 4 and 6) for ``benchmarks/redteam.py``: each
starts what it attacks (an authenticated master with ``--cache`` and two local workers, or
the embedded default), attacks it as the issue's red team did, and reports whether the
defence held, with the numbers in a note.

* **stale rows**: a table file rewritten in place with two labels of a stripe swapped (the
  same size, the same last 64 KiB, the same inode; its modification time set back too);
  the next job reads with the first job's cache. Rows whose label is not the file's
  current one are stale; the defence holds at 0.
* **planted footers**: a user without the key adds 3 segments with 15 MB footers to every
  split directory (the cluster's key id copied, a made-up MAC; one of them under plain
  checksums). A cached epoch on fresh processes, and the workers' peak memory, against
  the same before the planting (best of two each); the defence holds within 1.2x.
* **ipc squatting** (root only): uid 65534 watches ``/proc/*/cmdline`` and makes every
  ``rl-`` ipc directory it sees named, as the issue's red team did; three embedded
  starts must all succeed and never use a directory it made.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.orc as po

from remoteloader import RemoteDataLoader
from remoteloader.core.redact import ENV_ALLOW_TABLE
from remoteloader.tools.datagen import generate_table

Result = tuple[bool, int, str]  # defence held, rows exposed, note
TAIL = 64 << 10
FOOTER_BYTES = 15 << 20
PLANTED_PER_SPLIT = 3


class CacheCluster:
    """An authenticated master on loopback with ``--cache`` and two local workers."""

    def __init__(self, tmp: Path, table: Path, cache: Path, keys: str) -> None:
        env = {**os.environ, ENV_ALLOW_TABLE: json.dumps([str(table)])}
        env.pop("REMOTELOADER_CACHE", None)
        self.keys = keys
        self.proc = subprocess.Popen([sys.executable, "-m", "remoteloader.master", "--bind", "tcp://127.0.0.1:0",
                                      "--auth", keys, "--workers", "2", "--cache", str(cache)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.addr = self.proc.stdout.readline().rsplit(" ", 1)[1].strip()

    def workers(self) -> list[psutil.Process]:
        try:  # the children of its worker fork server (its own child)
            return [w for server in psutil.Process(self.proc.pid).children() for w in server.children()]
        except psutil.NoSuchProcess:
            return []

    def epoch(self, spec: dict) -> tuple[float, dict[int, float]]:
        """One epoch on one rank: its wall seconds (iteration only) and label by row id."""
        with RemoteDataLoader(spec, master=self.addr, auth=self.keys, timeout=300) as loader:
            start = time.perf_counter()
            labels: dict[int, float] = {}
            for b in loader:
                labels.update(zip(b.passthrough["row_id"].tolist(), b.labels.tolist()))
            return time.perf_counter() - start, labels

    def peak_worker_rss(self) -> int:
        """The largest peak resident size (VmHWM) of the workers, bytes."""
        peak = 0
        for w in self.workers():
            try:
                for line in Path(f"/proc/{w.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
            except OSError:
                pass
        return peak

    def stop(self) -> None:
        pids = [self.proc.pid, *(c.pid for c in psutil.Process(self.proc.pid).children(recursive=True))]
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pid in pids[1:]:
            try:
                psutil.Process(pid).wait(30)
            except psutil.NoSuchProcess:
                pass


def _spec(table: Path, mode: str, split_rows: int) -> dict:
    return {"table": {"path": str(table)}, "shuffle": True, "seed": 3, "batch_size": 256, "split_rows": split_rows,
            "features": {"label": "label", "dense": ["float_0"], "sparse": [{"name": "s0", "column": "idlist_0"}],
                         "passthrough": ["row_id"]}, "cache": {"mode": mode}}


# -- stale rows -----------------------------------------------------------------------------------
def _uncompressed_table(root: Path, rows: int) -> None:
    root.mkdir(parents=True)
    for i in range(2):
        rng = np.random.default_rng(i)
        lengths = rng.integers(0, 4, rows)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        po.write_table(pa.table({
            "row_id": pa.array(np.arange(rows) + i * rows, pa.int64()),
            "label": pa.array(np.round(rng.random(rows), 6) + 0.5, pa.float64()),
            "float_0": pa.array(rng.random(rows, dtype=np.float32)),
            "idlist_0": pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                                 pa.array(rng.integers(0, 1000, int(offsets[-1])), pa.int64())),
        }), str(root / f"part-{i}.orc"), stripe_size=64 << 10, compression="uncompressed")


def _swap_labels_in_place(path: Path, a: int, b: int) -> None:
    """Rows a and b of the first stripe swap labels: same size, same tail, same inode, and
    the modification time set back."""
    before = path.stat()
    labels = po.ORCFile(str(path)).read(columns=["label"]).column("label").to_numpy()
    data = path.read_bytes()
    run = struct.pack(f"<{b - a + 1}d", *labels[a:b + 1])
    at = data.find(run)
    if at < 0 or at + len(run) > len(data) - TAIL:
        raise RuntimeError(f"{path}: the labels of rows {a}..{b} are not raw in the first stripe")
    swapped = list(labels[a:b + 1])
    swapped[0], swapped[-1] = swapped[-1], swapped[0]
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(struct.pack(f"<{b - a + 1}d", *swapped))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    if (after.st_size, after.st_ino) != (before.st_size, before.st_ino) or \
            path.read_bytes()[-TAIL:] != data[-TAIL:]:
        raise RuntimeError(f"{path}: the rewrite changed its size, inode or tail")


def stale_rows(tmp: Path, keys: str) -> Result:
    root = tmp / "issue37-stale"
    shutil.rmtree(root, ignore_errors=True)
    table, cache = root / "t", root / "cache"
    _uncompressed_table(table, 12_000)
    cluster = CacheCluster(root, table, cache, keys)
    try:
        cluster.epoch(_spec(table, "write-all", 4096))
    finally:
        cluster.stop()
    time.sleep(0.05)  # past the clock's tick
    _swap_labels_in_place(table / "part-0.orc", 0, 2)
    truth: dict[int, float] = {}
    for f in sorted(table.glob("*.orc")):
        t = po.ORCFile(str(f)).read(columns=["row_id", "label"])
        truth.update(zip(t.column("row_id").to_pylist(), t.column("label").to_pylist()))
    cluster = CacheCluster(root, table, cache, keys)
    try:
        _, labels = cluster.epoch(_spec(table, "read", 4096))
    finally:
        cluster.stop()
    stale = sum(1 for r, v in labels.items() if abs(v - np.float32(truth[r])) > 1e-6)
    exact = sorted(labels) == sorted(truth)
    return stale == 0 and exact, 0, (f"{stale} stale rows of {len(labels):,} after an in-place rewrite keeping size, "
                                     f"tail and inode; epoch {'exact' if exact else 'NOT exact'}")


# -- planted footers ------------------------------------------------------------------------------
def _planted(legit: bytes, footer_bytes: int, plain: bool) -> bytes:
    """A user without the key: the real segment's data and trailer fields, a footer of
    ``footer_bytes`` of well-formed entries, a made-up footer MAC (format 2, ``RLSEG002``;
    format 1, which had no footer MAC, for the tree before issue 37)."""
    old = legit.endswith(b"RLSEG001")
    if old:
        (length,) = struct.unpack("<I", legit[-12:-8])
        real, data, key_id = json.loads(legit[-12 - length:-12]), legit[:-12 - length], b""
    else:
        length, _blocks, _code, key_id, _mac = struct.unpack("<IIB3x8s16s", legit[-44:-8])
        real, data = json.loads(legit[-44 - length:-44]), legit[:-44 - length]
    entry = dict(real["blocks"][0], mac="0" * 32)
    one = len(json.dumps(entry, separators=(",", ":"))) + 1
    entries = [dict(entry, key=f"{i:032x}") for i in range(footer_bytes // one)]
    footer = dict(real, blocks=entries, **({"mac": "crc32", "key_id": None} if plain else {}))
    raw = json.dumps(footer, sort_keys=True, separators=(",", ":")).encode()
    if old:
        return data + raw + struct.pack("<I", len(raw)) + b"RLSEG001"
    code, kid = (1, bytes(8)) if plain else (2, key_id)
    return data + raw + struct.pack("<IIB3x8s16s", len(raw), min(len(entries), 4096), code, kid,
                                    os.urandom(16)) + b"RLSEG002"


def planted_footers(tmp: Path, keys: str, rows: int) -> Result:
    root = tmp / "issue37-footers"
    shutil.rmtree(root, ignore_errors=True)
    table, cache = root / "t", root / "cache"
    generate_table(str(table), rows=rows, partitions=2, dense=2, sparse=2, format="orc", seed=8,
                   stripe_rows=max(1000, rows // 10), progress=False)
    split_rows = max(1000, rows // 10)
    cluster = CacheCluster(root, table, cache, keys)
    try:
        cluster.epoch(_spec(table, "write-all", split_rows))
    finally:
        cluster.stop()

    def cached_epoch() -> tuple[float, int]:
        c = CacheCluster(root, table, cache, keys)
        try:
            seconds, labels = c.epoch(_spec(table, "read", split_rows))
            if sorted(labels) != list(range(rows)):
                raise RuntimeError("a cached epoch was not exact")
            return seconds, c.peak_worker_rss()
        finally:
            c.stop()

    clean = [cached_epoch() for _ in range(2)]
    splits = [d for d in (cache / "v1").glob("*/*") if d.is_dir()]
    for d in splits:
        legit = sorted(d.glob("*.seg"))[0].read_bytes()
        for i in range(PLANTED_PER_SPLIT):
            (d / f"999999999999{i:03d}-planted.seg").write_bytes(_planted(legit, FOOTER_BYTES, plain=i == 2))
    attacked = [cached_epoch() for _ in range(2)]
    t0, m0 = min(s for s, _ in clean), min(m for _, m in clean)
    t1, m1 = min(s for s, _ in attacked), min(m for _, m in attacked)
    held = t1 <= 1.2 * t0 and m1 <= 1.2 * m0
    shutil.rmtree(root, ignore_errors=True)  # ~0.5 GB of planted footers
    return held, 0, (f"{len(splits)} splits x {PLANTED_PER_SPLIT} planted 15 MB footers: cached epoch {t1:.2f} s vs "
                     f"{t0:.2f} s clean ({t1 / t0:.2f}x), worker peak RSS {m1 / 2**20:.0f} vs {m0 / 2**20:.0f} MiB "
                     f"({m1 / m0:.2f}x)")


# -- ipc squatting --------------------------------------------------------------------------------
SQUATTER = r"""
import os, re, sys, time
end = time.time() + float(sys.argv[1])
seen = set()
while time.time() < end:
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in seen:
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        for d in set(re.findall(r"ipc://(/[^\x00]*?/rl-[0-9a-f]{12})/", cmd)):
            seen.add(pid)
            try:
                os.mkdir(d, 0o777)
                os.chmod(d, 0o777)
                print(d, flush=True)
            except OSError:
                pass
    time.sleep(0.001)
"""


def ipc_squatting(tmp: Path) -> Result:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return True, 0, "skipped: needs root and setpriv to act as another uid"
    from remoteloader.client.embedded import EmbeddedCluster

    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    squatter = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                                 "/usr/bin/python3", "-I", "-c", SQUATTER, "60"],
                                stdout=subprocess.PIPE, text=True, cwd="/", env=env)
    time.sleep(0.5)
    started, used = 0, []
    old = os.environ.pop("XDG_RUNTIME_DIR", None)
    try:
        for _ in range(3):
            try:
                c = EmbeddedCluster(1, start_timeout=60)
            except RuntimeError:
                continue
            started += 1
            used.append(c.ipc_dir)
            c.close()
    finally:
        if old is not None:
            os.environ["XDG_RUNTIME_DIR"] = old
        squatter.terminate()
        out, _ = squatter.communicate(timeout=30)
    made = [d for d in out.split() if d]
    adopted = sorted(set(made) & set(used))
    for d in made:
        shutil.rmtree(d, ignore_errors=True)
    return started == 3 and not adopted, 0, (f"{started} of 3 embedded starts succeeded; the squatter made "
                                             f"{len(made)} of their directory names first, {len(adopted)} adopted")


def cases(tmp: Path, keys: str, rows: int) -> dict[str, Callable[[], Result]]:
    return {
        "issue 37: a table file rewritten in place, same size and tail (stale rows)": lambda: stale_rows(tmp, keys),
        "issue 37: 3 planted 15 MB footers a split, no key (cached epoch, worker memory)":
            lambda: planted_footers(tmp, keys, rows),
        "issue 37: another uid squatting the embedded ipc directory": lambda: ipc_squatting(tmp),
    }
