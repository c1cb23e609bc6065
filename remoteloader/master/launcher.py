"""How workers come and go: a small interface, and its local and Ray implementations.

A launcher only starts worker processes (by their command, never by importing worker
code) and notices when they end; workers then fetch the spec and register with the
master like any other worker. Scale-down never
goes through the launcher: the master drains a worker (``MasterService.drain``), the
worker leaves by itself once clients consumed what it holds, and ``reap`` notices.

Launchers block (a Ray call waits on Ray's control store, a local start forks a
process), so the master's loop never calls one: ``LauncherThread`` owns the launcher on
a thread of its own and gives the loop a launcher whose calls return at once.

To add an engine (e.g. a Kubernetes Deployment: ``start`` raises the replica count
and ``reap`` counts pods that terminated), implement the four methods of ``Launcher``
(and ``pending`` if its workers can wait for room) and register it in ``make_launcher``.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence

from ..core.redact import ENV_ALLOW_TABLE
from ..protocol.auth import is_loopback
from .forkserver import ForkServerHandle

log = logging.getLogger(__name__)
RAY_NAMESPACE = "remoteloader"
ENV_AUTH = "REMOTELOADER_AUTH"  # protocol.auth.ENV_AUTH: the key directory, never keys, on no command line


def _worker_env(auth_dir: Optional[str]) -> dict[str, str]:
    """The variables a launched worker needs beyond the master's own environment."""
    return {ENV_AUTH: os.path.abspath(auth_dir)} if auth_dir else {}


def _worker_args(buffer_bytes: Optional[int], worker_args: Sequence[str],
                 max_message_bytes: Optional[int] = None) -> list[str]:
    """The worker's arguments: ``--buffer-bytes`` and ``--max-message-bytes`` first, so an
    explicit one in ``worker_args`` wins."""
    return [*(["--buffer-bytes", str(int(buffer_bytes))] if buffer_bytes is not None else []),
            *(["--max-message-bytes", str(int(max_message_bytes))] if max_message_bytes is not None else []),
            *worker_args]


class Launcher(Protocol):
    """Four methods; a fifth, ``pending() -> int``, is optional: of ``running()``, the
    workers launched but not started yet (waiting for room on the cluster).
    ``LauncherThread`` counts 0 for a launcher without it."""

    def start(self, n: int) -> None:
        """Launch ``n`` more workers pointed at the master."""

    def running(self) -> int:
        """Workers launched and not known to have ended: those still starting, or waiting for
        room on the cluster (``pending``), included. The autoscaler's pending workers
        (``running()`` less reporting and draining workers) therefore include both."""

    def reap(self) -> int:
        """Forget workers that ended; returns how many ended without being asked to."""

    def stop_all(self) -> None:
        """Master shutdown: end every worker now (they are stateless: nothing to drain)."""


@dataclass(frozen=True)
class LauncherCounts:
    """What the launcher thread last posted for the loop (one immutable value, swapped whole)."""

    running: int       # the launcher's running() after its last command or reap
    starts_done: int   # workers asked for with start() that the thread has handled
    failed: int        # workers that ended without being asked to, since the thread began
    pending: int = 0   # the launcher's pending() (workers launched, not started: no room yet)


class LauncherThread:
    """A ``Launcher`` for the master's loop: every call returns at once.

    One thread owns the wrapped launcher (nothing else touches it once it is handed
    over): it runs the ``start`` commands the loop queues, reaps every
    ``reap_interval_s``, and after each posts a ``LauncherCounts`` that the loop reads.
    ``running`` adds the starts still queued, so the autoscaler never asks twice for
    the same workers while the thread is busy; so does ``pending``. ``stop_all`` (master
    shutdown) drops the queued starts, has the thread stop every worker and waits for
    it, bounded.
    """

    def __init__(self, launcher: Launcher, reap_interval_s: float = 1.0) -> None:
        self.reap_interval_s = reap_interval_s
        self._launcher = launcher
        self._pending = getattr(launcher, "pending", None)  # optional: a launcher whose workers never wait
        self._counts = LauncherCounts(launcher.running(), 0, 0)  # read before the thread owns it
        self._commands: queue.SimpleQueue[Optional[int]] = queue.SimpleQueue()  # n to start; None: stop all
        self._stopping = threading.Event()
        self._starts_asked = 0  # loop side only
        self._failed_seen = 0   # loop side only
        # One thread for the master's life, not one per call: Linux sends a worker's parent-death
        # signal when the *thread* that started it ends, and local workers ask for that signal.
        self._thread = threading.Thread(target=self._run, name="launcher", daemon=True)
        self._thread.start()

    # -- on the master's loop: never blocks ---------------------------------------------------
    def start(self, n: int) -> None:
        if n > 0:
            self._starts_asked += n
            self._commands.put(n)

    def running(self) -> int:
        """Workers launched and not known to have ended, plus the starts still queued; those
        not started yet (``pending``) included."""
        counts = self._counts
        return counts.running + self._starts_asked - counts.starts_done

    def pending(self) -> int:
        """Of ``running()``, the workers not started yet: starts still queued on the thread,
        and workers the launcher launched that wait for room (Ray actors its scheduler has
        not placed: Ray's autoscaler was asked for them). They register with the master
        only once started, so they are never among the master's workers."""
        counts = self._counts
        return counts.pending + self._starts_asked - counts.starts_done

    def reap(self) -> int:
        """Workers that failed since the previous call (the thread reaps on its own)."""
        failed = self._counts.failed - self._failed_seen
        self._failed_seen += failed
        return failed

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """Master shutdown: have the thread stop every worker; wait at most ``timeout_s``
        (a launcher stuck in a call is given up on: local workers die with the master by
        their parent-death signal, and Ray ends actors of a driver that exits)."""
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the launcher did not stop its workers within %.0f s; exiting without waiting", timeout_s)

    # -- on the launcher thread ------------------------------------------------------------------
    def _run(self) -> None:
        starts_done = failed = 0
        while True:
            try:
                command = self._commands.get(timeout=self.reap_interval_s)
            except queue.Empty:
                command = 0
            if command is None:
                self._call(self._launcher.stop_all)
                return
            if command and not self._stopping.is_set():
                self._call(self._launcher.start, command)
            starts_done += command
            failed += self._call(self._launcher.reap) or 0
            pending = (self._call(self._pending) or 0) if self._pending is not None else 0
            self._counts = LauncherCounts(self._launcher.running(), starts_done, failed, pending)

    @staticmethod
    def _call(method, *args):
        """One launcher call; a failure is logged and the thread goes on (a start that
        failed shows as fewer workers running, which the autoscaler or pool retries)."""
        try:
            return method(*args)
        except Exception:
            log.exception("launcher %s failed", method.__name__)
            return None


class LocalLauncher:
    """Worker processes on this machine, tied to the master's lifetime.

    Workers are forked by a worker fork server (``master/forkserver.py``), started with
    the first worker and kept for the master's life: a forked worker skips the second or
    so of imports and numba set-up a fresh process pays. Each worker runs
    ``remoteloader-worker --master ADDR --die-with-parent ...`` as if started by that
    command; ``ps`` shows it with the server's command line and the name ``rl-worker``.
    A server that dies takes its workers with it (they drain on their parent-death
    signal): they count as failed, and the next start brings up another server.

    A master on ``ipc://DIR/NAME`` (one host) has each worker bind its data socket in the
    same private directory, ``ipc://DIR/worker-<random>``; the launcher removes the socket
    file of a worker it saw end (one killed leaves its file behind)."""

    def __init__(self, master_addr: str, worker_args: Sequence[str] = (), auth_dir: Optional[str] = None,
                 worker_env: Mapping[str, str] = {}, buffer_bytes: Optional[int] = None,
                 max_message_bytes: Optional[int] = None) -> None:
        self.master_addr = master_addr
        self.worker_args = _worker_args(buffer_bytes, worker_args, max_message_bytes)
        self.pids: set[int] = set()
        self._failed = 0  # workers seen to fail since the last reap
        self._server: Optional[ForkServerHandle] = None
        self._ipc_dir = os.path.dirname(master_addr[len("ipc://"):]) if master_addr.startswith("ipc://") else None
        self._sockets: dict[int, str] = {}  # pid -> the ipc socket file it binds
        # The key directory's path and the allowlist (``worker_env``: table paths may hold
        # credentials) go in the environment, never on a command line. Both are set from scratch,
        # so a stray $REMOTELOADER_AUTH or allowlist in the master's environment cannot split the cluster.
        handed_on = (ENV_AUTH, ENV_ALLOW_TABLE)
        self.env = {k: v for k, v in os.environ.items() if k not in handed_on}
        self.env.update(_worker_env(auth_dir), **worker_env)

    def worker_argv(self, bind: Sequence[str] = ()) -> list[str]:
        """``remoteloader-worker``'s arguments for one local worker."""
        return ["--master", self.master_addr, "--die-with-parent", *bind, *self.worker_args]

    def start(self, n: int) -> None:
        for _ in range(n):
            bind: list[str] = []
            if self._ipc_dir is not None:
                path = os.path.join(self._ipc_dir, "worker-" + secrets.token_hex(8))
                bind = ["--bind", "ipc://" + path]
            if self._server is None:
                self._server = ForkServerHandle(self.env)
            pid = self._server.fork(self.worker_argv(bind))
            self._apply_exits(read=False)  # those reported before it: its pid may be an ended worker's, reused
            self.pids.add(pid)
            if bind:
                self._sockets[pid] = path

    def _forget(self, pid: int) -> None:
        self.pids.discard(pid)
        path = self._sockets.pop(pid, None)
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # it closed its socket itself

    def running(self) -> int:
        return len(self.pids)

    def pending(self) -> int:
        return 0  # a local worker runs as soon as it is forked

    def _apply_exits(self, read: bool = True) -> None:
        """Forget the workers the server reported ended; count those that failed. ``read``:
        read what the server sent since, too (not between a fork and recording its pid)."""
        for pid, code in self._server.exits(read) if self._server is not None else ():
            if pid not in self.pids:
                continue
            self._forget(pid)
            if code != 0:
                log.warning("local worker pid %d exited with code %s", pid, code)
                self._failed += 1

    def reap(self) -> int:
        self._apply_exits()
        failed, self._failed = self._failed, 0
        if self._server is not None and self._server.gone:
            log.warning("the worker fork server ended (code %s); its %d workers end with it",
                        self._server.proc.poll(), len(self.pids))
            failed += self._drop_server()
        return failed

    def stop_all(self) -> None:
        if self._server is not None:
            self._drop_server()

    def _drop_server(self) -> int:
        """Stop the server, which ends its workers, and forget them; how many there were."""
        self._server.stop()
        self._server = None
        ended = len(self.pids)
        for pid in list(self.pids):
            self._forget(pid)
        return ended


class WorkerProcessActor:
    """The body of a Ray actor: one ``remoteloader-worker`` process on the actor's node.

    The worker runs as its own process, started by its command (as an operator would),
    rather than inside the actor: the master never imports worker code, and the worker keeps
    its signal handling (SIGTERM drains) and its own main thread. The process dies with
    the actor (Linux parent-death signal), so ``ray.kill`` or a lost node ends it.
    """

    def __init__(self, master_addr: str, worker_args: list[str], worker_env: Mapping[str, str] = {}) -> None:
        import ray

        self.master_addr = master_addr
        # ``worker_env`` (the allowlist) reaches the worker in its environment, not on its command
        # line nor in the actor's runtime_env (which Ray's dashboard shows).
        self.proc = subprocess.Popen([sys.executable, "-m", "remoteloader.worker", "--master", master_addr,
                                      "--bind-host", ray.util.get_node_ip_address(), "--die-with-parent",
                                      *worker_args], env=dict(os.environ, **worker_env))

    def wait(self) -> int:
        """Block until the worker exits; its exit code (0: drained or stopped). A master
        that adopts a running actor calls this again: the actor runs calls concurrently."""
        return self.proc.wait()

    def master(self) -> str:
        """The master address this worker serves (a master adopts only its own)."""
        return self.master_addr


# Unless this is 0, Ray swaps a loopback address for the machine's own: a head started with
# ``--node-ip-address 127.0.0.1`` gets the machine's address and listens on every interface,
# and a driver given ``--ray-address 127.0.0.1:PORT`` connects to the machine's address instead
# (and waits there for a control store that is not there). The setting that keeps a
# one-machine Ray on 127.0.0.1.
RAY_LOOPBACK_SETTING = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
RAY_ONE_MACHINE = f"{RAY_LOOPBACK_SETTING}=0 ray start --head --node-ip-address 127.0.0.1"
_RAY_HEAD_RESOURCE = "node:__internal_head__"  # in the head node's resources (ray.nodes())


def connect_ray(address: str, auth_token_path: Optional[str] = None, master_addr: Optional[str] = None):
    """The ``ray`` module, connected to the cluster at ``address`` in remoteloader's namespace.

    * A loopback ``address`` is kept as given: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set
      for this process before Ray is imported (ValueError if Ray was imported without it).
    * A connection Ray refuses for want of the right token raises ConnectionError saying
      so, and where this process's token came from (a file or a variable's name, never the
      token).
    * With ``master_addr`` (the master's own address) on loopback, a cluster whose head or
      any node is not on loopback is refused (ValueError naming the setting): its workers
      would bind that address, and nodes elsewhere could not reach the master.
    """
    if auth_token_path is not None:
        _use_ray_token_file(auth_token_path)
    loopback = is_loopback(_ray_host(address))
    if loopback and "ray" not in sys.modules:
        os.environ.setdefault(RAY_LOOPBACK_SETTING, "0")  # read once, when ray is imported
    import ray

    connected_here = False
    if not ray.is_initialized():
        constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
        if loopback and getattr(constants, "ENABLE_RAY_CLUSTER", False):
            raise ValueError(f"--ray-address {address} is on loopback, but this process's Ray would swap it for "
                             f"this machine's address and wait there: set {RAY_LOOPBACK_SETTING}=0 in the "
                             "environment (Ray reads it when first imported)")
        try:
            ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
        except Exception as e:
            if _token_refused(e):
                raise ConnectionError(f"Ray at {address} refused this master's token (InvalidAuthToken): "
                                      f"{_ray_token_source(auth_token_path)}. Give the master the token the Ray "
                                      "cluster was started with: --ray-auth-token-file FILE, or RAY_AUTH_MODE=token "
                                      "and RAY_AUTH_TOKEN_PATH=FILE in its environment") from None
            raise
        connected_here = True
    if master_addr is not None and is_loopback(master_addr):
        try:
            _check_loopback_cluster(ray, address, master_addr)
        except ValueError:
            if connected_here:
                ray.shutdown()
            raise
    return ray


def _ray_host(address: str) -> str:
    """The host of a Ray address (``HOST:PORT``, ``[V6]:PORT``, ``ray://HOST:PORT``; ``auto``)."""
    host = address.split("://", 1)[-1]
    if host.count(":") == 1 or host.startswith("["):
        host = host.rsplit(":", 1)[0]
    return host.strip("[]")


def _token_refused(error: BaseException) -> bool:
    """Did Ray fail for its token (missing or wrong)? Ray raises ``AuthenticationError``, or
    a ConnectionError ("Failed to connect to Ray cluster") whose cause's text names it."""
    seen: set[int] = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in text or "AuthenticationError" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def _ray_token_source(auth_token_path: Optional[str]) -> str:
    """Where this process's Ray driver took its token from, as Ray looks (RAY_AUTH_TOKEN,
    then RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token), by name only: never the token."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if (mode or "").lower() != "token":
        said = "unset" if mode is None else repr(mode)
        return (f"it sent no token, as RAY_AUTH_MODE is {said}, not 'token' (a master given --ray-address "
                "turns Ray's token mode on only when told)")
    if os.environ.get("RAY_AUTH_TOKEN"):
        unread = f"; Ray reads it before any file, so {auth_token_path} was not used" if auth_token_path else ""
        return f"it sent the token in the environment variable RAY_AUTH_TOKEN{unread}"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        named = "--ray-auth-token-file" if auth_token_path is not None else "RAY_AUTH_TOKEN_PATH"
        missing = "" if os.path.isfile(path) else ", which does not exist"
        return f"it sent the token in {path} ({named}{missing})"
    default = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if os.path.isfile(default):
        return (f"it sent the token in {default}, Ray's default file (neither RAY_AUTH_TOKEN nor "
                "RAY_AUTH_TOKEN_PATH is set)")
    return (f"it had no token: RAY_AUTH_MODE is 'token', but neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH is set "
            f"and {default} does not exist")


def _check_loopback_cluster(ray, address: str, master_addr: str) -> None:
    """A master on loopback is reachable from this machine only: every Ray node its workers
    may run on must be this machine, on loopback. The head is the node holding Ray's head
    resource (else the one whose address the control store has)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    heads = [n.get("NodeManagerAddress") or "?" for n in alive if _RAY_HEAD_RESOURCE in (n.get("Resources") or {})]
    if heads:
        head = heads[0]
    else:
        try:
            gcs = ray.get_runtime_context().gcs_address or ""
        except Exception:  # an older Ray: the nodes still tell
            gcs = ""
        head = gcs.rsplit(":", 1)[0].strip("[]") or None
    outside = sorted({n.get("NodeManagerAddress") or "?" for n in alive} - {head})
    outside = [a for a in outside if not is_loopback(a)]
    if head is not None and not is_loopback(head):
        where = f"the Ray head at {address} has node address {head}"
    elif outside:
        where = f"the Ray cluster at {address} has nodes at {', '.join(outside)}"
    else:
        return
    raise ValueError(
        f"--launcher ray: {where}, not on loopback, while this master listens on loopback ({master_addr}): "
        "its workers would bind that address and nodes elsewhere could not reach this master. For Ray on one "
        f"machine, start the head with {RAY_ONE_MACHINE} ({RAY_LOOPBACK_SETTING}=0 keeps it on 127.0.0.1: "
        "without it Ray swaps a loopback --node-ip-address for this machine's address and listens on every "
        "interface); across machines, bind the master to an address the nodes reach (--bind tcp://HOST:PORT "
        "with --auth DIR)")


def request_ray_resources(bundles: list[dict[str, float]]) -> None:
    """Ray's ``request_resources(bundles=...)``: the cluster should fit all these bundles
    at once (those in use count), replacing any earlier request; ``[]`` clears it."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


class _RayWorker:
    """One launched actor: its handle, the ref of its ``wait()`` (ready when the worker
    exits), and until the actor runs, the ref of a first call that answers only then."""

    __slots__ = ("actor", "done", "starting")

    def __init__(self, actor, done, starting=None) -> None:
        self.actor, self.done, self.starting = actor, done, starting


class RayLauncher:
    """Workers as Ray actors (one CPU each by default) on an existing Ray cluster.

    Ray places the actors. Each actor runs an ordinary worker process bound to its
    node's IP address. The actors belong to the master's Ray job, so Ray ends them if
    the master dies.

    Past the cluster's free resources, the launcher asks Ray's cluster autoscaler for
    room: ``ray.autoscaler.sdk.request_resources`` with one bundle per wanted worker
    (the actor's own resources), the whole fleet each time (a request replaces the one
    before: it is cluster-wide, last caller wins). It is sent whenever the number of
    workers the launcher holds changes (``start``, a worker that ended seen by ``reap``)
    and only then, and cleared by ``stop_all``; a failure is logged once and retried at
    most every ``REQUEST_RETRY_S`` while the number still differs. Actors created but
    not running yet (no room: Ray's autoscaler was asked for it) count in ``running``
    and in ``pending``.

    Ray clusters authenticate by token (on by default since Ray 2.59): the master
    connects with ``auth_token_path`` if given, else with what the environment says
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``).

    With ``detached_prefix`` the actors are detached and named ``PREFIX-worker-N``: they
    outlive this master, and a master started again with the same prefix (a restart, see
    ``ray_actor``) adopts those still running instead of starting a second pool.

    ``buffer_bytes``: passed to each worker as ``--buffer-bytes`` (before ``worker_args``), and
    ``max_message_bytes`` as ``--max-message-bytes``.
    """

    REQUEST_RETRY_S = 30.0

    def __init__(self, master_addr: str, address: str, num_cpus: float = 1.0,
                 worker_args: Sequence[str] = (), auth_token_path: Optional[str] = None,
                 auth_dir: Optional[str] = None, detached_prefix: Optional[str] = None,
                 worker_env: Mapping[str, str] = {}, buffer_bytes: Optional[int] = None,
                 max_message_bytes: Optional[int] = None) -> None:
        already = sys.modules.get("ray")  # not imported here: the token must be set first
        self._owns_ray = already is None or not already.is_initialized()
        self._ray = ray = connect_ray(address, auth_token_path, master_addr)
        # remoteloader's own CURVE keys (not Ray's token): the key directory's path goes to each actor
        # in its runtime environment, so the directory must be readable at the same path on every
        # node (shared storage, or copied there with mode 0700/0600). Its contents never travel
        # through Ray (its GCS and dashboard show runtime environments).
        # Concurrent calls: wait() of every master that adopted the actor (a dead master's
        # call runs on until the worker exits), and master().
        options: dict = {"num_cpus": num_cpus, "max_concurrency": 64}
        if auth_dir:
            options["runtime_env"] = {"env_vars": _worker_env(auth_dir)}
        self._actor_cls = ray.remote(**options)(WorkerProcessActor)
        # What one worker needs of a node: the bundle asked of Ray's autoscaler per worker.
        self.bundle: dict[str, float] = {"CPU": float(num_cpus)} if num_cpus else {}
        self.requested = 0  # workers last asked of Ray's autoscaler (0: nothing asked, or cleared)
        self._request_failed = False  # logged once
        self._retry_at = 0.0
        self.master_addr = master_addr
        self.worker_args = _worker_args(buffer_bytes, worker_args, max_message_bytes)
        self.worker_env = dict(worker_env)
        self.detached_prefix = detached_prefix
        self.actors: list[_RayWorker] = []
        if detached_prefix:
            self._adopt()

    def _worker_names(self) -> list[str]:
        prefix = f"{self.detached_prefix}-worker-"
        return sorted(a["name"] for a in self._ray.util.list_named_actors(all_namespaces=True)
                      if a.get("namespace") == RAY_NAMESPACE and a["name"].startswith(prefix))

    def _adopt(self) -> None:
        for name in self._worker_names():
            try:
                actor = self._ray.get_actor(name)
                serves = self._ray.get(actor.master.remote(), timeout=30)
            except Exception as e:  # ended meanwhile (Ray raises its own error types)
                log.warning("could not adopt ray worker %s: %s", name, e)
                continue
            if serves != self.master_addr:  # started for a master elsewhere: it would never register here
                log.warning("ray worker %s serves %s, not %s: stopped", name, serves, self.master_addr)
                self._ray.kill(actor)
                continue
            self.actors.append(_RayWorker(actor, actor.wait.remote()))  # it answered: running
        if self.actors:
            log.warning("adopted %d running ray workers of %s", len(self.actors), self.detached_prefix)
        # Ray's autoscaler is asked for the adopted workers at the first start or reap, on the
        # launcher's thread (the request of the master before this one is still in force meanwhile).

    def start(self, n: int) -> None:
        taken = set(self._worker_names()) if self.detached_prefix else set()
        try:
            for _ in range(n):
                cls = self._actor_cls
                if self.detached_prefix:
                    name = next(f"{self.detached_prefix}-worker-{i}" for i in range(len(taken) + 1)
                                if f"{self.detached_prefix}-worker-{i}" not in taken)
                    taken.add(name)
                    cls = cls.options(name=name, lifetime="detached")
                actor = cls.remote(self.master_addr, self.worker_args, self.worker_env)
                # Actor calls wait until the actor runs: master() answering means it started.
                self.actors.append(_RayWorker(actor, actor.wait.remote(), actor.master.remote()))
        finally:
            self._request_resources()

    def running(self) -> int:
        """Actors launched and not seen to end, those Ray has not placed yet included."""
        return len(self.actors)

    def pending(self) -> int:
        """Actors launched that have not started: Ray has not placed them yet (no room on
        the cluster; its autoscaler was asked for it), or their worker is being started."""
        starting = [w for w in self.actors if w.starting is not None]
        if starting:
            # fetch_local=False: only whether the call answered (or failed: the actor died, which
            # reap counts), never its value.
            ready, _ = self._ray.wait([w.starting for w in starting], num_returns=len(starting), timeout=0,
                                      fetch_local=False)
            ready = set(ready)
            for w in starting:
                if w.starting in ready:
                    w.starting = None
        return sum(1 for w in self.actors if w.starting is not None)

    def reap(self) -> int:
        failed = 0
        if self.actors:
            refs = [w.done for w in self.actors]
            done, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
            done = set(done)
            for w in [w for w in self.actors if w.done in done]:
                self.actors.remove(w)
                try:
                    code = self._ray.get(w.done)
                except Exception as e:  # the actor died (node lost, OOM, killed)
                    log.warning("ray worker ended: %s", e)
                    failed += 1
                else:
                    if code != 0:
                        log.warning("ray worker exited with code %s", code)
                        failed += 1
                self._ray.kill(w.actor)
        self._request_resources()
        return failed

    def stop_all(self) -> None:
        for w in self.actors:
            self._ray.kill(w.actor)
        self.actors.clear()
        self._request_resources(force=True)  # cleared: nothing of this fleet is wanted any more
        if self._owns_ray:
            self._ray.shutdown()

    def _request_resources(self, force: bool = False) -> None:
        """Ask Ray's autoscaler for room for every worker held, if that number changed since
        the last request that went through. An RPC: never on the master's loop."""
        wanted = len(self.actors) if self.bundle else 0
        if wanted == self.requested or (not force and time.monotonic() < self._retry_at):
            return
        try:
            request_ray_resources([dict(self.bundle) for _ in range(wanted)])
        except Exception as e:  # no autoscaler to ask, an old Ray, the control store away
            self._retry_at = time.monotonic() + self.REQUEST_RETRY_S
            if not self._request_failed:
                self._request_failed = True
                log.warning("could not ask Ray's autoscaler for room for %d workers (%s: %s); workers that do "
                            "not fit wait for room as pending (logged once)", wanted, type(e).__name__, e)
            else:
                log.debug("request_resources for %d workers failed again: %s", wanted, e)
            return
        log.info("asked Ray's autoscaler for room for %d workers (%s each)", wanted, self.bundle)
        self.requested = wanted
        self._retry_at = 0.0


def _use_ray_token_file(path: str) -> None:
    """Point this process's Ray driver at a token file.

    Ray reads its authentication settings once, when ``ray`` is first imported, so they
    must be in the environment before that.
    """
    if not os.path.isfile(path):
        raise ValueError(f"Ray token file {path!r} does not exist")
    wanted = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": path}
    if "ray" in sys.modules and any(os.environ.get(k) != v for k, v in wanted.items()):
        raise ValueError("ray was imported before the token file was set; set RAY_AUTH_MODE=token and "
                         "RAY_AUTH_TOKEN_PATH in the environment instead")
    os.environ.update(wanted)


def make_launcher(kind: str, master_addr: str, *, ray_address: Optional[str] = None,
                  ray_auth_token_path: Optional[str] = None, ray_detached_prefix: Optional[str] = None,
                  worker_args: Sequence[str] = (), buffer_batches: int = 16, auth_dir: Optional[str] = None,
                  insecure: bool = False, worker_env: Mapping[str, str] = {},
                  buffer_bytes: Optional[int] = None, max_message_bytes: Optional[int] = None) -> Launcher:
    """``worker_env``: variables for every worker (the allowlist), in its environment only;
    ``buffer_bytes``: each worker's ``--buffer-bytes``, ``max_message_bytes`` its
    ``--max-message-bytes`` (None: the worker's default)."""
    if kind == "local":
        return LocalLauncher(master_addr, ["--buffer-batches", str(buffer_batches), *worker_args], auth_dir=auth_dir,
                             worker_env=worker_env, buffer_bytes=buffer_bytes, max_message_bytes=max_message_bytes)
    if kind == "ray":
        if not ray_address:
            raise ValueError("--launcher ray needs --ray-address (e.g. 127.0.0.1:6379, or 'auto')")
        if master_addr.startswith("ipc://"):
            raise ValueError(f"--launcher ray with --bind {master_addr}: Ray places workers on other machines, "
                             "which cannot reach an ipc socket; bind tcp://HOST:PORT (with --auth)")
        # Ray workers bind their node's IP: without keys they start only if the master's operator said
        # --insecure too (a worker on a loopback node IP, as in single-machine tests, needs neither).
        insecure_args = ["--insecure"] if insecure and not auth_dir else []
        return RayLauncher(master_addr, ray_address,
                           worker_args=["--buffer-batches", str(buffer_batches), *insecure_args, *worker_args],
                           auth_token_path=ray_auth_token_path, auth_dir=auth_dir,
                           detached_prefix=ray_detached_prefix, worker_env=worker_env, buffer_bytes=buffer_bytes,
                           max_message_bytes=max_message_bytes)
    raise ValueError(f"unknown launcher {kind!r} (local, ray)")
