"""Shared fixtures: small generated tables, in-process clusters (``inprocess``, the fast
tier) and real master/worker processes on loopback (``cluster``, marked slow)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import psutil
import pytest

from remoteloader.protocol.arena import ENV_ARENA
from remoteloader.tools.datagen import generate_table

ROWS = 5000
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def tables(tmp_path_factory) -> dict[str, Path]:
    """One ORC and one Parquet table: 2 partitions, several stripes / row groups per file."""
    root = tmp_path_factory.mktemp("tables")
    return {fmt: table_of(root, fmt) for fmt in ("orc", "parquet")}


def table_of(root: Path | str, fmt: str) -> Path:
    """The tests' table in ``fmt`` under ``root``."""
    path = Path(root) / fmt
    generate_table(str(path), rows=ROWS, partitions=2, dense=4, sparse=4, format=fmt, seed=7,
                   stripe_size=64 << 10, row_group_rows=700, files_per_partition=2, progress=False)
    return path


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


def master_status(addr: str, auth: Optional[str] = None, run: Callable[..., Any] = subprocess.run) -> dict:
    """What ``remoteloader status --json`` prints for the master at ``addr`` (with keys from
    ``auth``); ``run``: how it is run (a ``Host.run`` of tests/hostnet.py: from that host)."""
    out = run([str(BIN / "remoteloader"), "status", "--master", addr, "--json", *(["--auth", auth] if auth else [])],
              capture_output=True, text=True, check=True, timeout=30)
    return json.loads(out.stdout)


def launched_workers(master_pid: int) -> list[psutil.Process]:
    """A master's local workers: the children of its worker fork server (its own child)."""
    try:
        return [w for server in psutil.Process(master_pid).children() for w in server.children()]
    except psutil.NoSuchProcess:
        return []


class MasterProcess:
    """``remoteloader-master``, started through its console script, with ``workers`` local
    workers (``--workers``), forked by its worker fork server; ``popen``: how it is started
    (a ``Host.popen`` of tests/hostnet.py: inside that host)."""

    def __init__(self, *args: str, workers: int = 2, bind: str = "tcp://127.0.0.1:0",
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> None:
        # Test tables live under the temp directory: the only tables these masters serve.
        self.proc = popen([str(BIN / "remoteloader-master"), "--bind", bind, "--workers", str(workers),
                           "--heartbeat-timeout", "2", "--allow-table", tempfile.gettempdir(), *args],
                          stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert "listening on" in line, line
        self.addr = line.rsplit(" ", 1)[1].strip()

    def worker_pids(self) -> list[int]:
        return [w.pid for w in launched_workers(self.proc.pid)]

    def started_worker_pids(self, n: int, timeout: float = 60.0) -> list[int]:
        """The pids of its launched workers once ``n`` are started (the master prints its
        address before it launches them)."""
        deadline = time.monotonic() + timeout
        while len(pids := self.worker_pids()) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pids) >= n, f"{len(pids)} of {n} workers started"
        return pids

    def kill(self) -> None:
        """SIGKILL, as a crash: its launched workers notice (parent-death signal) and exit."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        pids = [self.proc.pid]
        if self.proc.poll() is None:
            pids += [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]  # fork server too
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        wait_gone(pids)


class Cluster:
    """Real master and worker processes on 127.0.0.1; ``stop`` ends each one it started, by PID."""

    def __init__(self) -> None:
        self.masters: list[MasterProcess] = []
        self.worker_procs: list[subprocess.Popen] = []

    def master(self, *args: str, workers: int = 2, bind: str = "tcp://127.0.0.1:0") -> MasterProcess:
        """A master with ``workers`` launched workers; ``bind`` an old address to restart on it."""
        m = MasterProcess(*args, workers=workers, bind=bind)
        self.masters.append(m)
        return m

    def workers(self, addr: str, n: int, *args: str) -> list[subprocess.Popen]:
        """``n`` stand-alone ``remoteloader-worker`` processes (not the master's children)."""
        procs = [subprocess.Popen([str(BIN / "remoteloader-worker"), "--master", addr, *args]) for _ in range(n)]
        self.worker_procs += procs
        return procs

    def stop(self) -> None:
        for m in self.masters:
            m.stop()
        for p in self.worker_procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        wait_gone([p.pid for p in self.worker_procs])


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


@pytest.fixture(autouse=True)
def _data_socket_unless_arenas(request, monkeypatch):
    """Tests exercise the data socket, the path between hosts, unless marked ``arenas``: a
    worker on the client's host would otherwise hand most batches over in shared memory
    (protocol/arena.py), and the frames, seals and tampering the tests check would not be
    on the wire. tests/test_arena.py covers the arenas; the loaders of subprocesses
    inherit the setting."""
    if request.node.get_closest_marker("arenas") is None:
        monkeypatch.setenv(ENV_ARENA, "off")


def pytest_configure(config) -> None:
    """One intra-op torch thread in this process, as the demo's trainer has: its in-process
    clusters run master, workers and loaders on threads of it, and on two shared cores a
    parallel region per small tensor op costs more than it saves. (Processes the tests
    start keep torch's default.)"""
    import torch

    torch.set_num_threads(1)
    if is_fast_tier(config):
        os.environ.setdefault(FAST_TIER_ENV, "1")
    elif is_whole_suite_on_xdist(config):
        warm_caches(config)


def is_whole_suite_on_xdist(config) -> bool:
    """The xdist controller of a run of the whole suite (``make test``): not a worker, not
    ``-n0``, not a listing, not a few chosen files (they would wait seconds for it)."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return False
    if config.option.collectonly or config.option.help:
        return False
    tests_dir = Path(__file__).parent.resolve()
    return all((Path(config.invocation_params.dir) / arg).resolve() == tests_dir for arg in config.args)


def warm_caches(config) -> None:
    """Fill the bytecode and kernel caches once before the xdist workers start
    (tests/warm_up.py), one process per part; each waited for by its pid. Writing bytecode
    is their whole point, so they may even where the caller's environment says not to.
    A part that fails only warns: the tests that run the same code report it."""
    from .warm_up import PARTS

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    procs = {part: subprocess.Popen([sys.executable, "-m", "tests.warm_up", part], cwd=config.rootpath, env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for part in PARTS}
    for part, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            tail = (err or "").strip().splitlines()[-1:] or ["no output"]
            print(f"tests/warm_up.py {part} failed (exit {proc.returncode}): {tail[0]}", file=sys.stderr)


FAST_TIER_ENV = "REMOTELOADER_FAST_TIER"


def is_fast_tier(config) -> bool:
    """This run is ``pytest -m "not slow"``."""
    return config.getoption("markexpr", "").replace(" ", "") == "notslow"


def examples(n: int) -> int:
    """Hypothesis examples for a property test: ``n`` in ``make test``, a third of it (at
    least 5) in the fast tier (``pytest -m "not slow"``, set by ``pytest_configure`` before
    test modules are imported), which is for quick feedback while developing."""
    return max(5, n // 3) if os.environ.get(FAST_TIER_ENV) else n


def pytest_collection_modifyitems(items) -> None:
    """Tests that start real processes are ``slow`` (``pytest -m "not slow"`` skips them);
    every test using the ``cluster``, ``ray_cluster`` or ``hostnet`` fixture is one, others say so.
    ``inprocess`` clusters start none: their tests are the fast tier's end to end, except
    the whole-suite checks moved onto them from real processes (exactly-once semantics,
    bad data, every operator), which say ``slow`` to keep the fast tier under a minute.

    Slow tests run first: under xdist the long ones then start early, and the many short
    in-process tests fill the workers' last minutes instead of one long test alone. Tests
    with a Ray head run on one xdist worker, one after another (``--dist loadgroup``): two
    heads at once on two cores slowed each to minutes."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if {"cluster", "ray_cluster", "hostnet"} & fixtures:
            item.add_marker(pytest.mark.slow)
        if {"ray_cluster", "ray_head"} & fixtures:
            item.add_marker(pytest.mark.xdist_group("ray"))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order within each


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): one xdist worker per CPU for the fast tier, whose
    in-process tests keep a CPU busy; two per CPU (at most 8) for the whole suite, whose
    tests spend about half their time waiting on sockets and the processes they start."""
    cpus = len(os.sched_getaffinity(0))
    return cpus if is_fast_tier(config) else min(2 * cpus, 8)


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.stop()


@pytest.fixture
def hostnet():
    """Makes ``HostNet``s (tests/hostnet.py: hosts as network namespaces on one switch),
    ``hostnet(4)`` or ``hostnet(["master", "worker"])``; each is closed at the end. Skips the
    test, saying why, where namespaces cannot be made (not root, no ``ip``)."""
    from .hostnet import HostNet, netns_unavailable

    why = netns_unavailable()
    if why is not None:
        pytest.skip(why)
    made: list[HostNet] = []

    def make(hosts: int | Sequence[str]) -> HostNet:
        made.append(HostNet(hosts))
        return made[-1]

    yield make
    for net in made:
        net.close()


@pytest.fixture
def inprocess():
    """Makes in-process clusters (tests/cluster.py: master, workers and loaders on threads
    of this process); each is stopped at the end."""
    from .cluster import InProcessCluster  # cluster.py imports the worker fakes, which import this module

    made: list[InProcessCluster] = []

    def make(workers: int = 1, **worker_args) -> InProcessCluster:
        made.append(InProcessCluster(workers, **worker_args))
        return made[-1]

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def service(tables):
    """A master service on the ORC table with a fake clock (``service.now[0]``, seconds)."""
    from remoteloader.master.service import MasterConfig, MasterService
    from remoteloader.spec import DatasetSpec

    now = [1000.0]
    spec = DatasetSpec.from_dict(spec_dict(tables["orc"], batch_size=100))
    service = MasterService(MasterConfig(), None, lambda: now[0])
    service.submit(spec)
    service.now, service.spec = now, spec
    return service


@pytest.fixture
def orc_encoders(monkeypatch) -> list[dict]:
    """pyarrow's ORC encoders made while the test runs, each ``{"batch_size", "rows"}``
    (the rows written through it): what the offline tools' linear time is checked by."""
    import pyarrow.orc as paorc

    encoders: list[dict] = []

    class Recording(paorc.ORCWriter):
        def __init__(self, where, **options):
            encoders.append({"batch_size": options["batch_size"], "rows": 0})
            super().__init__(where, **options)

        def write(self, table):
            encoders[-1]["rows"] += table.num_rows
            super().write(table)

    monkeypatch.setattr(paorc, "ORCWriter", Recording)
    return encoders
