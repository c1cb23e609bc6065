"""``remoteloader-master --bind tcp://127.0.0.1:5555 [--spec SPEC] [--journal DIR] [--workers N]``

``--bind ipc:///DIR/NAME``: one host. The master makes ``DIR`` (0700) if it does not exist
and then removes it when it exits; an existing ``DIR`` must belong to this user with mode
0700 (else it refuses to start, naming it) and is kept. Sockets there run without CURVE
(the directory's permissions keep other users out; nothing leaves the kernel), its local
workers bind ``ipc://DIR/worker-<random>``, and it registers only workers whose ipc address
lies in ``DIR``.
"""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import shlex
import shutil
import signal
import sys
from typing import Optional, Sequence

import zmq

from .. import __version__
from ..core.cache.janitor import CacheJanitor
from ..core.cache.location import (ENV_ALLOW_CACHE, ENV_CACHE, ENV_CACHE_MAX_BYTES, ENV_CACHE_SHARED, CacheRefused,
                                   allowed_caches, open_cache, shared_from_env)
from ..core.procs import die_with_parent
from ..core.redact import ENV_ALLOW_TABLE, allowlist_env, allowlist_from_env, log_to_stderr, redact_text
from ..core.sizing import parse_size, warm_up
from ..protocol import auth as cluster_auth
from ..protocol.address import (AddressError, DefaultsHelpFormatter, address_type, check_ipc_free, ipc_directory,
                                is_ipc, prepare_ipc_directory, restrict_ipc_socket)
from ..protocol.capability import MasterKeys
from ..protocol.messages import MAX_FRAME_BYTES
from ..formats import TableError
from ..spec import DatasetSpec, SpecError
from .autoscale import AutoscaleConfig, Autoscaler, CpuTargetConfig, CpuTargetPolicy
from .journal import Journal
from .launcher import LauncherThread, make_launcher
from .metrics import MasterMetrics
from .server import MasterServer
from .service import MasterConfig, MasterService


SHARED_MAX_JOBS = 8  # --max-jobs of a shared fleet (no --spec)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
log = logging.getLogger("remoteloader.master")


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: --ray-actor re-runs the master with its own options removed by name.
    p = argparse.ArgumentParser(prog="remoteloader-master", description="The remoteloader master (control plane).",
                                formatter_class=DefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--bind", default="tcp://127.0.0.1:5555", type=address_type(bind=True),
                   metavar="tcp://HOST:PORT|ipc://PATH",
                   help="address to listen on (port 0: any free port; the address bound is printed); ipc:///DIR/NAME: "
                        "one host, no CURVE, DIR made 0700 if missing (and then removed at exit), else it must be "
                        "this user's with mode 0700; launched workers bind in DIR too")
    cluster_auth.add_server_options(p, "every socket, and hand the directory to launched workers", "--bind")
    p.add_argument("--spec", help="dataset spec (YAML/JSON): a master of that one job; without it, a shared fleet "
                                  "whose clients' specs (within --allow-table) are its jobs")
    p.add_argument("--max-jobs", type=int, metavar="N",
                   help=f"jobs (specs) a shared fleet holds at once (default {SHARED_MAX_JOBS}); a new spec beyond "
                        "them takes the place of a job whose loaders all left, or is refused while every one is live")
    p.add_argument("--allow-table", action="append", default=[], metavar="PREFIX",
                   help=f"a table path or URI prefix clients' specs may read (repeatable; also ${ENV_ALLOW_TABLE}, "
                        "a JSON list, which keeps prefixes off the command line); without either and without "
                        "--spec, the master accepts no client spec")
    p.add_argument("--journal", metavar="DIR",
                   help="directory of the state journal; without it state lives in memory only")
    p.add_argument("--popularity-log", metavar="FILE", help="append each job's feature projection here "
                   "(without it: popularity.jsonl in the journal directory, if there is one)")
    p.add_argument("--workers", type=int, default=0, help="workers to start and keep running (a fixed pool)")
    p.add_argument("--autoscale", action="store_true", help="let the autoscaler choose the worker count")
    p.add_argument("--min-workers", type=int, help="autoscaling lower bound (without it: the spec's autoscale, else 1)")
    p.add_argument("--max-workers", type=int,
                   help="autoscaling upper bound (without it: the spec's autoscale, else 64)")
    p.add_argument("--autoscale-policy", choices=("stall", "cpu"), default="stall",
                   help="stall: remoteloader's policy; cpu: a Kubernetes-style 80%% CPU target (for comparison)")
    p.add_argument("--launcher", choices=("local", "ray"), default="local", help="how workers are started")
    p.add_argument("--ray-address", help="Ray cluster address for --launcher ray (e.g. 127.0.0.1:6379, auto)")
    p.add_argument("--ray-auth-token-file", metavar="FILE",
                   help="file holding the Ray cluster's auth token (without it: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH "
                        "or ~/.ray/auth_token)")
    p.add_argument("--ray-detached-workers", metavar="PREFIX",
                   help="with --launcher ray: start workers as detached actors named PREFIX-worker-N that outlive "
                        "this master and are adopted when a master with the same PREFIX starts (without it: workers "
                        "end with the master)")
    p.add_argument("--ray-actor", metavar="NAME",
                   help="run this master as a detached Ray actor NAME (on the node of --bind, which needs a fixed "
                        "port) that Ray restarts if it dies; needs --ray-address and, to survive, --journal on "
                        "storage the node keeps; prints the address and returns")
    p.add_argument("--ray-max-restarts", type=int, default=-1,
                   help="with --ray-actor: how often Ray restarts a master that died (-1: always)")
    p.add_argument("--ray-stop", action="store_true",
                   help="with --ray-actor: stop that master actor and its workers for good")
    p.add_argument("--worker-buffer", type=int, default=16, help="batches each launched worker may buffer")
    p.add_argument("--buffer-bytes", type=_size, default="256M", metavar="BYTES",
                   help="what each worker may hold of transformed splits (the workers' --buffer-bytes; bytes, or "
                        "with a suffix K, M, G or T, powers of 1024: 512M, 2G): splits are planned so that one stays "
                        "within half of it, fewer rows than the spec's split_rows if need be")
    p.add_argument("--max-message-bytes", type=_message_size, default=None, metavar="BYTES",
                   help="the largest data message of the workers it starts (their --max-message-bytes; same "
                        "suffixes, at most 1G; without it: the workers' default, 16M)")
    p.add_argument("--cache", metavar="URI", default=os.environ.get(ENV_CACHE),
                   help="the block cache (a directory or a pyarrow filesystem URI such as s3://bucket/prefix), for "
                        "this master's plan and the workers it starts (docs/cache.md; also $REMOTELOADER_CACHE); "
                        "without it no split uses a cache")
    p.add_argument("--allow-cache", action="append", default=None, metavar="PREFIX",
                   help="--cache must be under one of these prefixes (repeatable; also $REMOTELOADER_ALLOW_CACHE)")
    p.add_argument("--cache-max-bytes", type=_size, default=None, metavar="BYTES",
                   help="keep the cache under this size (least recently used splits go first): every write of the "
                        "workers it starts evicts first or is dropped, and a gc pass runs at start and every 5 "
                        "minutes; the auto policy plans within it")
    p.add_argument("--cache-shared", action="store_true", default=shared_from_env(),
                   help="the cache location is shared with other users (it need not be this user's, and may be "
                        f"writable by others); needs --auth; passed on to the workers it starts (also "
                        f"${ENV_CACHE_SHARED}=1). Without it a local location must be this user's and writable by "
                        "nobody else")
    p.add_argument("--worker-args", default="", help="extra arguments for launched local workers (one string)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds without heartbeat before a worker is dead")
    p.add_argument("--split-timeout", type=float, default=60.0,
                   help="seconds a worker may hold a split without progress before it is re-queued")
    p.add_argument("--no-prefetch", action="store_true",
                   help="do not let idle workers start a rank's next epoch early (for comparison)")
    p.add_argument("--max-workers-per-client", type=int, default=32, help="partitioned round robin: workers per client")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on --metrics-host:PORT/metrics (0: any free port; "
                        "without it: no metrics endpoint)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="interface the metrics endpoint binds to (plain HTTP, never authenticated: a non-loopback "
                        "host needs --insecure)")
    p.add_argument("--die-with-parent", action="store_true", help="exit when the launching process dies")
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS, help="logging level")
    return p


def _cache_env(uri: Optional[str], allowed: Optional[Sequence[str]], max_bytes: Optional[int],
               shared: bool = False) -> dict[str, str]:
    """The cache settings of the workers this master starts, in their environment (a cache
    URI may hold a credential, and command lines are public): the same location, checked
    against the same prefixes (the location itself when none were given), the same bound
    and the same choice of a shared location (``0`` too: a worker never inherits one)."""
    if uri is None:
        return {}
    env = {ENV_CACHE: uri, ENV_ALLOW_CACHE: os.pathsep.join(allowed if allowed is not None else [uri]),
           ENV_CACHE_SHARED: "1" if shared else "0"}
    if max_bytes is not None:
        env[ENV_CACHE_MAX_BYTES] = str(max_bytes)
    return env


def _size(value: str, most: Optional[int] = None) -> int:
    try:
        return parse_size(value, most)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _message_size(value: str) -> int:
    """``--max-message-bytes``: a size of at most ``MAX_FRAME_BYTES``, the largest frame a client takes."""
    return _size(value, MAX_FRAME_BYTES)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    log_to_stderr(args.log_level.upper(), "%(asctime)s master %(levelname)s %(message)s")
    if args.ray_actor:
        return _as_ray_actor(p, args, argv)
    if args.die_with_parent:
        die_with_parent()
    try:
        creds = cluster_auth.server_credentials("remoteloader-master", args.auth, args.insecure, "--bind", args.bind)
    except cluster_auth.AuthError as e:
        print(e, file=sys.stderr)
        return 2
    if args.metrics_port is not None and not args.insecure and not cluster_auth.is_loopback(args.metrics_host):
        print(f"remoteloader-master: --metrics-host {args.metrics_host} is not a loopback address and the metrics "
              "endpoint is plain, unauthenticated HTTP: pass --insecure to serve it there anyway", file=sys.stderr)
        return 2
    try:
        allowed = [*args.allow_table, *allowlist_from_env()]
    except ValueError as e:
        print(f"remoteloader-master: {e}", file=sys.stderr)
        return 2

    try:
        allowed_cache = allowed_caches(args.allow_cache)
        # Its own store writes only the rate probe, removed at once: the bound is the janitor's and the workers'.
        cache = None if args.cache is None else open_cache(args.cache, allowed_cache, creds, shared=args.cache_shared)
    except (CacheRefused, TableError, OSError) as e:
        print(f"remoteloader-master: --cache: {redact_text(str(e))}", file=sys.stderr)
        return 2

    if args.max_jobs is not None and (args.max_jobs < 1 or (args.spec and args.max_jobs != 1)):
        print(f"remoteloader-master: --max-jobs {args.max_jobs}: " + ("a master with --spec serves that one job"
                                                                      if args.spec else "at least 1"), file=sys.stderr)
        return 2
    max_jobs = 1 if args.spec else (args.max_jobs or SHARED_MAX_JOBS)
    config = MasterConfig(heartbeat_timeout=args.heartbeat_timeout, max_jobs=max_jobs, max_workers_per_client=args.max_workers_per_client,
                          split_timeout=args.split_timeout, prefetch_next_epoch=not args.no_prefetch,
                          allowed_tables=tuple(allowed), buffer_bytes=args.buffer_bytes, cache_max_bytes=args.cache_max_bytes,
                          ipc_dir=ipc_directory(args.bind) if is_ipc(args.bind) else None,
                          popularity_log=args.popularity_log or (os.path.join(args.journal, "popularity.jsonl")
                                                                 if args.journal else None))
    # Binding a job transforms a sample (the split size estimate): load numba first, so the
    # first client's hello is not told to retry while it loads.
    warm_up()
    journal = Journal(args.journal) if args.journal else None
    # The keys that sign sessions and workers live beside the journal: a restarted master
    # replays sessions and workers whose tokens must still verify.
    service = MasterService(config, journal, keys=MasterKeys.stored(args.journal) if args.journal else None,
                            cache=cache)
    if args.spec and not service.fleet.jobs:
        try:
            service.submit(DatasetSpec.from_file(args.spec))
        except SpecError as e:
            print(f"remoteloader-master: {redact_text(str(e))}", file=sys.stderr)
            return 2
    try:
        ipc_dir = _prepare_ipc(args.bind, creds is not None)
        server = MasterServer(service, args.bind, auth=creds)
        restrict_ipc_socket(server.addr)
    except (zmq.ZMQError, AddressError, OSError) as e:  # e.g. the port is taken, the host is not this machine's
        print(f"remoteloader-master: --bind {args.bind}: {e}", file=sys.stderr)
        return 2
    metrics = None
    if args.metrics_port is not None:
        metrics = MasterMetrics(service)
        metrics.attach(server)  # values are read on the master's loop, at scrape time
        try:
            port = metrics.serve(args.metrics_port, args.metrics_host)
        except OSError as e:
            print(f"remoteloader-master: --metrics-port {args.metrics_port} on {args.metrics_host}: {e}",
                  file=sys.stderr)
            server.close()
            return 2
        print(f"remoteloader-master metrics on http://{args.metrics_host}:{port}/metrics", file=sys.stderr)

    # Workers it starts check the same tables again (a second line of defence), told through
    # their environment: a table path may hold a credential, and command lines are public.
    served = [*allowed, *(path for st in service.fleet.jobs.values() for _, path in st.job.spec.table_paths)]
    try:
        engine = make_launcher(args.launcher, server.addr, ray_address=args.ray_address,
                               ray_auth_token_path=args.ray_auth_token_file,
                               ray_detached_prefix=args.ray_detached_workers,
                               worker_args=shlex.split(args.worker_args), buffer_batches=args.worker_buffer,
                               buffer_bytes=args.buffer_bytes, max_message_bytes=args.max_message_bytes,
                               worker_env={**(allowlist_env(served) if served else {}),
                                           **_cache_env(args.cache, allowed_cache, args.cache_max_bytes,
                                                        args.cache_shared)},
                               auth_dir=creds.directory if creds is not None else None, insecure=args.insecure)
    except (ValueError, ImportError, ConnectionError) as e:
        print(f"remoteloader-master: {e}", file=sys.stderr)
        if metrics is not None:
            metrics.close()
        server.close()
        return 2
    # Built above before the loop serves (Ray connects, adopts detached workers), then owned by
    # its own thread: the loop only queues commands and reads the counts it posts.
    launcher = LauncherThread(engine)
    service.pending_workers = launcher.pending
    scaling = _autoscale_config(args, service)
    autoscaler = None
    if scaling is not None:
        policy = None
        if args.autoscale_policy == "cpu":
            policy = CpuTargetPolicy(CpuTargetConfig(min_workers=scaling.min_workers, max_workers=scaling.max_workers))
        # With a journal, learned worker throughput and limits survive a restart.
        autoscaler = Autoscaler(service, launcher, scaling, policy,
                                state_path=os.path.join(args.journal, "autoscale.json") if args.journal else None)
        service.decision_log = autoscaler.recent_decisions
        autoscaler.start()
        server.periodic.append(autoscaler.tick)
    elif args.workers:
        launcher.start(max(0, args.workers - launcher.running()))  # a restarted master may have adopted some

        def keep_workers() -> None:  # DPP's master restarts failed workers; so does this one
            # Whatever the exit code: a worker drained by a member, or stopped by hand, leaves
            # the pool short as surely as one that crashed.
            launcher.reap()
            launcher.start(args.workers - launcher.running())
        server.periodic.append(keep_workers)
    elif not launcher.running():  # otherwise a client would wait out its timeout in silence
        log.warning("this master starts no workers (--workers 0, no autoscaling): start them by hand with "
                    "remoteloader-worker --master %s%s%s", server.addr,
                    f" --bind ipc://{ipc_dir}/worker-NAME" if ipc_dir else "", " --auth DIR" if creds is not None else "")

    janitor = None if cache is None or args.cache_max_bytes is None else CacheJanitor(cache, args.cache_max_bytes)
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    signal.signal(signal.SIGINT, lambda *_: server.request_stop())
    print(f"remoteloader-master listening on {server.addr}", flush=True)
    try:
        server.serve_forever()
    finally:
        service.close()  # its followers' re-listings
        launcher.stop_all()
        if autoscaler is not None:
            autoscaler.stop()  # saves the policy's state (with --journal)
        if metrics is not None:
            metrics.close()
        if janitor is not None:
            janitor.close()
        if service.journal is not None:
            service.journal.close()
    return 0


def _prepare_ipc(bind: str, curve: bool) -> Optional[str]:
    """For ``--bind ipc://DIR/NAME``: make (then remove at exit) or check ``DIR``; None for tcp."""
    if not is_ipc(bind):
        return None
    directory = ipc_directory(bind)
    if prepare_ipc_directory(directory):
        # Any exit but SIGKILL of this very process: a normal stop, SIGTERM (also the
        # parent-death signal of --die-with-parent), an error at start. Launched workers'
        # stale sockets go with it.
        atexit.register(shutil.rmtree, directory, True)
    check_ipc_free(bind)
    if curve:
        log.warning("--bind %s with keys (--auth or $%s): CURVE runs on the ipc sockets too, which the directory's "
                    "mode 0700 already keeps from other users; it costs about 30%% of throughput (drop the keys "
                    "for a one-host cluster)", bind, cluster_auth.ENV_AUTH)
    return directory


def _as_ray_actor(p: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    """``--ray-actor NAME``: hand this master to Ray as a restartable actor, or stop it."""
    from . import ray_actor

    if not args.ray_address:
        p.error("--ray-actor needs --ray-address")
    if is_ipc(args.bind):
        p.error("--ray-actor needs a tcp --bind: an ipc socket is reachable on one host only")
    host, port = args.bind.rsplit(":", 1)
    if port == "0":
        p.error("--ray-actor needs a fixed --bind port: a restarted master must be found at the same address")
    try:
        if args.ray_stop:
            found = ray_actor.stop_actor(args.ray_actor, args.ray_address, args.ray_auth_token_file)
            print(f"remoteloader-master {args.ray_actor}: {'stopped' if found else 'not running'}")
            return 0 if found else 1
        child = _absolute_paths(_without(argv, {"--ray-actor": 1, "--ray-max-restarts": 1, "--ray-stop": 0}))
        child += ["--ray-detached-workers", args.ray_detached_workers or args.ray_actor]
        if not args.auth and os.environ.get(cluster_auth.ENV_AUTH):  # this shell's environment stays here
            child += ["--auth", os.path.abspath(os.environ[cluster_auth.ENV_AUTH])]
        addr = ray_actor.submit(args.ray_actor, host.split("//", 1)[1].strip("[]"), child, args.ray_address,
                                args.ray_auth_token_file, args.ray_max_restarts)
    except Exception as e:  # Ray's errors share no base with ours; any of them is one line here
        print(f"remoteloader-master: --ray-actor {args.ray_actor}: {e}", file=sys.stderr)
        return 2
    print(f"remoteloader-master {args.ray_actor} (Ray actor) listening on {addr}", flush=True)
    return 0


# Options naming files: the actor's master runs in a Ray worker's directory, so relative
# paths are made absolute here (the files must exist at those paths on the --bind node).
PATH_OPTIONS = ("--spec", "--journal", "--auth", "--popularity-log", "--ray-auth-token-file")


def _absolute_paths(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out):
        name, eq, value = arg.partition("=")
        if name in PATH_OPTIONS and eq:
            out[i] = f"{name}={os.path.abspath(value)}"
        elif arg in PATH_OPTIONS and i + 1 < len(out):
            out[i + 1] = os.path.abspath(out[i + 1])
    return out


def _without(argv: list[str], options: dict[str, int]) -> list[str]:
    """``argv`` less ``options`` (name -> how many values follow it; ``--name=value`` too)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg.split("=", 1)[0] in options:
            skip = 0 if "=" in arg else options[arg]
        else:
            out.append(arg)
    return out


def _autoscale_config(args: argparse.Namespace, service: MasterService) -> Optional[AutoscaleConfig]:
    """CLI flags win over the spec's ``autoscale`` section; neither means a fixed pool."""
    # The spec's section: a --spec master's job's (a shared fleet's, the oldest job's at start).
    first = next(iter(service.fleet.jobs.values()), None)
    from_spec = (first.job.spec.autoscale if first is not None else None) or {}
    if not args.autoscale and not from_spec:
        return None
    config = AutoscaleConfig()
    config.min_workers = args.min_workers or from_spec.get("min_workers", config.min_workers)
    config.max_workers = args.max_workers or from_spec.get("max_workers", config.max_workers)
    return config


if __name__ == "__main__":
    sys.exit(main())
