"""``remoteloader-worker --master tcp://HOST:PORT``: one stateless worker process.

With ``--bind ipc:///DIR/NAME`` (one host: the master launches its local workers so when it
listens on ``ipc://DIR/...``) the data socket is a Unix socket in ``DIR``, which must belong
to this user with mode 0700; without keys it runs without CURVE.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Optional, Sequence

import zmq

from .. import __version__
from ..core.cache.janitor import CacheJanitor
from ..core.cache.location import (ENV_CACHE, ENV_CACHE_MAX_BYTES, ENV_CACHE_SHARED, CacheRefused, allowed_caches,
                                   open_cache, shared_from_env)
from ..core.procs import die_with_parent
from ..core.redact import ENV_ALLOW_TABLE, allowlist_from_env, log_to_stderr, redact_text
from ..core.sizing import parse_size
from ..formats import DEFAULT_COALESCE_GAP, TableError
from ..protocol import auth as cluster_auth
from ..protocol.address import (AddressError, DefaultsHelpFormatter, address_type, check_ipc_directory,
                                check_ipc_free, ipc_directory, is_ipc, validate_address)
from ..protocol.messages import MAX_FRAME_BYTES
from .faults import Faults
from .lifecycle import TableRefused, WorkerFailed
from .server import Worker


ENV_ARENA_BYTES = "REMOTELOADER_ARENA_BYTES"
ENV_SHARED_BLOCK_BYTES = "REMOTELOADER_SHARED_BLOCK_BYTES"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remoteloader-worker", description=__doc__,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--master", required=True, type=address_type(), metavar="tcp://HOST:PORT",
                   help="the master's address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--bind-host", default="127.0.0.1", type=_host,
                   help="interface the data port binds to (a free port is chosen; 0.0.0.0: every interface)")
    p.add_argument("--bind", type=_ipc_bind, metavar="ipc://PATH",
                   help="bind the data socket to this Unix socket instead of --bind-host (one host: PATH lies in the "
                        "master's private directory, which must be this user's with mode 0700)")
    cluster_auth.add_server_options(p, "the data socket and the master connection", "--bind-host")
    p.add_argument("--buffer-batches", type=int, default=16,
                   help="pieces the buffer holds for the epochs clients read (shared evenly between ranks)")
    p.add_argument("--buffer-bytes", type=_size, default="256M", metavar="BYTES",
                   help="what the transformed splits this worker holds may take: the one it cuts, those whose "
                        "pieces wait for clients, one read ahead for a next epoch (bytes, or with a suffix K, M, G "
                        "or T, powers of 1024: 512M, 2G); a single split larger than this is still produced, alone")
    p.add_argument("--max-message-bytes", type=_message_size, default="16M", metavar="BYTES",
                   help="the largest data message: a run of consecutive pieces goes to a client as one message "
                        "of at most this many bytes (a single larger piece goes alone); same suffixes as "
                        "--buffer-bytes, at most 1G (docs/operations.md says why 16M)")
    p.add_argument("--arena-bytes", type=_size_or_zero, default=os.environ.get(ENV_ARENA_BYTES, "256M"), metavar="BYTES",
                   help="with an ipc data socket (one host, no keys): each client's shared-memory arena, into "
                        "which its batches are written instead of sent (0: none, every batch goes over the "
                        f"socket); pages are taken as they are first written (also ${ENV_ARENA_BYTES}, which "
                        "reaches the workers of an embedded loader)")
    p.add_argument("--shared-block-bytes", type=_size_or_zero, default=os.environ.get(ENV_SHARED_BLOCK_BYTES, "256M"),
                   metavar="BYTES",
                   help="a shared fleet: what the blocks computed for one job and kept for another job reading the "
                        "same features may take (for at most 30 s; 0: none, each job computes its own; also "
                        f"${ENV_SHARED_BLOCK_BYTES})")
    p.add_argument("--coalesce-gap", type=int, default=DEFAULT_COALESCE_GAP,
                   help="merge reads of selected column streams whose gap is at most this many bytes "
                        "(0: one request per stream)")
    p.add_argument("--allow-table", action="append", default=None, metavar="PREFIX",
                   help=f"path or URI prefix of tables this worker may read (repeatable; also ${ENV_ALLOW_TABLE}, "
                        "a JSON list, which keeps prefixes off the command line); a job outside them is refused "
                        "(default: whatever the master names)")
    p.add_argument("--cache", metavar="URI", default=os.environ.get(ENV_CACHE),
                   help="the block cache (a directory or a pyarrow filesystem URI such as s3://bucket/prefix): "
                        "splits read and write feature blocks there as the master's cache plan says (docs/cache.md)")
    p.add_argument("--allow-cache", action="append", default=None, metavar="PREFIX",
                   help="--cache must be under one of these prefixes (repeatable; also $REMOTELOADER_ALLOW_CACHE)")
    p.add_argument("--cache-max-bytes", type=_size, default=os.environ.get(ENV_CACHE_MAX_BYTES), metavar="BYTES",
                   help="keep the cache under this size (e.g. 500G): a write first evicts least recently used "
                        "splits, or is dropped if it cannot fit; a gc pass runs at start and every 5 minutes")
    p.add_argument("--cache-shared", action="store_true", default=shared_from_env(),
                   help="the cache location is shared with other users (it need not be this user's, and may be "
                        f"writable by others); needs --auth (also ${ENV_CACHE_SHARED}=1). Without it a local "
                        "location must be this user's and writable by nobody else")
    p.add_argument("--client-timeout", type=float, default=30.0,
                   help="seconds a rank may send no request before the batches held for it are released "
                        "(re-produced if it returns); keep below the master's --split-timeout")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds to wait for clients to consume what this worker holds")
    p.add_argument("--node", default="", type=_node, metavar="NAME",
                   help="the node (host) this worker runs on: the master gives it to the ranks whose loaders run on "
                        "the same node first (a multi-node torchrun job's embedded set-up names them; default: none)")
    p.add_argument("--die-with-parent", action="store_true", help="exit when the launching process dies")
    p.add_argument("--inject-batch-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests only
    p.add_argument("--inject-hang-after", type=int, default=-1, help=argparse.SUPPRESS)  # tests only
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS, help="logging level")
    return p


def _host(value: str) -> str:
    """A host to bind (the port is chosen): checked as the address ``tcp://HOST:0``."""
    try:
        validate_address(f"tcp://{value}:0", bind=True)
    except AddressError:
        raise argparse.ArgumentTypeError(f"invalid host {value!r} (expected e.g. 127.0.0.1, 0.0.0.0 or [::1])") \
            from None
    return value


def _node(value: str) -> str:
    if len(value) > 255:
        raise argparse.ArgumentTypeError("a node name has at most 255 characters")
    return value


def _ipc_bind(value: str) -> str:
    try:
        validate_address(value, bind=True)
    except AddressError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not is_ipc(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not ipc://PATH (a tcp data socket is chosen by --bind-host)")
    return value


def _size(value: str, most: Optional[int] = None) -> int:
    try:
        return parse_size(value, most)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size_or_zero(value: str) -> int:
    """A size, or 0 for none (``--arena-bytes``, ``--shared-block-bytes``)."""
    return 0 if value.strip() == "0" else _size(value)


def _message_size(value: str) -> int:
    """``--max-message-bytes``: a size of at most ``MAX_FRAME_BYTES``, the largest frame a client takes."""
    return _size(value, MAX_FRAME_BYTES)


def _allowed_tables(from_args: Optional[list[str]]) -> Optional[tuple[str, ...]]:
    """--allow-table and $REMOTELOADER_ALLOW_TABLE together; None (whatever the master
    names) when neither is given."""
    if from_args is None and ENV_ALLOW_TABLE not in os.environ:
        return None
    return (*(from_args or []), *allowlist_from_env())


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    log_to_stderr(args.log_level.upper(), "%(asctime)s worker %(levelname)s %(message)s")
    if args.die_with_parent:
        die_with_parent()
    try:
        creds = cluster_auth.server_credentials("remoteloader-worker", args.auth, args.insecure,
                                                "--bind" if args.bind else "--bind-host", args.bind or args.bind_host)
    except cluster_auth.AuthError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        allowed = _allowed_tables(args.allow_table)
    except ValueError as e:
        print(f"remoteloader-worker: {e}", file=sys.stderr)
        return 2
    try:
        cache = None if args.cache is None else open_cache(args.cache, allowed_caches(args.allow_cache), creds,
                                                           shared=args.cache_shared, max_bytes=args.cache_max_bytes)
    except (CacheRefused, TableError, OSError) as e:
        print(f"remoteloader-worker: --cache: {redact_text(str(e))}", file=sys.stderr)
        return 2
    if args.bind:
        try:
            check_ipc_directory(ipc_directory(args.bind))  # made and removed by the master, never here
            check_ipc_free(args.bind)
        except (AddressError, OSError) as e:
            print(f"remoteloader-worker: --bind {args.bind}: {e}", file=sys.stderr)
            return 2
    try:
        worker = Worker(args.master, bind_host="127.0.0.1" if args.bind else args.bind_host, buffer_batches=args.buffer_batches,
                        drain_timeout_s=args.drain_timeout, coalesce_gap=args.coalesce_gap,
                        faults=Faults(args.inject_batch_delay, args.inject_hang_after), auth=creds,
                        client_timeout_s=args.client_timeout, buffer_bytes=args.buffer_bytes,
                        allowed_tables=allowed, bind=args.bind, cache=cache,
                        max_message_bytes=args.max_message_bytes, arena_bytes=args.arena_bytes,
                        node=args.node, shared_block_bytes=args.shared_block_bytes)
    except (zmq.ZMQError, OSError) as e:
        flag = f"--bind {args.bind}" if args.bind else f"--bind-host {args.bind_host}"
        print(f"remoteloader-worker: {flag}: {e}", file=sys.stderr)
        return 2
    # SIGTERM (scale-down, orderly shutdown) drains; SIGINT (Ctrl-C) stops at once.
    signal.signal(signal.SIGTERM, lambda *_: worker.request("drain"))
    signal.signal(signal.SIGINT, lambda *_: worker.request("stop"))
    janitor = None if cache is None or args.cache_max_bytes is None else CacheJanitor(cache, args.cache_max_bytes)
    try:
        worker.run()
    except TableRefused as e:
        print(f"remoteloader-worker: {redact_text(str(e))}", file=sys.stderr)
        return 2
    except WorkerFailed as e:  # logged with its traceback where it happened; the launcher replaces us
        print(f"remoteloader-worker: {redact_text(str(e))}", file=sys.stderr)
        return 1
    finally:
        if janitor is not None:
            janitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
