"""The local launcher's worker fork server: workers forked on request, their ends reported
with their exit codes, all of them stopped at shutdown, and a server that dies replaced.

The workers here point at a master that does not exist: they retry it until stopped, which
is all these tests need of them (tests/test_end_to_end.py runs forked workers in clusters)."""
from __future__ import annotations

import logging
import os
import signal
import time

import psutil
import pytest

from remoteloader.master.forkserver import ForkServerError, ForkServerHandle
from remoteloader.master.launcher import LocalLauncher
from tests.conftest import wait_gone

pytestmark = pytest.mark.slow  # real processes
NO_MASTER = "tcp://127.0.0.1:9"


def reap_until(launcher: LocalLauncher, failures: int, timeout: float = 30.0) -> int:
    """Reap until ``failures`` workers were seen to fail; how many were."""
    seen, deadline = 0, time.monotonic() + timeout
    while seen < failures and time.monotonic() < deadline:
        seen += launcher.reap()
        time.sleep(0.05)
    return seen


def test_workers_are_forked_by_one_server_and_stopped_with_it():
    launcher = LocalLauncher(NO_MASTER)
    try:
        launcher.start(2)
        server = psutil.Process(launcher._server.proc.pid)
        workers = [psutil.Process(pid) for pid in launcher.pids]
        assert launcher.running() == 2 and all(w.ppid() == server.pid for w in workers)
        deadline = time.monotonic() + 10  # each names itself once it runs
        while {w.name() for w in workers} != {"rl-worker"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {w.name() for w in workers} == {"rl-worker"}
        # The worker's arguments are those a launched remoteloader-worker would get.
        assert launcher.worker_argv()[:3] == ["--master", NO_MASTER, "--die-with-parent"]
        launcher.start(1)  # the same server forks the next one
        assert launcher._server.proc.pid == server.pid and launcher.running() == 3
        pids = [server.pid, *launcher.pids]
    finally:
        launcher.stop_all()
    assert launcher.running() == 0 and launcher._server is None
    wait_gone(pids, timeout=1.0)  # stop_all returns once the server has reaped every worker


def test_a_killed_worker_is_reaped_as_failed_and_one_that_exits_0_is_not(caplog):
    launcher = LocalLauncher(NO_MASTER)
    try:
        launcher.start(2)
        killed, stopped = sorted(launcher.pids)
        psutil.Process(killed).send_signal(signal.SIGKILL)
        with caplog.at_level(logging.WARNING, logger="remoteloader.master.launcher"):
            assert reap_until(launcher, 1) == 1
        assert f"local worker pid {killed} exited with code -9" in caplog.text
        assert launcher.pids == {stopped}
    finally:
        launcher.stop_all()
    done = LocalLauncher(NO_MASTER, ["--version"])  # prints its version and exits 0
    try:
        done.start(1)
        deadline = time.monotonic() + 30
        while done.running() and time.monotonic() < deadline:
            assert done.reap() == 0
            time.sleep(0.05)
        assert done.running() == 0
    finally:
        done.stop_all()


def test_a_worker_refusing_its_arguments_reports_its_status():
    launcher = LocalLauncher(NO_MASTER, ["--buffer-bytes", "lots"])
    try:
        launcher.start(1)
        assert reap_until(launcher, 1) == 1 and launcher.running() == 0
    finally:
        launcher.stop_all()


def test_the_server_leaves_sigterm_and_sigint_to_the_master_and_its_workers():
    """A stop that signals the whole process group (systemd, Ctrl-C) must not end the server
    before the master has it stop the workers; the workers get their usual handlers."""
    launcher = LocalLauncher(NO_MASTER)
    try:
        launcher.start(1)
        server = psutil.Process(launcher._server.proc.pid)
        (worker,) = launcher.pids
        server.send_signal(signal.SIGTERM)
        server.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
        assert launcher.reap() == 0 and launcher.running() == 1
        process = launcher._server.proc
        launcher.stop_all()  # the server still carries out the master's stop
        assert process.returncode == 0
    finally:
        launcher.stop_all()
    wait_gone([worker], timeout=1.0)


def test_a_dead_server_fails_its_workers_and_the_next_start_brings_another(caplog):
    launcher = LocalLauncher(NO_MASTER)
    try:
        launcher.start(2)
        first = launcher._server.proc.pid
        orphans = list(launcher.pids)
        psutil.Process(first).send_signal(signal.SIGKILL)
        with caplog.at_level(logging.WARNING, logger="remoteloader.master.launcher"):
            assert reap_until(launcher, 2) == 2
        assert "the worker fork server ended" in caplog.text and launcher.running() == 0
        wait_gone(orphans)  # their parent-death signal ended them
        launcher.start(1)
        assert launcher._server.proc.pid != first and launcher.running() == 1
    finally:
        launcher.stop_all()


def test_the_server_refuses_a_malformed_request_and_goes_on():
    server = ForkServerHandle(os.environ)
    try:
        with pytest.raises(ForkServerError, match="refused"):
            server.fork([1, 2])  # not strings
        pid = server.fork(["--master", NO_MASTER])
        assert psutil.Process(pid).ppid() == server.proc.pid
    finally:
        server.stop()
    assert server.proc.returncode == 0
    wait_gone([pid], timeout=1.0)
