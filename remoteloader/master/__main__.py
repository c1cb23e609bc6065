"""``remoteloader-master --bind tcp://127.0.0.1:5555 [--spec SPEC] [--journal DIR] [--workers N]``"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Optional, Sequence

from ..procs import die_with_parent
from ..spec import DatasetSpec, SpecError
from .journal import Journal
from .launcher import LocalLauncher
from .server import MasterServer
from .service import MasterConfig, MasterService


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="remoteloader-master", description="The remoteloader master (control plane).")
    p.add_argument("--bind", default="tcp://127.0.0.1:5555", help="address to listen on (port 0: any free port)")
    p.add_argument("--spec", help="dataset spec (YAML/JSON); without it, the first client's spec becomes the job")
    p.add_argument("--journal", help="directory of the state journal; without it state lives in memory only")
    p.add_argument("--workers", type=int, default=0, help="local worker processes to start and keep running")
    p.add_argument("--worker-buffer", type=int, default=16, help="batches each local worker may buffer")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds without heartbeat before a worker is dead")
    p.add_argument("--split-timeout", type=float, default=60.0,
                   help="seconds a worker may hold a split without progress before it is re-queued")
    p.add_argument("--max-workers-per-client", type=int, default=32, help="partitioned round robin: workers per client")
    p.add_argument("--die-with-parent", action="store_true", help="exit when the launching process dies")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s master %(levelname)s %(message)s")
    if args.die_with_parent:
        die_with_parent()

    config = MasterConfig(heartbeat_timeout=args.heartbeat_timeout, max_workers_per_client=args.max_workers_per_client,
                          split_timeout=args.split_timeout)
    service = MasterService(config, Journal(args.journal) if args.journal else None)
    if args.spec and service.state.job is None:
        try:
            service.submit(DatasetSpec.from_file(args.spec))
        except SpecError as e:
            print(f"remoteloader-master: {e}", file=sys.stderr)
            return 2
    server = MasterServer(service, args.bind)
    launcher = LocalLauncher(server.addr, ["--buffer-batches", str(args.worker_buffer)])
    if args.workers:
        launcher.start(args.workers)

        def keep_workers() -> None:  # DPP's master restarts failed workers; so does this one
            if launcher.reap():
                launcher.start(args.workers - launcher.running())
        server.periodic.append(keep_workers)

    signal.signal(signal.SIGTERM, lambda *_: server.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: server.stop_event.set())
    print(f"remoteloader-master listening on {server.addr}", flush=True)
    try:
        server.serve_forever()
    finally:
        launcher.stop_all()
        if service.journal is not None:
            service.journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
