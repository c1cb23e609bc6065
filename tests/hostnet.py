"""Hosts as Linux network namespaces, for tests across a real network (issue 41).

A ``HostNet`` is a "switch" namespace holding a bridge (``br0``) and, per host, a namespace
with ``lo`` up and one veth (``eth0``) whose peer (``pN`` in the switch) is a port of that
bridge. Hosts get addresses of a private /24, ``10.213.<run>.<N>``, that exists only inside
these namespaces: every link is created inside the switch namespace with its peer moved
straight into a host's, and nothing (no link, address or route) is added to the root
namespace, so the machine's own network never sees the test's.

* ``Host.popen`` / ``Host.run`` start a program inside a host (``ip netns exec``), each in its
  own process group, tracked so that ``close`` can kill it.
* ``cut`` / ``restore`` set a host's bridge port down / up: the cable pulled at the switch.
  The host keeps its address and routes and its packets vanish (no error reaches its
  sockets), as a real partition behaves; ``restore`` also takes back ``slow``.
* ``slow`` delays (and rate-limits) a host's link with ``tc netem``, where the kernel has it.
* ``capture`` records every frame through a host's bridge port (an ``AF_PACKET`` socket
  run by this file as a script: no tcpdump needed).
* ``close`` SIGKILLs every process group started and any process left inside the
  namespaces, then deletes the namespaces (their links go with them); it is idempotent,
  registered with ``atexit``, and run when construction fails half-way. A run that died
  without it (SIGKILL) leaves namespaces named for its pid: the next ``HostNet`` deletes
  those whose pid is gone, and only those.

Names are ``rlhn<pid hex>.<2 random hex><host index, or s for the switch>`` (at most 15
characters, IFNAMSIZ), so parallel runs (xdist workers, other checkouts) never collide.
Needs root and iproute2's ``ip``: ``netns_unavailable()`` says why not, and tests skip with it.
"""
from __future__ import annotations

import atexit
import functools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

PREFIX = "rlhn"
NAME = re.compile(rf"^{PREFIX}([0-9a-f]{{1,6}})\.[0-9a-f]{{2}}(s|[0-9]{{1,2}})$")
MAX_HOSTS = 99  # the index takes at most two characters of a 15-character name
NETEM_MISSING = "Specified qdisc kind is unknown"  # tc's words when the kernel has no sch_netem
ETH_P_ALL = 0x0003


class HostNetError(RuntimeError):
    """An ``ip`` or ``tc`` command failed: its command line and what it printed."""


def _cmd(argv: Sequence[str], stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=30, check=False)


def _checked(argv: Sequence[str], stdin: Optional[str] = None) -> None:
    done = _cmd(argv, stdin)
    if done.returncode != 0:
        raise HostNetError(f"{' '.join(argv)}: {(done.stderr or done.stdout).strip()}")


def namespaces() -> list[str]:
    """Every named network namespace (``ip netns list`` prints ``NAME (id: N)`` or ``NAME``)."""
    out = _cmd(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(ns: str) -> list[int]:
    return [int(p) for p in _cmd(["ip", "netns", "pids", ns]).stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_namespace(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process inside ``ns`` (ours by construction), then delete it."""
    deadline = time.monotonic() + timeout
    while (pids := _pids_in(ns)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    _cmd(["ip", "netns", "del", ns])  # a name already gone (a parallel sweep) is no error


def sweep_stale() -> list[str]:
    """Delete the namespaces of harness runs whose process is gone (killed before ``close``);
    what was deleted. Namespaces of live runs and of anyone else are never touched."""
    swept = []
    for ns in namespaces():
        m = NAME.match(ns)
        if m and not _alive(int(m.group(1), 16)):
            _kill_namespace(ns)
            swept.append(ns)
    return swept


@functools.lru_cache(maxsize=1)
def netns_unavailable() -> Optional[str]:
    """``None`` where a ``HostNet`` can be made here, else why not (for ``pytest.skip``)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "making network namespaces needs root (tests/hostnet.py)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (tests/hostnet.py needs it for network namespaces)"
    try:
        HostNet(1).close()
    except (HostNetError, OSError, subprocess.SubprocessError) as e:
        return f"cannot make a network namespace with a bridge and a veth here: {e}"
    return None


class Host:
    """One host: a network namespace with one address on the HostNet's switch."""

    def __init__(self, net: "HostNet", name: str, index: int, ns: str, addr: str) -> None:
        self.name, self.index, self.ns, self.addr = name, index, ns, addr
        self._net = net

    def __repr__(self) -> str:
        return f"Host({self.name!r}, ns={self.ns!r}, addr={self.addr!r})"

    def argv(self, argv: Sequence[Union[str, os.PathLike]]) -> list[str]:
        """``argv`` as run inside this host."""
        return ["ip", "netns", "exec", self.ns, *map(os.fspath, argv)]

    def popen(self, argv: Sequence[Union[str, os.PathLike]], env: Optional[dict[str, str]] = None,
              **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside this host, in a process group of its own (``ip netns exec``
        execs it, so the Popen's pid is the program's), killed by ``HostNet.close``."""
        return self._net._start(self.argv(argv), env=env, **kw)

    def run(self, argv: Sequence[Union[str, os.PathLike]], timeout: float = 60.0, check: bool = False,
            capture_output: bool = False, input: Optional[Union[str, bytes]] = None,
            **kw: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host to its end, as ``subprocess.run`` would; past
        ``timeout`` its whole process group is killed and ``TimeoutExpired`` raised."""
        if capture_output:
            kw.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if input is not None:
            kw["stdin"] = subprocess.PIPE
        proc = self.popen(argv, **kw)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            # Not communicate() again: a process that left the group may hold the pipes open.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class HostNet:
    """``hosts`` hosts (a count, named ``h1``..``hN``, or the names) on one switch.

    A context manager; ``close`` (also at exit) leaves nothing behind."""

    def __init__(self, hosts: Union[int, Sequence[str]]) -> None:
        names = [f"h{i}" for i in range(1, hosts + 1)] if isinstance(hosts, int) else list(hosts)
        if not 1 <= len(names) <= MAX_HOSTS or len(set(names)) != len(names):
            raise ValueError(f"1 to {MAX_HOSTS} distinct host names, not {names!r}")
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces created (deleted by close), the switch first
        self._closed = False
        atexit.register(self.close)
        try:
            sweep_stale()
            self.switch, run = self._names()
            self.hosts: dict[str, Host] = {
                name: Host(self, name, i, f"{PREFIX}{os.getpid():x}.{run:02x}{i}", f"10.213.{run}.{i}")
                for i, name in enumerate(names, start=1)}
            self._build()
        except BaseException:
            self.close()
            raise

    def _names(self) -> tuple[str, int]:
        """A switch namespace name and a run number no namespace uses yet."""
        taken = set(namespaces())
        for _ in range(64):
            run = random.randrange(256)
            switch = f"{PREFIX}{os.getpid():x}.{run:02x}s"
            if not any(ns.startswith(switch[:-1]) for ns in taken):
                return switch, run
        raise HostNetError("no free namespace name for this process (64 tries)")

    def _build(self) -> None:
        hosts = list(self.hosts.values())
        for ns in [self.switch] + [h.ns for h in hosts]:
            _checked(["ip", "netns", "add", ns])
            self._made.append(ns)
        switch = ["link add br0 type bridge", "link set br0 up"]
        for h in hosts:
            # Made in the switch with its peer moved straight into the host: no link ever
            # exists in the root namespace.
            switch += [f"link add {self._port(h)} type veth peer name eth0 netns {h.ns}",
                       f"link set {self._port(h)} master br0", f"link set {self._port(h)} up"]
        _checked(["ip", "-n", self.switch, "-batch", "-"], "\n".join(switch) + "\n")
        for h in hosts:
            _checked(["ip", "-n", h.ns, "-batch", "-"],
                     f"link set lo up\naddr add {h.addr}/24 dev eth0\nlink set eth0 up\n")

    @staticmethod
    def _port(host: Host) -> str:
        return f"p{host.index}"

    def __enter__(self) -> "HostNet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def cut(self, name: str) -> None:
        """Take ``name``'s bridge port down: nothing reaches it or leaves it until ``restore``."""
        _checked(["ip", "-n", self.switch, "link", "set", self._port(self.hosts[name]), "down"])

    def restore(self, name: str) -> None:
        """``name``'s link up again, at full speed (undoes ``cut`` and ``slow``)."""
        host = self.hosts[name]
        for ns, dev in self._link_ends(host):
            _cmd(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])  # none there (not slowed) is fine
        _checked(["ip", "-n", self.switch, "link", "set", self._port(host), "up"])

    def slow(self, name: str, delay_ms: int, rate: Optional[str] = None) -> bool:
        """Delay every frame to and from ``name`` by ``delay_ms`` each way (and cap each
        direction at ``rate``, tc's units: ``100mbit``); False, changing nothing, where the
        kernel has no netem."""
        ends = self._link_ends(self.hosts[name])
        for i, (ns, dev) in enumerate(ends):
            argv = ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "netem", "delay", f"{delay_ms}ms",
                    *(["rate", rate] if rate else [])]
            done = _cmd(argv)
            if done.returncode != 0:
                if NETEM_MISSING in done.stderr and i == 0:
                    return False
                raise HostNetError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return True

    def capture(self, name: str, out: Path, timeout: float = 30.0) -> subprocess.Popen:
        """Record every frame through ``name``'s bridge port, both ways, into ``out`` (the raw
        frames, one after another) until the returned process is stopped or ``close``.
        Returns once the capture is listening."""
        argv = ["ip", "netns", "exec", self.switch, sys.executable, os.path.abspath(__file__), "capture",
                self._port(self.hosts[name]), os.fspath(out)]
        proc = self._start(argv, stdout=subprocess.PIPE, text=True)
        ready = proc.stdout.readline()  # written once the socket is bound
        if ready.strip() != "capturing":
            raise HostNetError(f"the capture on {name}'s port did not start: {ready!r} (exit {proc.poll()})")
        return proc

    def _link_ends(self, host: Host) -> list[tuple[str, str]]:
        return [(host.ns, "eth0"), (self.switch, self._port(host))]

    def _start(self, argv: list[str], env: Optional[dict[str, str]] = None, **kw: Any) -> subprocess.Popen:
        with self._lock:
            if self._closed:
                raise HostNetError("this HostNet is closed")
            proc = subprocess.Popen(argv, env=env, start_new_session=True, **kw)
            self._procs.append(proc)
            return proc

    def close(self) -> None:
        """Kill every process started here (each process group, then anything left inside
        the namespaces) and delete every namespace made, with their links. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        try:
            for proc in self._procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for proc in self._procs:
                proc.wait(timeout=30)
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
        finally:
            for ns in reversed(self._made):
                _kill_namespace(ns)
        left = set(self._made) & set(namespaces())
        if left:
            raise HostNetError(f"namespaces left behind: {sorted(left)}")


def _capture(iface: str, out: str) -> None:
    """``python hostnet.py capture IFACE OUT``: every frame seen on IFACE appended to OUT,
    until SIGTERM or SIGKILL (each frame is written as it comes, so a kill loses none)."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
    sock.bind((iface, 0))
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    print("capturing", flush=True)
    while True:
        os.write(fd, sock.recv(1 << 17))


if __name__ == "__main__":
    if sys.argv[1:2] == ["capture"] and len(sys.argv) == 4:
        _capture(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python tests/hostnet.py capture IFACE OUT")
