"""ZeroMQ endpoint addresses, checked before ZeroMQ sees them.

Two kinds: ``tcp://HOST:PORT`` (between machines, or loopback), and ``ipc://PATH`` (a
Unix-domain socket, for a cluster on one host: see ``ipc_directory``).

A mistyped address (``localhost:5555``, ``tcp://host``, ``tcp://host:99999``) would
otherwise surface as a bare ``zmq.error.ZMQError: Invalid argument`` from deep inside a
socket call. ``validate_address`` turns it into one line that names the flag or the
argument at fault. The command lines use it as an ``argparse`` type (and share the help
formatter below); ``RpcClient`` calls it when it is made.
"""
from __future__ import annotations

import argparse
import errno
import os
import secrets
import socket
import stat
from typing import Callable, Optional

MAX_PORT = 65535
MAX_IPC_PATH = 107  # bytes: AF_UNIX's sun_path is 108, with its terminating NUL


class AddressError(ValueError):
    """An endpoint that is not ``tcp://HOST:PORT`` nor ``ipc://ABSOLUTE_PATH``."""


def is_ipc(addr: object) -> bool:
    return isinstance(addr, str) and addr.startswith("ipc://")


def ipc_path(addr: str) -> str:
    """The socket file's path of ``ipc://PATH``."""
    return addr[len("ipc://"):]


def ipc_directory(addr: str) -> str:
    """The directory holding the socket file of ``ipc://PATH``: the one-host cluster's
    private directory (mode 0700), whose permissions are what keeps other users out."""
    return os.path.dirname(ipc_path(addr))


def _check_ipc(path: str, fail: Callable[[str], "AddressError"]) -> None:
    if not path.startswith("/"):
        raise fail("an ipc path must be absolute, e.g. ipc:///tmp/rl-dir/master")
    if path.endswith("/") or os.path.dirname(path) in ("", "/"):
        raise fail("an ipc path must name a socket file inside a private directory")
    if os.path.normpath(path) != path:
        raise fail("an ipc path must be normalized (no '.', '..' or '//' components)")
    if "*" in path or any(c.isspace() or ord(c) < 32 for c in path):
        raise fail("an ipc path must not contain '*', spaces or control characters")
    size = len(path.encode("utf-8", "surrogateescape"))
    if size > MAX_IPC_PATH:
        raise fail(f"the path is {size} bytes, more than a Unix socket's {MAX_IPC_PATH}: use a shorter "
                   "directory (e.g. under /tmp or $XDG_RUNTIME_DIR)")


IPC_BASES = ("XDG_RUNTIME_DIR",)  # then /tmp: short paths, cleaned by the system
# Set by the embedded loader for the master it starts: the private directory it made for
# it, which that master then owns (removes when it exits) as if it had made it itself.
ENV_IPC_HANDOVER = "REMOTELOADER_IPC_HANDOVER"
IPC_NAME_ATTEMPTS = 16  # fresh names tried when each is found taken


def new_ipc_directory() -> str:
    """A fresh, unpredictable path for a one-host cluster's private directory (not made
    here: ``make_ipc_directory`` makes one). Under ``$XDG_RUNTIME_DIR`` when set (the
    user's own 0700 directory, emptied at logout), else ``/tmp``; either only if the worker
    sockets' paths fit a Unix socket."""
    name = "rl-" + secrets.token_hex(6)
    for base in [os.environ.get(v) for v in IPC_BASES] + ["/tmp"]:
        if base and os.path.isabs(base) and os.path.isdir(base) \
                and len(os.path.join(base, name, "worker-" + "0" * 16).encode()) <= MAX_IPC_PATH:
            return os.path.join(base, name)
    raise AddressError(f"no directory for a private ipc directory: $XDG_RUNTIME_DIR and /tmp are missing or too long")


def check_ipc_directory(directory: str) -> None:
    """Refuse (``AddressError``, one line naming the path) a directory that would let another
    local user reach the sockets in it: it must be a real directory (not a symlink) owned by
    this user, with no permission for group or others (0700), in a parent that nobody else
    can rename it out of (not writable by group or others unless sticky, as /tmp is)."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        raise AddressError(f"ipc directory {directory} does not exist") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise AddressError(f"ipc directory {directory} is not a directory (a symlink or a file): refusing it")
    if st.st_uid != os.geteuid():
        raise AddressError(f"ipc directory {directory} is owned by uid {st.st_uid}, not by this user "
                           f"(uid {os.geteuid()}): refusing it, as its owner could reach the sockets in it")
    if st.st_mode & 0o077:
        raise AddressError(f"ipc directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}, which lets group or "
                           f"others in: refusing it (chmod 700 {directory})")
    parent = os.path.dirname(directory) or "/"
    pst = os.stat(parent)
    if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
        raise AddressError(f"ipc directory {directory} lies in {parent}, which group or others may write without the sticky "
                           f"bit: they could swap the directory; refusing it")


def make_ipc_directory(attempts: int = IPC_NAME_ATTEMPTS) -> str:
    """Make a fresh private directory for a one-host cluster and return its path, before its
    name appears anywhere (a command line is every local user's to read): one atomic
    ``mkdir(0700)`` of a ``new_ipc_directory`` name, then ``check_ipc_directory``. A name
    that exists already, as anything (a directory another user made first, a symlink, a
    file), is never adopted nor touched: the next fresh name is tried, up to ``attempts``."""
    taken = []
    for _ in range(attempts):
        directory = new_ipc_directory()
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            taken.append(directory)
            continue
        except OSError as e:
            raise AddressError(f"cannot make ipc directory {directory}: {e.strerror}") from None
        try:
            check_ipc_directory(directory)  # ours and 0700 (a umask only removes bits), in a safe parent
        except AddressError:
            os.rmdir(directory)
            raise
        return directory
    raise AddressError(f"cannot make a private ipc directory: {attempts} fresh names were taken already "
                       f"({', '.join(taken[:3])}, ...): another user may be creating them")


def prepare_ipc_directory(directory: str) -> bool:
    """Make ``directory`` (0700) if it does not exist, then ``check_ipc_directory`` it.
    True when it was made here, or made for this process by the one that started it
    (``$REMOTELOADER_IPC_HANDOVER`` names it): its owner removes it."""
    handed = os.environ.get(ENV_IPC_HANDOVER) == directory
    if handed:
        os.environ.pop(ENV_IPC_HANDOVER)  # taken over once: not passed on to this process's children
    made = handed
    try:
        os.mkdir(directory, 0o700)  # atomic: an existing path (anyone's) is checked, never adopted blindly
        made = True
    except FileExistsError:
        pass
    except OSError as e:
        raise AddressError(f"cannot make ipc directory {directory}: {e.strerror}") from None
    check_ipc_directory(directory)
    return made


def check_ipc_free(addr: str) -> None:
    """ZeroMQ silently replaces an existing socket file at bind: refuse one that a live
    process still listens on ("in use", as a taken TCP port); a stale one is fine."""
    path = ipc_path(addr)
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return  # left by a process that died: bind replaces it
        raise AddressError(f"{path} exists and cannot be probed: {e.strerror}") from None
    finally:
        probe.close()
    raise AddressError(f"address in use: another process listens on {path}")


def restrict_ipc_socket(addr: str) -> None:
    """Socket file 0600 (defence in depth behind the 0700 directory: connecting needs
    write permission on it)."""
    if is_ipc(addr):
        os.chmod(ipc_path(addr), 0o600)


def validate_address(addr: object, flag: Optional[str] = None, *, bind: bool = False) -> str:
    """Return ``addr`` if it is ``tcp://HOST:PORT`` or ``ipc://ABSOLUTE_PATH``; raise
    ``AddressError`` naming ``flag`` otherwise.

    ``HOST`` is a name, an IPv4 address or a bracketed IPv6 address (``[::1]``); for a
    bind it may also be ``*`` (every interface) or an interface name, and ``PORT`` may be
    0 ("any free port"). A connect needs a port in 1..65535. An ipc path is absolute,
    normalized, names a file inside a directory (not ``/``) and fits a Unix socket
    (at most 107 bytes).
    """
    where = f"{flag}: " if flag else ""
    example = "tcp://127.0.0.1:0" if bind else "tcp://127.0.0.1:5555"

    def fail(why: str) -> AddressError:
        return AddressError(f"{where}invalid address {addr!r}: {why} (expected tcp://HOST:PORT, e.g. {example}, "
                            "or ipc:///PRIVATE_DIR/NAME)")

    if not isinstance(addr, str):
        raise fail("not a string")
    scheme, sep, rest = addr.partition("://")
    if not sep:
        raise fail("no scheme")
    if scheme == "ipc":
        _check_ipc(rest, fail)
        return addr
    if scheme != "tcp":
        raise fail(f"scheme {scheme!r} is not supported, only tcp and ipc")
    host, sep, port = rest.rpartition(":")
    if not sep:
        raise fail("no port")
    if not host:
        raise fail("empty host")
    if host.startswith("[") != host.endswith("]") or (host.startswith("[") and len(host) < 3):
        raise fail("unbalanced brackets around an IPv6 host")
    if ":" in host and not host.startswith("["):
        raise fail("an IPv6 host must be in brackets, e.g. tcp://[::1]:5555")
    if any(c.isspace() or c in "/?#@" for c in host):
        raise fail(f"host {host!r} contains a character not allowed in a host")
    if host == "*" and not bind:
        raise fail("'*' (every interface) can only be bound, not connected to")
    if not (port.isascii() and port.isdigit()):
        raise fail(f"port {port!r} is not a number")
    number = int(port)
    lowest = 0 if bind else 1
    if not lowest <= number <= MAX_PORT:
        raise fail(f"port {number} is outside {lowest}..{MAX_PORT}")
    return addr


def address_type(bind: bool = False) -> Callable[[str], str]:
    """An ``argparse`` ``type=``: a bad address exits with status 2 and a one-line message."""

    def parse(value: str) -> str:
        try:
            return validate_address(value, bind=bind)
        except AddressError as e:  # argparse prefixes "argument --flag: "
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "bind address" if bind else "address"
    return parse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default; where there is none (``None``, a switch that is
    off, an empty string) the option's help says what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == "":
            return action.help or ""
        return super()._get_help_string(action) or ""
