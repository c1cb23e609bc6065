"""An in-process test cluster, like tf.data's ``TestCluster``: the real ``MasterService``
behind its ROUTER loop on a thread, real ``Worker``s on threads, and ``RemoteDataLoader``s
pointed at it, all in the test's process on loopback.

It starts no process (no interpreter start-up, no import of torch per worker), so
tests of credit, push, release and the epoch loop run in the fast tier; what only real
processes show (signals, console scripts, a killed master) stays with the ``cluster``
fixture of conftest.py. ``stop`` stops and joins every thread it started.
"""
from __future__ import annotations

import threading
from typing import Any, Optional
from unittest import mock

import zmq

from remoteloader import RemoteDataLoader
from remoteloader.master.server import MasterServer
from remoteloader.master.service import MasterConfig, MasterService

from .test_worker_fakes import RunningWorker


class InProcessCluster:
    def __init__(self, workers: int = 1, config: Optional[MasterConfig] = None, **worker_args: Any) -> None:
        # A short heartbeat timeout: a stopped worker's splits go back within the test.
        self.service = MasterService(config or MasterConfig(heartbeat_timeout=2.0))
        self.server = MasterServer(self.service, "tcp://127.0.0.1:0")
        self.addr = self.server.addr
        self._master = threading.Thread(target=self.server.serve_forever, name="test-master", daemon=True)
        self._master.start()
        self.workers: list[RunningWorker] = []
        self.loaders: list[RemoteDataLoader] = []
        self._contexts: list[zmq.Context] = []
        for _ in range(workers):
            self.add_worker(**worker_args)

    def add_worker(self, **worker_args: Any) -> RunningWorker:
        """A ``Worker`` (its keyword arguments, e.g. ``client_timeout_s``) on its own threads."""
        # A ZeroMQ context of its own, as its own process would have: a worker names its
        # inproc endpoints once per context. Only constructors ask for Context.instance().
        ctx = zmq.Context()
        self._contexts.append(ctx)
        with mock.patch.object(zmq.Context, "instance", return_value=ctx):
            worker = RunningWorker(self.addr, **worker_args)
        self.workers.append(worker)
        return worker

    def loader(self, spec: dict, **kwargs: Any) -> RemoteDataLoader:
        """A ``RemoteDataLoader`` of this cluster, closed by ``stop`` if the test does not."""
        kwargs.setdefault("timeout", 60)
        loader = RemoteDataLoader(spec, master=self.addr, **kwargs)
        self.loaders.append(loader)
        return loader

    def stop(self) -> None:
        try:
            for loader in self.loaders:
                loader.close()
            for worker in self.workers:
                if worker.thread.is_alive():
                    worker.stop()
            for ctx in self._contexts:
                ctx.destroy(linger=0)
        finally:
            self.server.stop_event.set()
            self._master.join(10)
            self.service.close()  # a following job's re-listing thread
        assert not self._master.is_alive(), "the master's loop did not stop"
        failed = [w.error for w in self.workers if w.error is not None]
        assert not failed, f"a worker failed: {failed[0]!r}"
