"""CURVE authentication and encryption of every socket (ZeroMQ's own, through ``zmq.auth``).

Key layout (``remoteloader keygen DIR``; the directory is 0700, every file 0600)::

    DIR/cluster.key            the cluster's public key (a ZeroMQ certificate)
    DIR/cluster.key_secret     the cluster's key pair (public and secret)
    DIR/public_keys/cluster.key  client public keys the servers accept (here: the cluster's own)

``load`` holds the directory to ssh's StrictModes: the directory, ``public_keys/`` and
every key file must belong to this user (or root) and be writable by nobody else, or it
is refused naming the path: whoever can write ``public_keys/`` can plant a key and be admitted.

First version, kept simple: one "cluster" key pair is used by every component, as the
server key of the master's and the workers' ROUTER sockets and as the client key of
every DEALER (workers, clients, ``remoteloader status``). Each server runs a ZAP
handler (pyzmq's ``ThreadAuthenticator``) that accepts only clients whose public key is
in ``public_keys/``. So **possession of the key directory is membership**: whoever can
read it can serve and read data; whoever cannot gets no reply at all (a plain or
wrong-key peer fails the CURVE handshake and never reaches the application). Traffic is
encrypted too.

ZeroMQ allows one ZAP handler per context (it binds ``inproc://zeromq.zap.01``), so
``server_authenticator`` starts one ``ThreadAuthenticator`` per context, shared and
reference-counted by the servers of that context, and stops it when the last releases it.
Server sockets also set ``ZAP_ENFORCE_DOMAIN``, so a missing handler refuses every peer
rather than admitting any.
"""
from __future__ import annotations

import argparse
import os
import re
import threading
from dataclasses import dataclass
from typing import Optional, Union

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ENV_AUTH = "REMOTELOADER_AUTH"
KEY_NAME = "cluster"
PUBLIC_KEYS = "public_keys"
ZAP_DOMAIN = b"remoteloader"  # the ZAP domain of every server socket; the authenticator checks keys for it


class AuthError(ValueError):
    """A key directory that is missing, incomplete, readable by others or writable by them."""


@dataclass(frozen=True)
class Credentials:
    """The cluster's key material, loaded from a key directory."""

    directory: str
    public_key: bytes  # z85, the cluster key: the servers' key and every client's key
    secret_key: bytes
    public_keys_dir: str  # client public keys the servers accept

    @property
    def server_public(self) -> bytes:
        return self.public_key


def keygen(directory: Union[str, os.PathLike]) -> str:
    """Write a fresh cluster key pair into ``directory`` (created 0700; files 0600)."""
    public, secret = zmq.curve_keypair()
    return write_key_directory(directory, public, secret)


Z85_KEY = re.compile(rb"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")  # a CURVE key in Z85: 40 characters


def write_key_directory(directory: Union[str, os.PathLike], public: bytes, secret: bytes) -> str:
    """Write the key pair ``public``/``secret`` (Z85) as a key directory in ``keygen``'s
    layout: ``directory`` created 0700, every file 0600 from the start (the umask is not
    trusted), the pair's public key the one client key admitted. Used by ``keygen`` and for
    a torchrun job's per-job key set received through torch's store (client/jobkeys.py);
    keys that are not 40 Z85 characters are refused, so nothing else reaches the files."""
    directory = os.fspath(directory)
    for what, key in (("public", public), ("secret", secret)):
        if not isinstance(key, bytes) or not Z85_KEY.fullmatch(key):
            raise AuthError(f"the {what} key is not a 40-character Z85 CURVE key")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    if os.path.exists(os.path.join(directory, KEY_NAME + ".key_secret")):
        raise AuthError(f"{directory} already holds a cluster key; refusing to overwrite it")
    public_dir = os.path.join(directory, PUBLIC_KEYS)
    os.makedirs(public_dir, mode=0o700, exist_ok=True)
    os.chmod(public_dir, 0o700)
    # ZeroMQ's certificate format (ZPL), as zmq.auth.load_certificate reads it.
    public_text = f'curve\n    public-key = "{public.decode()}"\n'
    secret_text = public_text + f'    secret-key = "{secret.decode()}"\n'
    for path, text in ((os.path.join(directory, KEY_NAME + ".key"), public_text),
                       (os.path.join(directory, KEY_NAME + ".key_secret"), secret_text),
                       (os.path.join(public_dir, KEY_NAME + ".key"), public_text)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("#   ZeroMQ CURVE certificate (remoteloader)\n" + text)
    return directory


def _check_strict(path: str, what: str) -> None:
    """ssh's StrictModes for one key directory or key file: whoever else could write it
    could plant a key (in ``public_keys/``: be admitted) or swap the cluster's. Owned by
    this user (or root); writable by nobody else, unless it lies on a read-only mount (such
    as a Kubernetes Secret volume, whose mode bits may say otherwise: nobody can write it)."""
    st = os.stat(path)
    if st.st_uid not in (os.geteuid(), 0):
        raise AuthError(f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) "
                        f"or root: refusing it, as someone else could plant a key there")
    if st.st_mode & 0o022 and not os.statvfs(path).f_flag & os.ST_RDONLY:
        raise AuthError(f"{what} {path} is writable by group or others: refusing it, as they could plant a key "
                        f"there (chmod go-w {path})")


def _check_key_directory(directory: str, secret_file: str, public_dir: str) -> None:
    """Every path whose contents decide membership: the directory, the secret, the allowed keys."""
    _check_strict(directory, "auth directory")
    _check_strict(secret_file, "cluster key")
    if os.stat(secret_file).st_mode & 0o077:
        raise AuthError(f"{secret_file} is readable by group or others; chmod 600 it")
    _check_strict(public_dir, "allowed client keys directory")
    for name in sorted(os.listdir(public_dir)):
        _check_strict(os.path.join(public_dir, name), "allowed client key")


def load(directory: Union[str, os.PathLike]) -> Credentials:
    """Load a key directory written by ``keygen``; ``AuthError`` (one line, naming the path)
    if it is not usable or others could change it."""
    directory = os.fspath(directory)
    secret_file = os.path.join(directory, KEY_NAME + ".key_secret")
    public_dir = os.path.join(directory, PUBLIC_KEYS)
    if not os.path.isfile(secret_file):
        raise AuthError(f"auth directory {directory!r} has no {KEY_NAME}.key_secret "
                        f"(create one with: remoteloader keygen {directory})")
    if not os.path.isdir(public_dir):
        raise AuthError(f"auth directory {directory!r} has no {PUBLIC_KEYS}/ directory of allowed client keys")
    _check_key_directory(directory, secret_file, public_dir)
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as e:
        raise AuthError(f"cannot read the cluster key in {directory!r}: {e}") from None
    if not secret:
        raise AuthError(f"{secret_file} holds no secret key")
    return Credentials(directory, public, secret, public_dir)


def from_option(value: Optional[str]) -> Optional[Credentials]:
    """``--auth DIR`` / ``auth=DIR``, defaulting to ``$REMOTELOADER_AUTH``; None: no auth."""
    value = value if value else os.environ.get(ENV_AUTH) or None
    return load(value) if value else None


def secure_server(sock: zmq.Socket, creds: Credentials) -> None:
    """Make ``sock`` (before bind) a CURVE server; pair it with ``server_authenticator``."""
    # libzmq asks the ZAP handler only for a socket with a ZAP domain: without one, CURVE
    # admits any client key that knows the server's public key. With a domain and
    # ZAP_ENFORCE_DOMAIN, a missing handler refuses everyone rather than admitting everyone.
    sock.zap_domain = ZAP_DOMAIN
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.curve_secretkey = creds.secret_key
    sock.curve_publickey = creds.public_key
    sock.curve_server = True


def secure_client(sock: zmq.Socket, creds: Credentials, server_public: Optional[bytes] = None) -> None:
    """Make ``sock`` (before connect) a CURVE client of a server with key ``server_public``."""
    sock.curve_secretkey = creds.secret_key
    sock.curve_publickey = creds.public_key
    sock.curve_serverkey = server_public if server_public is not None else creds.server_public


class _Shared:
    def __init__(self, authenticator: ThreadAuthenticator) -> None:
        self.authenticator = authenticator
        self.users = 0
        self.locations: list[str] = []


_lock = threading.Lock()
_running: dict[int, _Shared] = {}  # id(context) -> its one authenticator


class AuthenticatorHandle:
    """A server's share of its context's authenticator; ``close`` releases it (idempotent)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx: Optional[zmq.Context] = ctx

    def close(self) -> None:
        with _lock:
            if self._ctx is None:
                return
            key, self._ctx = id(self._ctx), None
            shared = _running.get(key)
            if shared is None:
                return
            shared.users -= 1
            if shared.users <= 0:
                del _running[key]
                shared.authenticator.stop()


def server_authenticator(ctx: zmq.Context, creds: Credentials) -> AuthenticatorHandle:
    """Start (once per context) the ZAP handler that admits the keys in ``creds.public_keys_dir``.

    Call before binding a ``secure_server`` socket. A second set of credentials on the
    same context (two clusters in one process, e.g. tests) adds its allowed keys.
    """
    with _lock:
        shared = _running.get(id(ctx))
        if shared is None:
            authenticator = ThreadAuthenticator(ctx)
            authenticator.start()
            authenticator.configure_curve(domain=ZAP_DOMAIN.decode(), location=creds.public_keys_dir)
            shared = _running[id(ctx)] = _Shared(authenticator)
            shared.locations.append(creds.public_keys_dir)
        elif creds.public_keys_dir not in shared.locations:
            shared.locations.append(creds.public_keys_dir)
            shared.authenticator.certs.setdefault(ZAP_DOMAIN.decode(), {}).update(
                zmq.auth.load_certificates(creds.public_keys_dir))
        shared.users += 1
    return AuthenticatorHandle(ctx)


def is_loopback(host_or_addr: str) -> bool:
    """Is this bind host (or ``tcp://HOST:PORT``, or ``ipc://PATH``) reachable only from this machine?"""
    if host_or_addr.startswith("ipc://"):  # a Unix socket: never on the network
        return True
    host = host_or_addr
    if "://" in host:
        host = host.split("://", 1)[1].rsplit(":", 1)[0]
    return host == "localhost" or host == "[::1]" or host == "::1" or host.startswith("127.")


def add_server_options(parser: argparse.ArgumentParser, secured: str, bind_flag: str) -> None:
    """``--auth`` and ``--insecure`` of a server role (master, worker); ``server_credentials``
    reads them back. ``secured`` names what the keys protect, ``bind_flag`` the option
    whose address decides whether ``--insecure`` is needed."""
    parser.add_argument("--auth", metavar="DIR",
                        help=f"key directory (remoteloader keygen DIR): CURVE-authenticate and encrypt {secured} "
                             f"(without it: ${ENV_AUTH}, else no auth)")
    parser.add_argument("--insecure", action="store_true",
                        help=f"allow a non-loopback {bind_flag} without --auth (anyone who can reach it is served)")


def server_credentials(prog: str, auth: Optional[str], insecure: bool, flag: str, where: str) -> Optional[Credentials]:
    """A server's keys from ``--auth`` / the environment; raises AuthError (one line) for
    a bad key directory, or for a non-loopback bind without keys unless ``--insecure``."""
    try:
        creds = from_option(auth)
    except AuthError as e:
        raise AuthError(f"{prog}: --auth: {e}") from None
    if creds is None and not insecure and not is_loopback(where):
        raise AuthError(f"{prog}: {flag} {where} is not a loopback address and no --auth key directory was given "
                        f"(nor ${ENV_AUTH}): create one with 'remoteloader keygen DIR' and pass --auth DIR, "
                        f"or pass --insecure to serve unauthenticated anyway")
    return creds
