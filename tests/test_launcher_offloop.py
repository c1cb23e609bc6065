"""The master's loop never blocks on a launcher (issue 22, defect 9).

A launcher's calls can block for long (Ray's control store, a slow fork): a fake one
blocks until the test releases it, and the master must answer requests meanwhile. The
master runs in-process (``remoteloader.master.__main__.main``) with the fake launcher
in place of the real one; nothing here waits on a sleep.
"""
from __future__ import annotations

import queue
import signal
import threading

import pytest
import zmq

from remoteloader.master import __main__ as master_main
from remoteloader.master.launcher import LauncherThread
from remoteloader.master.server import MasterServer
from remoteloader.protocol.rpc import MasterUnavailable, RpcClient
from remoteloader.protocol import messages as M

WAIT_S = 30.0  # generous bound on waits that normally end at once


class BlockingLauncher:
    """A launcher whose ``start`` and ``reap`` block until ``release`` is set (a Ray cluster
    whose control store does not answer); it records which threads called it."""

    def __init__(self, block_in: tuple[str, ...] = ("start", "reap")) -> None:
        self.block_in = block_in
        self.release = threading.Event()
        self.entered = threading.Event()  # a call is blocked (or was)
        self.calls: list[str] = []
        self.threads: set[int] = set()
        self.count = 0
        self.failed_next_reap = 0
        self.reaped_twice = threading.Event()  # so the counts of the first reap were posted
        self.started = threading.Event()
        self.stopped = threading.Event()

    def _call(self, name: str) -> None:
        self.calls.append(name)
        self.threads.add(threading.get_ident())
        if name in self.block_in:
            self.entered.set()
            self.release.wait()

    def start(self, n: int) -> None:
        self._call("start")
        self.count += n
        self.started.set()

    def running(self) -> int:  # a list's length in every real launcher: never blocks
        return self.count

    def reap(self) -> int:
        self._call("reap")
        if self.calls.count("reap") >= 2:
            self.reaped_twice.set()
        failed, self.failed_next_reap = self.failed_next_reap, 0
        self.count -= failed
        return failed

    def stop_all(self) -> None:
        self._call("stop_all")
        self.count = 0
        self.stopped.set()


@pytest.fixture
def master(monkeypatch):
    """``run(args, fake, client)``: runs the master's ``main`` on this thread with ``fake`` as
    its launcher, and ``client(server)`` on another thread, which must end by stopping it."""
    servers: queue.Queue[MasterServer] = queue.Queue()

    class RecordedServer(MasterServer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            servers.put(self)

    monkeypatch.setattr(master_main, "MasterServer", RecordedServer)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # main's handlers must not stay in pytest's process

    def run(args: list[str], fake: BlockingLauncher, client) -> int:
        monkeypatch.setattr(master_main, "make_launcher", lambda *_, **__: fake)
        thread = threading.Thread(target=lambda: client(servers.get(timeout=WAIT_S)), name="client")
        thread.start()
        try:
            return master_main.main(["--bind", "tcp://127.0.0.1:0", *args])
        finally:
            fake.release.set()
            thread.join()

    return run


@pytest.mark.parametrize("args", [["--workers", "2"], ["--autoscale", "--min-workers", "2", "--max-workers", "3"]],
                         ids=["fixed-pool", "autoscale"])
def test_the_master_answers_while_its_launcher_blocks(master, args):
    fake = BlockingLauncher()
    seen: dict = {}

    def client(server: MasterServer) -> None:
        rpc = RpcClient(zmq.Context.instance(), server.addr, timeout_s=WAIT_S)
        try:
            seen["launcher_blocked"] = fake.entered.wait(WAIT_S)
            seen["reply"] = M.tag(rpc.call(M.Status()))
            seen["answered_while_blocked"] = not fake.release.is_set()
        except MasterUnavailable as e:  # today's tree: the loop (or main before it) waits in start()
            seen["reply"] = e
        finally:
            rpc.reset()
            fake.release.set()
            server.request_stop()

    assert master(args, fake, client) == 0
    assert seen["launcher_blocked"]
    assert seen["reply"] == "status_reply"
    assert seen["answered_while_blocked"]
    # Shutdown still stopped every worker, and one thread (not the loop's) made every launcher call.
    assert "start" in fake.calls and fake.calls[-1] == "stop_all"
    assert len(fake.threads) == 1 and threading.get_ident() not in fake.threads


def test_calls_on_the_loop_return_while_the_launcher_is_stuck():
    fake = BlockingLauncher()
    launcher = LauncherThread(fake, reap_interval_s=0.01)
    assert fake.entered.wait(WAIT_S)  # the thread's own reap is stuck
    launcher.start(3)
    assert launcher.running() == 3  # counted at once: the autoscaler does not ask again
    assert launcher.reap() == 0
    fake.release.set()
    assert fake.started.wait(WAIT_S) and fake.count == 3
    launcher.stop_all()
    assert fake.calls[-1] == "stop_all" and fake.count == 0


def test_failures_are_reported_once_and_running_follows_the_launcher():
    fake = BlockingLauncher(block_in=())
    fake.count, fake.failed_next_reap = 2, 1  # two workers (adopted), one of which dies
    launcher = LauncherThread(fake, reap_interval_s=0.01)
    assert fake.reaped_twice.wait(WAIT_S)
    assert launcher.reap() == 1
    assert launcher.reap() == 0  # told once
    assert launcher.running() == 1
    launcher.stop_all()
    assert fake.stopped.is_set()


def test_shutdown_gives_up_on_a_stuck_launcher_and_drops_queued_starts(caplog):
    fake = BlockingLauncher()
    launcher = LauncherThread(fake)
    launcher.start(1)
    assert fake.entered.wait(WAIT_S)
    launcher.start(5)  # queued behind the stuck call
    launcher.stop_all(timeout_s=0.05)
    assert "did not stop its workers" in caplog.text
    fake.release.set()  # the stuck call returns: the thread skips the queued start, then stops all
    assert fake.stopped.wait(WAIT_S)
    assert fake.calls.count("start") == 1 and fake.calls[-1] == "stop_all"


class WaitingLauncher(BlockingLauncher):
    """One whose workers can wait for room: ``pending()`` says how many (a Ray launcher's
    unplaced actors); ``posted`` is set once the thread surely posted counts taken after ``start``."""

    def __init__(self) -> None:
        super().__init__(block_in=("start",))
        self.waiting = 0
        self.rounds = 0
        self.posted = threading.Event()

    def pending(self) -> int:
        if self.started.is_set():
            self.rounds += 1
            if self.rounds == 2:  # the first round's counts are posted by now
                self.posted.set()
        return self.waiting


def test_pending_counts_starts_not_done_and_the_launchers_waiting_workers():
    """``pending`` (issue 25): the starts queued or stuck in the launcher, then what its
    optional ``pending()`` says; both are in ``running`` too."""
    fake = WaitingLauncher()
    launcher = LauncherThread(fake, reap_interval_s=0.01)
    launcher.start(3)
    assert fake.entered.wait(WAIT_S)
    assert launcher.pending() == 3 and launcher.running() == 3  # stuck in start: none started
    fake.waiting = 1  # started, one waits for room
    fake.release.set()
    assert fake.posted.wait(WAIT_S)
    assert launcher.pending() == 1 and launcher.running() == 3
    launcher.stop_all()
    plain = LauncherThread(BlockingLauncher(block_in=()))  # no pending(): none wait
    assert plain.pending() == 0
    plain.stop_all()
