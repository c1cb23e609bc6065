"""``remoteloader-worker --master tcp://HOST:PORT``: one stateless worker process."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Optional, Sequence

from ..formats import DEFAULT_COALESCE_GAP
from ..core.procs import die_with_parent
from .server import Faults, Worker


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="remoteloader-worker", description=__doc__)
    p.add_argument("--master", required=True, help="the master's address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--bind-host", default="127.0.0.1", help="interface the data port binds to (default 127.0.0.1)")
    p.add_argument("--buffer-batches", type=int, default=16, help="bounded buffer size in batches")
    p.add_argument("--coalesce-gap", type=int, default=DEFAULT_COALESCE_GAP,
                   help="merge reads of selected column streams whose gap is at most this many bytes "
                        "(default 1.25 MiB; 0: one request per stream)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds to wait for clients to consume what this worker holds")
    p.add_argument("--die-with-parent", action="store_true", help="exit when the launching process dies")
    p.add_argument("--inject-batch-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests only
    p.add_argument("--inject-hang-after", type=int, default=-1, help=argparse.SUPPRESS)  # tests only
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s worker %(levelname)s %(message)s")
    if args.die_with_parent:
        die_with_parent()
    worker = Worker(args.master, bind_host=args.bind_host, buffer_batches=args.buffer_batches,
                    drain_timeout_s=args.drain_timeout, coalesce_gap=args.coalesce_gap,
                    faults=Faults(args.inject_batch_delay, args.inject_hang_after))
    # SIGTERM (scale-down, orderly shutdown) drains; SIGINT (Ctrl-C) stops at once.
    signal.signal(signal.SIGTERM, lambda *_: worker.request("drain"))
    signal.signal(signal.SIGINT, lambda *_: worker.request("stop"))
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
