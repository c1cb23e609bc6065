"""Past one machine (issue 25): the Ray launcher asks Ray's cluster autoscaler for room.

A worker that does not fit the cluster's free resources waits as a pending actor, and
the launcher keeps ``ray.autoscaler.sdk.request_resources`` at one bundle per worker it
holds: grown with ``start``, shrunk when a worker ends, cleared at ``stop_all``.

The fast tests drive ``RayLauncher`` against a fake ``ray`` (this process must not
import Ray: a driver's token is read once per process, see ``test_scaling``). The slow
one runs a real head on 127.0.0.1 (2 CPUs) and reads the request back from Ray's own
autoscaler status (``ray status``, what both autoscalers report), once per autoscaler
(v1, a plain ``ray start``'s; v2, ``RAY_enable_autoscaler_v2=1``). Its Ray driver runs
in a child process (``drive``), so no Ray state stays in pytest's process.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Optional

import pytest

from remoteloader.master import launcher as launcher_mod
from remoteloader.master.launcher import LauncherThread, LocalLauncher, RayLauncher
from tests.conftest import BIN

WAIT_S = 120.0  # bound on waits that normally end within seconds
REPO = Path(__file__).resolve().parent.parent


# -- fast: a fake ray --------------------------------------------------------------------------

class FakeRef:
    def __init__(self) -> None:
        self.ready = False
        self.value = None


class FakeActor:
    def __init__(self, args: tuple) -> None:
        self.args, self.killed = args, False
        self.done_ref, self.started_ref = FakeRef(), FakeRef()
        self.wait = type("M", (), {"remote": lambda _: self.done_ref})()
        self.master = type("M", (), {"remote": lambda _: self.started_ref})()

    def place(self) -> None:  # Ray found room: the actor runs
        self.started_ref.ready = True

    def exit(self, code: int = 0) -> None:  # its worker exited (drained: 0)
        self.place()
        self.done_ref.ready, self.done_ref.value = True, code


class FakeRay:
    """Just what ``RayLauncher`` calls of ``ray``."""

    def __init__(self) -> None:
        self.actors: list[FakeActor] = []
        self.options: dict = {}
        self.shut = False

    def remote(self, **options):
        self.options = options
        fake = self

        class Cls:
            @staticmethod
            def remote(*args):
                fake.actors.append(FakeActor(args))
                return fake.actors[-1]

        return lambda _cls: Cls

    def wait(self, refs, num_returns, timeout, fetch_local=True):
        assert timeout == 0  # never blocks
        return [r for r in refs if r.ready], [r for r in refs if not r.ready]

    def get(self, ref):
        return ref.value

    def kill(self, actor):
        actor.killed = True

    def shutdown(self):
        self.shut = True


@pytest.fixture
def fake_ray(monkeypatch):
    """``(ray, requests)``: RayLauncher connects to ``ray``; ``requests`` records every
    request_resources call as (bundles, thread name)."""
    ray, requests = FakeRay(), []
    monkeypatch.setattr(launcher_mod, "connect_ray", lambda *_: ray)
    monkeypatch.setattr(launcher_mod, "request_ray_resources",
                        lambda bundles: requests.append((bundles, threading.current_thread().name)))
    return ray, requests


def test_the_request_follows_the_fleet_and_waiting_actors_are_pending(fake_ray):
    ray, requests = fake_ray
    launcher = RayLauncher("tcp://127.0.0.1:1", "127.0.0.1:6379", num_cpus=2)
    assert requests == []  # nothing asked before any worker is wanted
    launcher.start(3)
    assert requests[-1][0] == [{"CPU": 2.0}] * 3
    assert launcher.running() == 3 and launcher.pending() == 3
    ray.actors[0].place()
    ray.actors[1].place()
    assert launcher.running() == 3 and launcher.pending() == 1  # pending are counted in running
    launcher.reap()
    assert len(requests) == 1  # unchanged: no second RPC
    ray.actors[0].exit(0)  # drained
    assert launcher.reap() == 0
    assert requests[-1][0] == [{"CPU": 2.0}] * 2 and launcher.running() == 2 and ray.actors[0].killed
    ray.actors[2].exit(1)  # a pending actor that failed is neither pending nor running
    assert launcher.reap() == 1
    assert launcher.pending() == 0 and launcher.running() == 1
    assert requests[-1][0] == [{"CPU": 2.0}]
    launcher.stop_all()
    assert requests[-1][0] == [] and len(requests) == 4 and ray.shut  # cleared, then disconnected


def test_requests_are_made_on_the_launcher_thread_and_pending_travels_to_the_loop(fake_ray):
    ray, requests = fake_ray
    thread = LauncherThread(RayLauncher("tcp://127.0.0.1:1", "127.0.0.1:6379"), reap_interval_s=0.01)
    thread.start(2)
    assert thread.pending() == 2 and thread.running() == 2  # counted at once, while queued
    deadline = time.monotonic() + WAIT_S
    while len(ray.actors) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    ray.actors[0].place()
    while thread.pending() != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread.pending() == 1 and thread.running() == 2
    thread.stop_all()
    assert [len(b) for b, _ in requests] == [2, 0]
    assert {name for _, name in requests} == {"launcher"}  # never the caller's (the master loop's) thread


def test_a_failing_request_is_logged_once_and_never_fatal(monkeypatch, caplog):
    ray = FakeRay()
    monkeypatch.setattr(launcher_mod, "connect_ray", lambda *_: ray)
    calls = []

    def no_autoscaler(bundles):
        calls.append(len(bundles))
        raise RuntimeError("no autoscaler here")

    monkeypatch.setattr(launcher_mod, "request_ray_resources", no_autoscaler)
    launcher = RayLauncher("tcp://127.0.0.1:1", "127.0.0.1:6379")
    with caplog.at_level(logging.WARNING, logger=launcher_mod.__name__):
        launcher.start(2)
        launcher.start(1)
        launcher.reap()
        monkeypatch.setattr(launcher, "_retry_at", 0.0)  # as if REQUEST_RETRY_S had passed
        launcher.reap()
    assert launcher.running() == 3
    assert calls == [2, 3]  # retried, not once a reap
    assert caplog.text.count("could not ask Ray's autoscaler") == 1
    launcher.stop_all()  # no request went through: none to clear
    assert calls == [2, 3] and ray.shut


def test_buffer_bytes_reaches_the_worker_command_line(fake_ray):
    argv = [LocalLauncher("tcp://127.0.0.1:1", ["--buffer-batches", "4"], buffer_bytes=64 << 20).worker_argv(),
            LocalLauncher("tcp://127.0.0.1:1", ["--buffer-batches", "4"]).worker_argv()]
    assert argv[0][-4:] == ["--buffer-bytes", str(64 << 20), "--buffer-batches", "4"]
    assert "--buffer-bytes" not in argv[1]
    ray, _ = fake_ray
    launcher_mod.make_launcher("ray", "tcp://127.0.0.1:1", ray_address="127.0.0.1:6379", buffer_bytes=1 << 20).start(1)
    worker_args = ray.actors[0].args[1]  # WorkerProcessActor(master_addr, worker_args, worker_env)
    assert worker_args[:2] == ["--buffer-bytes", str(1 << 20)] and "--buffer-batches" in worker_args


def test_max_message_bytes_reaches_the_worker_command_line(fake_ray):
    local = launcher_mod.make_launcher("local", "tcp://127.0.0.1:1", max_message_bytes=4 << 20).worker_argv()
    assert local[local.index("--max-message-bytes") + 1] == str(4 << 20)
    assert "--max-message-bytes" not in launcher_mod.make_launcher("local", "tcp://127.0.0.1:1").worker_argv()
    ray, _ = fake_ray
    launcher_mod.make_launcher("ray", "tcp://127.0.0.1:1", ray_address="127.0.0.1:6379", buffer_bytes=1 << 20,
                               max_message_bytes=8 << 20).start(1)
    worker_args = ray.actors[0].args[1]
    assert worker_args[:4] == ["--buffer-bytes", str(1 << 20), "--max-message-bytes", str(8 << 20)]


# -- fast: connect_ray's checks against a fake ``ray`` module (issue 38, finding 4) ----------------

class FakeRayModule(types.ModuleType):
    """What ``connect_ray`` calls of the ``ray`` module itself: ``init`` raises ``error``, or
    connects to a cluster whose head (the node with Ray's head resource) and other nodes
    are at the given addresses. ``init_env``: this process's settings when ``init`` ran."""

    def __init__(self, head: str = "127.0.0.1", nodes: tuple = (), error: Optional[BaseException] = None,
                 swaps_loopback: bool = False) -> None:
        super().__init__("ray")
        self.head, self.node_addrs, self.error = head, nodes, error
        self.initialized = self.shut = False
        self.init_env: Optional[dict] = None
        self.actors: list[FakeActor] = []
        self.options: dict = {}
        # Ray's ENABLE_RAY_CLUSTER, read from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import
        self._private = types.SimpleNamespace(ray_constants=types.SimpleNamespace(ENABLE_RAY_CLUSTER=swaps_loopback))

    remote = FakeRay.remote   # what a RayLauncher does once connected

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, **kwargs) -> None:
        self.init_env = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
        if self.error is not None:
            raise self.error
        self.initialized = True

    def get_runtime_context(self):
        return types.SimpleNamespace(gcs_address=f"{self.head}:6379")

    def nodes(self) -> list[dict]:
        head = {"NodeID": "head", "NodeManagerAddress": self.head, "Alive": True,
                "Resources": {"CPU": 2.0, "node:__internal_head__": 1.0}}
        return [head, *({"NodeID": f"n{i}", "NodeManagerAddress": a, "Alive": True, "Resources": {"CPU": 2.0}}
                        for i, a in enumerate(self.node_addrs))]

    def shutdown(self) -> None:
        self.shut, self.initialized = True, False


@pytest.fixture
def ray_env(monkeypatch, tmp_path):
    """A process that has not imported ray, with no Ray settings in its environment and a
    home without ~/.ray/auth_token; ``install(fake)`` makes ``import ray`` import ``fake``.
    Whatever connect_ray sets (the environment, sys.modules) is undone after the test."""
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        monkeypatch.setenv(name, "")   # recorded, so that the delenv and connect_ray's own setting are undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setitem(sys.modules, "ray", None)  # recorded likewise: the import below is undone too
    monkeypatch.delitem(sys.modules, "ray")

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        fake: Optional[FakeRayModule] = None

        def find_spec(self, name, path=None, target=None):
            return importlib.util.spec_from_loader(name, self) if name == "ray" and self.fake else None

        def create_module(self, spec):
            return self.fake

        def exec_module(self, module) -> None:
            pass

    finder = Finder()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])

    def install(fake: FakeRayModule) -> FakeRayModule:
        sys.modules.pop("ray", None)   # a new process, as far as Ray is concerned
        finder.fake = fake
        return fake

    return install


def test_a_loopback_master_refuses_a_ray_head_that_is_not_on_loopback(ray_env):
    """``ray start --head --node-ip-address 127.0.0.1`` without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0:
    Ray swaps the address for the machine's and listens everywhere; the master hung."""
    fake = ray_env(FakeRayModule(head="192.0.2.2"))
    with pytest.raises(ValueError) as refused:
        launcher_mod.make_launcher("ray", "tcp://127.0.0.1:5555", ray_address="127.0.0.1:6379")
    message = str(refused.value)
    assert "192.0.2.2" in message and "loopback" in message and "tcp://127.0.0.1:5555" in message
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --node-ip-address 127.0.0.1" in message
    assert fake.shut, "the connection it made is closed again"
    # A worker node off loopback is refused too; a master bound where nodes reach it is not.
    ray_env(FakeRayModule(nodes=("127.0.0.1", "10.0.0.7")))
    with pytest.raises(ValueError, match="nodes at 10.0.0.7"):
        RayLauncher("tcp://localhost:5555", "127.0.0.1:6379")
    ray_env(FakeRayModule(head="192.0.2.2"))
    assert RayLauncher("tcp://192.0.2.2:5555", "192.0.2.2:6379").running() == 0
    ray_env(FakeRayModule(nodes=("127.0.0.1",)))
    assert RayLauncher("tcp://127.0.0.1:5555", "127.0.0.1:6379").running() == 0   # one machine, on loopback


def test_a_loopback_ray_address_is_kept_as_given(ray_env):
    """A driver given 127.0.0.1:PORT without the setting connected to the machine's address
    instead, where a loopback head does not listen, and waited: the master hung."""
    fake = ray_env(FakeRayModule())
    launcher_mod.connect_ray("127.0.0.1:6379")
    assert fake.init_env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0", "set before ray was imported"
    other = ray_env(FakeRayModule(head="10.0.0.5"))
    os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    launcher_mod.connect_ray("10.0.0.5:6379")
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in other.init_env, "a cluster address is left alone"
    # Ray imported earlier without the setting would swap the address: said, not waited on.
    ray_env(FakeRayModule(swaps_loopback=True))
    import ray  # noqa: F401  (the fake: imported before connect_ray, as another module could)

    with pytest.raises(ValueError, match="RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"):
        launcher_mod.connect_ray("127.0.0.1:6379")


def _refused_token(address: str = "127.0.0.1:6379") -> ConnectionError:
    """What ``ray.init`` raises when the cluster refuses the driver's token (Ray 2.60)."""
    error = ConnectionError(f"Failed to connect to Ray cluster at {address}")
    error.__cause__ = RuntimeError(
        "Failed to connect to GCS. Last connection error: Traceback (most recent call last): ... "
        "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token is missing "
        "or incorrect.")
    return error


SECRET = "0123456789abcdef-not-for-messages"


@pytest.mark.parametrize("setting, told", [
    ("none", ["sent no token", "RAY_AUTH_MODE is unset", "--ray-auth-token-file"]),
    ("flag", ["--ray-auth-token-file", "auth_token_given"]),
    ("variable", ["environment variable RAY_AUTH_TOKEN"]),
    ("mode only", ["had no token", "RAY_AUTH_TOKEN_PATH", ".ray/auth_token does not exist"]),
    ("default file", ["Ray's default file", "home/.ray/auth_token"]),
])
def test_a_refused_ray_token_is_named_with_where_it_came_from(ray_env, monkeypatch, tmp_path, setting, told):
    """Ray's own last line was "Failed to connect to Ray cluster", nothing about the token."""
    token_file = None
    if setting == "flag":
        token_file = tmp_path / "auth_token_given"
        token_file.write_text(SECRET)
    elif setting == "variable":
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        monkeypatch.setenv("RAY_AUTH_TOKEN", SECRET)
    elif setting == "mode only":
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
    elif setting == "default file":
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        default = tmp_path / "home" / ".ray" / "auth_token"
        default.parent.mkdir(parents=True)
        default.write_text(SECRET)
    ray_env(FakeRayModule(error=_refused_token()))
    with pytest.raises(ConnectionError) as refused:
        launcher_mod.make_launcher("ray", "tcp://127.0.0.1:5555", ray_address="127.0.0.1:6379",
                                   ray_auth_token_path=None if token_file is None else str(token_file))
    message = str(refused.value)
    assert "refused this master's token" in message and "127.0.0.1:6379" in message
    assert all(part in message for part in told), message
    assert SECRET not in message
    assert refused.value.__cause__ is None and refused.value.__suppress_context__, "Ray's traceback is not repeated"


def test_other_ray_connection_failures_pass_through(ray_env):
    down = ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:6379")
    down.__cause__ = RuntimeError("Failed to connect to GCS within 20 seconds")
    ray_env(FakeRayModule(error=down))
    with pytest.raises(ConnectionError) as failed:
        launcher_mod.connect_ray("127.0.0.1:6379")
    assert failed.value is down


def test_the_readme_s_one_machine_ray_lines_keep_ray_on_loopback():
    """The README's Ray-on-one-machine lines: the head with the setting and a loopback node
    address (as the slow tests start theirs), the master with its token file; every master
    flag exists."""
    from remoteloader.master.__main__ import build_parser

    lines = (REPO / "README.md").read_text().splitlines()
    head = [line for line in lines if " ray start --head" in line]
    assert len(head) == 1, head
    assert head[0].startswith(launcher_mod.RAY_ONE_MACHINE + " "), head[0]
    master = [line.split("#")[0].split() for line in lines
              if line.startswith("remoteloader-master ") and "--ray-address 127.0.0.1:" in line]
    assert len(master) == 1, master
    args = build_parser().parse_args(master[0][1:])
    assert args.launcher == "ray" and args.ray_auth_token_file and args.bind.startswith("tcp://127.0.0.1:")
    assert args.ray_address.split(":")[1] == head[0].split("--port ")[1].split()[0], "the master finds the head"


# -- slow: a real Ray head on 127.0.0.1 ---------------------------------------------------------

@pytest.fixture
def ray_head():
    """A Ray head on 127.0.0.1 with 2 CPUs and token authentication (its default autoscaler);
    yields ``(address, token file, env)``. Autoscaler v2 (``RAY_enable_autoscaler_v2=1``)
    passed the same test when it was written; the suite runs one to keep its time."""
    from tests.test_scaling import ray_head as started

    with started(2) as head:
        yield head


def ray_status(address: str) -> tuple[int, int, str]:
    """What Ray's autoscaler reports (``ray status``; the driver's environment carries the
    token): one-CPU bundles asked for by request_resources ("From request_resources:
    {'CPU': 1.0}: 4 from request_resources()"), one-CPU actors waiting for room ("Pending
    Demands: {'CPU': 1.0}: 2+ pending tasks/actors"), and the whole report."""
    out = subprocess.run([str(BIN / "ray"), "status", "--address", address], capture_output=True, text=True,
                         timeout=60).stdout
    requested = re.findall(r"\{'CPU': 1\.0\}: (\d+) from request_resources\(\)", out)
    waiting = re.findall(r"\{'CPU': 1\.0\}: (\d+)\+ pending tasks/actors", out)
    return sum(map(int, requested)), sum(map(int, waiting)), out


def drive(address: str, token_file: str, table: str, out_path: str) -> None:
    """The Ray driver (in a child process): a master on 127.0.0.1, a LauncherThread over a
    RayLauncher asked for 4 workers on a 2-CPU head, one drained, then stop_all. Writes what
    it saw at each step to ``out_path`` (JSON) for the test to check."""
    from remoteloader.master.server import MasterServer
    from remoteloader.master.service import MasterConfig, MasterService
    from remoteloader.protocol import messages as M
    from remoteloader.protocol.rpc import RpcClient
    from remoteloader.spec import DatasetSpec
    from tests.conftest import spec_dict
    import zmq

    seen: dict = {"requests": [], "steps": {}}
    service = MasterService(MasterConfig(heartbeat_timeout=10))
    service.submit(DatasetSpec.from_dict(spec_dict(Path(table))))
    server = MasterServer(service, "tcp://127.0.0.1:0")
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    real_request = launcher_mod.request_ray_resources

    def recorded(bundles):  # still Ray's own call; the record says what and from which thread
        real_request(bundles)
        seen["requests"].append([len(bundles), threading.current_thread().name])

    launcher_mod.request_ray_resources = recorded
    deadline = time.monotonic() + WAIT_S

    rpc = RpcClient(zmq.Context.instance(), server.addr, 10)

    def live_workers() -> list[dict]:  # asked of the master's loop, as `remoteloader status` does
        return [w for w in rpc.call(M.Status()).status["workers"] if not w["draining"]]

    def step(name: str, until, requested: int, waiting: int, fleet) -> None:
        """Wait until ``until()`` and Ray's status shows ``requested`` bundles asked for and
        ``waiting`` actors pending (it lags: its autoscaler reports every few seconds);
        record what was seen."""
        ray_requested = ray_waiting = -1
        report = ""
        while time.monotonic() < deadline:
            if until():
                ray_requested, ray_waiting, report = ray_status(address)
                if (ray_requested, ray_waiting) == (requested, waiting):
                    break
            time.sleep(0.3)
        seen["steps"][name] = {"running": fleet.running(), "pending": fleet.pending(),
                               "workers": len(live_workers()), "ray_requested": ray_requested,
                               "ray_pending": ray_waiting, "ray_status": report}

    engine = RayLauncher(server.addr, address, auth_token_path=token_file)
    launcher = LauncherThread(engine, reap_interval_s=0.2)
    try:
        launcher.start(4)  # two fit the head's 2 CPUs; two wait for room
        step("grown", lambda: len(live_workers()) == 2 and launcher.pending() == 2, 4, 2, launcher)
        first = live_workers()[0]["id"]
        # A drain, as the worker's SIGTERM asks (with its token): it leaves once it holds nothing.
        rpc.call(M.Drain(worker_id=first, token=server.service.keys.worker_token(first)))
        # It exits, its CPU goes to a pending actor, and the request shrinks.
        step("drained", lambda: launcher.running() == 3 and launcher.pending() == 1
             and first not in [w["id"] for w in live_workers()], 3, 1, launcher)
    finally:
        launcher.stop_all()
    try:
        step("stopped", lambda: True, 0, 0, engine)  # the thread has ended: the launcher's own counts
    finally:
        rpc.close()
        server.stop_event.set()
        serving.join(5)
    Path(out_path).write_text(json.dumps(seen))


@pytest.mark.slow
def test_ray_autoscaler_is_asked_for_the_workers_that_do_not_fit(ray_head, tables, tmp_path):
    address, token_file, env = ray_head
    out = tmp_path / "seen.json"
    child = subprocess.run([sys.executable, "-c", "import sys, tests.test_ray_resources as t; t.drive(*sys.argv[1:])",
                            address, token_file, str(tables["orc"]), str(out)],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-5000:]
    seen = json.loads(out.read_text())
    steps = seen["steps"]
    grown, drained, stopped = steps["grown"], steps["drained"], steps["stopped"]
    # 4 wanted on 2 CPUs: 2 run and register, 2 are pending (counted in running, not as workers),
    # Ray's autoscaler was asked for all 4, and it too sees 2 actors waiting for room.
    assert (grown["running"], grown["pending"], grown["workers"]) == (4, 2, 2), grown["ray_status"]
    assert (grown["ray_requested"], grown["ray_pending"]) == (4, 2), grown["ray_status"]
    # One drained: it left, a pending actor took its CPU, and the request shrank to 3.
    assert (drained["running"], drained["pending"]) == (3, 1), drained["ray_status"]
    assert (drained["ray_requested"], drained["ray_pending"]) == (3, 1), drained["ray_status"]
    # stop_all cleared it.
    assert (stopped["running"], stopped["pending"]) == (0, 0), stopped["ray_status"]
    assert (stopped["ray_requested"], stopped["ray_pending"]) == (0, 0), stopped["ray_status"]
    # One RPC per change of the fleet, all on the launcher's thread.
    assert seen["requests"] == [[4, "launcher"], [3, "launcher"], [0, "launcher"]]
