"""Shared fixtures: small generated tables and real master/worker processes on loopback."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from remoteloader.tools.datagen import generate_table

ROWS = 5000


@pytest.fixture(scope="session")
def tables(tmp_path_factory) -> dict[str, Path]:
    """One ORC and one Parquet table: 2 partitions, several stripes / row groups per file."""
    root = tmp_path_factory.mktemp("tables")
    out = {}
    for fmt in ("orc", "parquet"):
        path = root / fmt
        generate_table(str(path), rows=ROWS, partitions=2, dense=4, sparse=4, format=fmt, seed=7,
                       stripe_size=64 << 10, row_group_rows=700, files_per_partition=2, progress=False)
        out[fmt] = path
    return out


def spec_dict(table: Path, **overrides) -> dict:
    spec = {
        "table": {"path": str(table)},
        "features": {
            "label": "label",
            "dense": [
                "float_0",
                {"name": "f1", "column": "float_1", "transforms": [{"op": "clamp", "min": 0.0, "max": 5.0}]},
            ],
            "sparse": [
                {"name": "s0", "column": "idlist_0", "transforms": [{"op": "firstx", "x": 3}]},
                {"name": "s1", "column": "idlist_1",
                 "transforms": [{"op": "sigrid_hash", "salt": 5, "max_value": 1000}]},
            ],
            "passthrough": ["row_id"],
        },
        "batch_size": 256,
        "split_rows": 900,
    }
    spec.update(overrides)
    return spec


class MasterProcess:
    """``remoteloader-master`` with local workers, started through the console script."""

    def __init__(self, *args: str, workers: int = 2) -> None:
        exe = Path(sys.executable).parent / "remoteloader-master"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "remoteloader.master"]
        self.proc = subprocess.Popen([*cmd, "--bind", "tcp://127.0.0.1:0", "--workers", str(workers),
                                      "--heartbeat-timeout", "2", *args],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert "listening on" in line, line
        self.addr = line.rsplit(" ", 1)[1].strip()

    def worker_pids(self) -> list[int]:
        return [c.pid for c in psutil.Process(self.proc.pid).children()]

    def stop(self) -> None:
        pids = [self.proc.pid, *self.worker_pids()]
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        wait_gone(pids)


def wait_gone(pids, timeout: float = 15.0) -> None:
    """Every pid has exited (killed if it had to be)."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    for p in alive:
        os.kill(p, 9)
    assert not alive, f"processes left behind: {alive}"


@pytest.fixture
def master_factory():
    started: list[MasterProcess] = []

    def start(*args: str, workers: int = 2) -> MasterProcess:
        m = MasterProcess(*args, workers=workers)
        started.append(m)
        return m

    yield start
    for m in started:
        m.stop()
